"""Large-batch optimizers (LAMB, LARS) and weight-decay parameter groups."""

from lightning_strategies.optim.lamb import Lamb
from lightning_strategies.optim.lars import Lars
from lightning_strategies.optim.param_groups import param_groups

__all__ = ["Lamb", "Lars", "param_groups"]
