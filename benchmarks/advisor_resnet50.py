"""The advisor's table for ResNet-50 (recipe resnet50_synthetic: 224 px, batch 64 per device, SGD) on a
cluster preset, compute from the preset's stated throughput over counted FLOPs (docs/advisor.md).

    python benchmarks/advisor_resnet50.py                 # a100: writes results/advisor_resnet50_a100.txt
    python benchmarks/advisor_resnet50.py --cluster h100  # results/advisor_resnet50_h100.txt
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import header, load_line
from recipes.advise import main as advise_main

RESULTS = Path(__file__).parent / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="a100")
    args = parser.parse_args()
    torch.set_num_threads(1)
    text = [header(f"advisor_resnet50: recipe=resnet50_synthetic cluster={args.cluster}"), load_line("start")]
    out = io.StringIO()
    png = RESULTS / f"advisor_resnet50_{args.cluster}.png"
    with contextlib.redirect_stdout(out):
        code = advise_main(["recipe=resnet50_synthetic", f"cluster={args.cluster}", "--png", str(png)])
    text += [out.getvalue().rstrip(), load_line("end")]
    print("\n".join(text), flush=True)
    (RESULTS / f"advisor_resnet50_{args.cluster}.txt").write_text("\n".join(text) + "\n")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
