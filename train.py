"""Hydra entry point: ``python train.py [group=option ...] [key=value ...]``; see conf/train.yaml."""

import sys
from typing import Any

import hydra
from omegaconf import DictConfig

from recipes import report
from recipes.train import run


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> dict[str, Any]:
    return run(cfg)


if __name__ == "__main__":
    main()
    # A sweep whose jobs failed still writes its report, then exits non-zero.
    sys.exit(1 if report.FAILED_JOBS else 0)
