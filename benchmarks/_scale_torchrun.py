"""What each torchrun worker of ``benchmarks/scale.py``'s 2 nodes x 2 run executes: ``_scale_torchrun.py CFG OUT``.

torchrun sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``; the process group is
gloo over them; global rank 0 writes the repetitions of :func:`~benchmarks._scale_measure.world_worker`
to ``OUT`` (JSON).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._scale_measure import world_worker


def main() -> int:
    cfg_path, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    cfg = json.loads(cfg_path.read_text())
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=180))
    try:
        rows = world_worker(rank, world, cfg)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        out_path.write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
