"""PipelineStrategy: options, the block partition, the module contract, and the errors (one process)."""

from __future__ import annotations

import itertools

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from lightning_utils import TinyRegressor, one_process_group_cleanup, regression_data
from torch import nn
from torch.utils.data import DataLoader

import lightning_strategies  # registers "pipeline"
from lightning_strategies.comm.pipeline import partition_blocks, profile_blocks
from lightning_strategies.pipeline_protocol import PipelineModule, check_pipeline_module
from lightning_strategies.strategies.pipeline import PipelineStrategy
from recipes.classification import ClassificationModule
from recipes.models import build_model


class PipeRegressor(TinyRegressor):
    """TinyRegressor plus the two protocol methods (its net is 3 blocks)."""

    def pipeline_layers(self) -> nn.Sequential:
        return self.net

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(outputs, targets)


def test_registered_and_schedule_names_case_insensitive() -> None:
    assert "pipeline" in StrategyRegistry and "pipeline_fork" in StrategyRegistry
    strategy = StrategyRegistry.get("pipeline")
    assert isinstance(strategy, PipelineStrategy)
    assert PipelineStrategy(schedule="GPipe").schedule == "gpipe"
    assert PipelineStrategy(schedule="Interleaved_1F1B").stages_per_rank == 2


def test_unknown_schedule_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"'zero_bubble'.*'gpipe', '1f1b', 'interleaved_1f1b'"):
        PipelineStrategy(schedule="zero_bubble")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"balance": "flops"}, r"unknown balance.*'params', 'time'"),
        ({"balance": [2, 0]}, "positive block counts"),
        ({"microbatches": 0}, "microbatches=0"),
        ({"num_stages": -1}, "num_stages=-1"),
        ({"schedule": "gpipe", "stages_per_rank": 2}, "only 'interleaved_1f1b' runs several stages"),
    ],
)
def test_bad_options(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PipelineStrategy(**kwargs)


def test_world_size_that_does_not_factor_fails_when_the_trainer_is_built() -> None:
    with pytest.raises(ValueError, match=r"3 is not a multiple of 2.*num_stages dividing 3 \(e.g. 1, 3\)"):
        pl.Trainer(accelerator="cpu", devices=3, strategy=PipelineStrategy(num_stages=2, start_method="fork"))


def test_1f1b_needs_as_many_microbatches_as_stages_and_gpipe_warns() -> None:
    with pytest.raises(ValueError, match=r"microbatches >= 2, or schedule='gpipe'"):
        pl.Trainer(accelerator="cpu", devices=2, strategy=PipelineStrategy(microbatches=1, start_method="fork"))
    with pytest.warns(UserWarning, match="1 micro-batches for 2 stages"):
        pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=PipelineStrategy(schedule="gpipe", microbatches=1, start_method="fork"),
        )


def test_replicas_and_sampler_shard_over_replicas_only() -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=PipelineStrategy(num_stages=2, start_method="fork"))
    strategy = trainer.strategy
    assert isinstance(strategy, PipelineStrategy)
    assert (strategy.replicas, strategy.num_stages, strategy.microbatches) == (2, 2, 8)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}
    assert lightning_strategies.replicas_of(strategy) == 2


def test_module_without_the_protocol_gets_an_error_naming_both_methods() -> None:
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=PipelineStrategy(), max_steps=1, logger=False, enable_progress_bar=False
    )
    with pytest.raises(TypeError, match=r"missing pipeline_layers, pipeline_loss.*pipeline_layers\(\) ->"):
        trainer.fit(TinyRegressor(), DataLoader(regression_data(), batch_size=8))
    with pytest.raises(TypeError, match="pipeline_loss"):
        check_pipeline_module(nn.Linear(2, 2))


def test_more_stages_than_blocks() -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=PipelineStrategy(start_method="fork"))
    strategy = trainer.strategy
    assert isinstance(strategy, PipelineStrategy)
    with pytest.raises(ValueError, match=r"4 stages .* only 3 blocks.*at most 3 stages"):
        strategy._check_blocks(len(PipeRegressor().pipeline_layers()))
    bad_list = PipelineStrategy(balance=[1, 1], start_method="fork")
    pl.Trainer(accelerator="cpu", devices=2, strategy=bad_list)
    with pytest.raises(ValueError, match=r"expected 2 block counts .* adding up to the 3 blocks"):
        bad_list._check_blocks(3)


def test_batch_not_divisible_by_microbatches_x_replicas() -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=PipelineStrategy(num_stages=2, start_method="fork"))
    strategy = trainer.strategy
    assert isinstance(strategy, PipelineStrategy)
    with pytest.raises(ValueError, match="global batch 12 is not divisible by 8 microbatches x 2 replicas"):
        strategy._check_batch_size(6)
    strategy._check_batch_size(16)


def test_recipe_module_implements_the_protocol() -> None:
    module = ClassificationModule(
        build_model("resnet18", num_classes=10, in_channels=1, width=8),
        num_classes=10,
        optimizer=torch.optim.SGD,
    )
    assert isinstance(module, PipelineModule)
    blocks = module.pipeline_layers()
    x = torch.randn(2, 1, 16, 16)
    module.eval()
    torch.testing.assert_close(blocks(x), module(x))


def _brute_force(costs: list[float], parts: int) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), parts - 1):
        bounds = [0, *cuts, len(costs)]
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_partition_minimises_the_slowest_stage(parts: int) -> None:
    g = torch.Generator().manual_seed(parts)
    for _ in range(20):
        costs = torch.rand(7, generator=g).tolist()
        counts = partition_blocks(costs, parts)
        assert len(counts) == parts and sum(counts) == 7 and min(counts) >= 1
        bounds = [0, *itertools.accumulate(counts)]
        largest = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        assert largest == pytest.approx(_brute_force(costs, parts))
    with pytest.raises(ValueError, match="cannot split 7 blocks into 8 pipeline stages"):
        partition_blocks([1.0] * 7, 8)


def test_profile_blocks_times_each_block_and_leaves_no_trace() -> None:
    blocks = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    before = [t.clone() for t in blocks.state_dict().values()]
    seconds = profile_blocks(blocks, torch.randn(8, 16), repeats=2)
    assert len(seconds) == 3 and all(s > 0 for s in seconds)
    assert all(p.grad is None for p in blocks.parameters())
    for a, b in zip(before, blocks.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b)


def test_other_precisions_are_refused_with_the_supported_ones() -> None:
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=PipelineStrategy(), precision="bf16-true", max_steps=1,
        logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )  # fmt: skip
    refused = r"found the precision plugin HalfPrecision: expected 32-true, bf16-mixed or 16-mixed.*Fix"
    with one_process_group_cleanup(), pytest.raises(ValueError, match=refused):
        trainer.fit(PipeRegressor(), DataLoader(regression_data(), batch_size=8))
