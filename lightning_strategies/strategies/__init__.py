"""Lightning strategies: glue from Lightning's hooks to :mod:`lightning_strategies.comm`."""

from lightning_strategies.strategies._registry import STRATEGY_ROWS, StrategyRow, register_strategies

__all__ = ["STRATEGY_ROWS", "StrategyRow", "register_strategies"]
