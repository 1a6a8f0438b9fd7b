"""Which strategy? Predicted step time, memory and bytes per strategy for a model on a cluster.

m = measure(module, batch)                       # on this machine (or tflops=... for a device)
advice = advise(m, load_cluster("a100"))         # every strategy, ranked
advice.best().overrides()                        # ["strategy=ring"] for the Hydra app
"""

from lightning_strategies.advisor.advise import STRATEGIES, Advice, NoStrategyFitsError, StrategyAdvice, advise
from lightning_strategies.advisor.cluster import Cluster, load_cluster, preset_names
from lightning_strategies.advisor.measure import Measurement, measure
from lightning_strategies.advisor.memory import Memory, memory
from lightning_strategies.advisor.report import to_json, to_table, write_png

__all__ = [
    "STRATEGIES",
    "Advice",
    "Cluster",
    "Measurement",
    "Memory",
    "NoStrategyFitsError",
    "StrategyAdvice",
    "advise",
    "load_cluster",
    "measure",
    "memory",
    "preset_names",
    "to_json",
    "to_table",
    "write_png",
]
