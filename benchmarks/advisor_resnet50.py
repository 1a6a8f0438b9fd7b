"""The advisor's table for ResNet-50 (recipe resnet50_synthetic: 224 px, batch 64 per device, SGD) on a
cluster preset, compute from the preset's stated throughput over counted FLOPs (docs/advisor.md).

The table is printed as comment lines, then per strategy ``advisor_resnet50_step_s_<name>`` (s),
``..._efficiency_<name>`` (x), ``..._memory_gib_<name>`` (GiB) and ``..._rank_<name>``, and the
measured ``advisor_resnet50_grad_bytes`` (4 x 25,557,032: ResNet-50's float32 gradients).

    python benchmarks/advisor_resnet50.py                 # a100: writes results/advisor_resnet50_a100.{txt,png}
    python benchmarks/advisor_resnet50.py --cluster h100  # results/advisor_resnet50_h100.{txt,png}
    python benchmarks/advisor_resnet50.py --quick         # 64 px, batch 8: the same lines, nothing written (CI)
"""

from __future__ import annotations

import argparse
import io
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console

from benchmarks._common import header, line, load_line
from lightning_strategies.advisor import to_table, write_png
from recipes.advise import _compose, advice_for

RESULTS = Path(__file__).parent / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="a100")
    parser.add_argument("--quick", action="store_true", help="64 px images, batch 8; nothing written (CI)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    small = ["data.image_size=64", "data.batch_size=8"] if args.quick else []
    text = [header(f"advisor_resnet50: recipe=resnet50_synthetic cluster={args.cluster} {' '.join(small)}".rstrip()),
            load_line("start")]  # fmt: skip
    print("\n".join(text), flush=True)
    cfg = _compose(["recipe=resnet50_synthetic", f"cluster={args.cluster}", *small], None)
    advice = advice_for(cluster=cfg.cluster, model=cfg.model, data=cfg.data, optimizer=cfg.optimizer)
    table = io.StringIO()
    Console(file=table, width=180).print(to_table(advice))
    text.append("\n".join(f"# {t}" for t in table.getvalue().rstrip().splitlines()))
    print(text[-1], flush=True)
    text.append(line("advisor_resnet50_grad_bytes", advice.measurement.grad_bytes, "bytes"))
    for row in advice.rows:
        if not math.isfinite(row.step_s):
            continue
        text.append(line(f"advisor_resnet50_step_s_{row.name}", row.step_s, "s"))
        text.append(line(f"advisor_resnet50_efficiency_{row.name}", row.efficiency, "x"))
        text.append(line(f"advisor_resnet50_memory_gib_{row.name}", row.memory.total / 2**30, "GiB"))
        if row.rank is not None:
            text.append(line(f"advisor_resnet50_rank_{row.name}", row.rank, "rank"))
    best = advice.best()
    text.append(f"# measured: {advice.measurement.timed_on}")
    text.append(f"# first choice: python train.py {' '.join(best.overrides())}  ({best.reason})")
    if not args.quick:
        png = RESULTS / f"advisor_resnet50_{args.cluster}.png"
        text.append(f"# png: {write_png(advice, png)}")
    text.append(load_line("end"))
    print("\n".join(text[-4 if not args.quick else -3 :]), flush=True)
    if not args.quick:
        (RESULTS / f"advisor_resnet50_{args.cluster}.txt").write_text("\n".join(text) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
