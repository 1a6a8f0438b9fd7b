"""lightning-strategies: distribution strategies for the PyTorch Lightning ``Trainer``.

Importing the package registers its strategy names with Lightning's ``StrategyRegistry`` (``Trainer(strategy="ring")``
works after ``import lightning_strategies``); ``Fabric(strategy="ring")`` raises an error: they are Trainer strategies.
"""

from lightning_strategies.checkpoint import AtomicCheckpointIO, CorruptCheckpointError
from lightning_strategies.comm.heartbeat import PeerLostError
from lightning_strategies.comm.ring import ring_all_reduce
from lightning_strategies.comm.stats import CommStats
from lightning_strategies.data import DevicePrefetcher, EpochRandomSampler, PrefetchConfig, ResumableDataLoader
from lightning_strategies.faults import PeerFailureReport
from lightning_strategies.pipeline_protocol import PipelineModule
from lightning_strategies.scaling import (
    LinearWarmup,
    ScalingConfig,
    ScalingPlan,
    global_batch_size,
    plan_scaling,
    replicas_of,
    scaled_lr,
)
from lightning_strategies.strategies._registry import register_fabric_refusals, register_strategies
from lightning_strategies.strategies.async_elastic import AsyncElasticStrategy
from lightning_strategies.strategies.async_ps import AsyncParameterServerStrategy
from lightning_strategies.strategies.ft import FTStrategy
from lightning_strategies.strategies.parameter_server import ParameterServerStrategy
from lightning_strategies.strategies.pipeline import PipelineStrategy
from lightning_strategies.strategies.ps_ring import RingParameterServerStrategy
from lightning_strategies.strategies.ring import RingAllReduceStrategy
from lightning_strategies.strategies.tensor import TensorParallelStrategy

__version__ = "0.1.0"

__all__ = [
    "AsyncElasticStrategy",
    "AsyncParameterServerStrategy",
    "AtomicCheckpointIO",
    "CommStats",
    "CorruptCheckpointError",
    "DevicePrefetcher",
    "EpochRandomSampler",
    "FTStrategy",
    "LinearWarmup",
    "ParameterServerStrategy",
    "PeerFailureReport",
    "PeerLostError",
    "PipelineModule",
    "PipelineStrategy",
    "PrefetchConfig",
    "ResumableDataLoader",
    "RingAllReduceStrategy",
    "RingParameterServerStrategy",
    "ScalingConfig",
    "ScalingPlan",
    "TensorParallelStrategy",
    "__version__",
    "global_batch_size",
    "plan_scaling",
    "replicas_of",
    "ring_all_reduce",
    "scaled_lr",
]

register_strategies()
register_fabric_refusals()  # Fabric(strategy="ring") says these are Trainer strategies
