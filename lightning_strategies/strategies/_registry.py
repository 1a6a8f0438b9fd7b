"""The strategy names this package adds to Lightning's ``StrategyRegistry`` on ``import lightning_strategies``.

Variants are rows, not subclasses: ``"ring_bf16"`` is ``RingAllReduceStrategy`` with ``wire_dtype="bf16"``.
Fabric's registry gets each name as a refusal saying these are Trainer strategies (they hook the Trainer's
loop, logging and callbacks), so ``Fabric(strategy="ring")`` says what to use, not "invalid strategy name".
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

__all__ = ["STRATEGY_ROWS", "StrategyRow", "register_fabric_refusals", "register_strategies"]


@dataclass(frozen=True)
class StrategyRow:
    """One registered name.

    Attributes:
        name: the string users pass as ``Trainer(strategy=name)``.
        target: ``"module:ClassName"`` of the strategy class, imported when registered.
        init_params: keyword arguments the class is built with for this name.
        description: one line shown by ``StrategyRegistry.available_strategies()`` users.
    """

    name: str
    target: str
    description: str
    init_params: dict[str, Any] = field(default_factory=dict)

    def strategy_class(self) -> type:
        module_name, _, cls_name = self.target.partition(":")
        return getattr(importlib.import_module(module_name), cls_name)


_PS = "lightning_strategies.strategies.parameter_server:ParameterServerStrategy"
_PS_RING = "lightning_strategies.strategies.ps_ring:RingParameterServerStrategy"
_ASYNC = "lightning_strategies.strategies.async_ps:AsyncParameterServerStrategy"
_RING = "lightning_strategies.strategies.ring:RingAllReduceStrategy"
_PIPELINE = "lightning_strategies.strategies.pipeline:PipelineStrategy"
_TENSOR = "lightning_strategies.strategies.tensor:TensorParallelStrategy"


def _fork(name: str, target: str) -> StrategyRow:
    return StrategyRow(
        f"{name}_fork",
        target,
        f"'{name}' with fork-started processes (like 'ddp_fork'; CPU, notebooks, tests)",
        init_params={"start_method": "fork"},
    )


STRATEGY_ROWS: tuple[StrategyRow, ...] = (
    StrategyRow(
        "parameter_server",
        _PS,
        "Synchronous sharded parameter servers over torch.distributed.rpc (one shard per process)",
    ),
    StrategyRow("ps", _PS, "Alias of 'parameter_server'"),
    _fork("ps", _PS),
    StrategyRow(
        "ps_ring",
        _PS_RING,
        "'ps' with its co-located shards pushed and pulled over our ring's reduce-scatter and all-gather (no RPC)",
    ),
    _fork("ps_ring", _PS_RING),
    StrategyRow(
        "async",
        _ASYNC,
        "Asynchronous sharded parameter servers: pushes applied on arrival, optional staleness bound, dynamic batches",
    ),
    _fork("async", _ASYNC),
    StrategyRow(
        "async_elastic",
        "lightning_strategies.strategies.async_elastic:AsyncElasticStrategy",
        "'async' with a dedicated server (rank 0): lost workers are dropped and their batches redrawn, "
        "relaunched ones rejoin",
        init_params={"dedicated_servers": True, "num_servers": 1},
    ),
    StrategyRow(
        "ring", _RING, "DDP whose gradient buckets are averaged by our ring all-reduce (reduce-scatter + all-gather)"
    ),
    StrategyRow(
        "ring_bf16",
        _RING,
        "'ring' sending gradients as bfloat16 on the wire, accumulating in their own dtype",
        init_params={"wire_dtype": "bf16"},
    ),
    StrategyRow(
        "ring_hier",
        _RING,
        "'ring' hierarchical on any number of nodes: reduce-scatter inside each node, a ring across nodes on "
        "1/local_size of the gradients, all-gather inside each node ('ring' does this itself on >1 node)",
        init_params={"hierarchical": True},
    ),
    StrategyRow(
        "pipeline",
        _PIPELINE,
        "Pipeline model parallelism (GPipe / 1F1B / interleaved 1F1B, torch.distributed.pipelining) x data parallel",
    ),
    _fork("pipeline", _PIPELINE),
    StrategyRow(
        "tensor",
        _TENSOR,
        "Intra-layer model parallelism: nn.Linear layers split Megatron-style (DTensor) x data parallel",
    ),
    _fork("tensor", _TENSOR),
    StrategyRow(
        "ft",
        "lightning_strategies.strategies.ft:FTStrategy",
        "Fault-tolerant data parallel on torchft: each process a replica group, lost replicas leave the quorum, "
        "restarted ones heal from a live peer",
    ),
    StrategyRow(
        "local_sgd",
        "lightning_strategies.strategies.ft:FTStrategy",
        "'ft' with LocalSGD: sync_every local steps, then the parameters averaged",
        init_params={"algorithm": "local_sgd"},
    ),
    StrategyRow(
        "diloco",
        "lightning_strategies.strategies.ft:FTStrategy",
        "'ft' with DiLoCo: sync_every AdamW steps, then the mean pseudo-gradient and a Nesterov outer step "
        "(fragments > 1: Streaming DiLoCo)",
        init_params={"algorithm": "diloco"},
    ),
)


def register_strategies(registry: Any = StrategyRegistry) -> list[str]:
    """Register every row of :data:`STRATEGY_ROWS` that the registry does not hold yet; returns their names."""
    added = [row for row in STRATEGY_ROWS if row.name not in registry]
    for row in added:
        registry.register(row.name, row.strategy_class(), description=row.description, **row.init_params)
    return [row.name for row in added]


class TrainerOnlyStrategyError(ValueError):
    """A strategy name of this package given to Lightning Fabric."""


def _trainer_only(name: str) -> Any:
    def refuse(**kwargs: Any) -> Any:
        raise TrainerOnlyStrategyError(
            f"Fabric(strategy={name!r}): found a lightning-strategies strategy, which is a Trainer strategy "
            "(lightning.pytorch): it works through the Trainer's loop, logging and callbacks; expected a "
            "Fabric strategy (lightning.fabric.strategies). Fix: train with lightning.pytorch.Trainer(strategy="
            f"{name!r}), or use Fabric(strategy='ddp') and call lightning_strategies.comm "
            "(ring_all_reduce, ...) on its process group yourself"
        )

    return refuse


def register_fabric_refusals(registry: Any = None) -> list[str]:
    """Register each name of :data:`STRATEGY_ROWS` Fabric does not know as a clear refusal; returns those names."""
    if registry is None:
        from lightning.fabric.strategies import STRATEGY_REGISTRY as registry
    added = [row for row in STRATEGY_ROWS if row.name not in registry]
    for row in added:
        registry.register(row.name, _trainer_only(row.name), description=f"Trainer only: {row.description}")
    return [row.name for row in added]
