"""Hydra entry point: ``python train.py [group=option ...] [key=value ...]``; see conf/train.yaml."""

import sys

import hydra
from omegaconf import DictConfig

from recipes.app import exit_code, task


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    # the value of cfg.optimized_metric (val_acc by default): what an Optuna sweep maximises
    return task(cfg)


if __name__ == "__main__":
    main()
    # A sweep whose jobs failed still writes its report, then exits non-zero (under every launcher).
    sys.exit(exit_code())
