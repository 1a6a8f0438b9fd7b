"""``comm/pipeline_stages``: blocks held apart, rank 0's weights distributed, moved, gathered back (gloo).

Each test runs fork-started ranks joined by a gloo group and holds the result to what a single
process computes: the unsplit model's tensors, written out (every comparison exact: tensors are
copied, never computed).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers
from torch import nn

from lightning_strategies.comm.pipeline_stages import (
    StageLayout,
    distribute_blocks,
    gather_optimizer_state,
    gather_state_dict,
    move_blocks,
    tensors_of,
)

pytestmark = pytest.mark.slow


def _blocks(seed: int, device: str = "cpu") -> nn.Sequential:
    torch.manual_seed(seed)
    with torch.device(device):
        return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 6), nn.Linear(6, 3))


def _groups(world: int, stages: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """This rank's pipeline and data-parallel groups of a ``(world / stages) x stages`` mesh
    (every rank creates every group, in the same order)."""
    rank, pp, dp = dist.get_rank(), None, None
    for r in range(world // stages):
        g = dist.new_group(list(range(r * stages, (r + 1) * stages)))
        pp = g if rank // stages == r else pp
    for s in range(stages):
        g = dist.new_group(list(range(s, world, stages)))
        dp = g if rank % stages == s else dp
    assert pp is not None
    return pp, dp


def _file_backed(t: torch.Tensor) -> bool:
    """Whether ``t``'s data lies in a mapping of one of Spill's (unlinked) files."""
    with open("/proc/self/maps") as f:
        spans = [line.split()[0] for line in f if ".pipeline-spill-" in line]
    p = t.data_ptr()
    return any(int(a, 16) <= p < int(b, 16) for a, b in (s.split("-") for s in spans))


def _distribute(rank: int, world: int, stages: int, meta: bool) -> dict[str, Any]:
    pp, dp = _groups(world, stages)
    # every rank builds its own (different) weights, or all build on meta; rank 0 seeds 0 before setup
    blocks = _blocks(seed=rank + 10, device="meta" if meta else "cpu")
    torch.manual_seed(0)
    layout = StageLayout((2, 3), stages)
    distribute_blocks(blocks, layout, pp_group=pp, dp_group=dp, device=torch.device("cpu"))
    with_tensors = [(i, tensors_of(b)) for i, b in enumerate(blocks) if tensors_of(b)]
    held = {i: [t.tolist() for t in ts] for i, ts in with_tensors if not any(t.is_meta for t in ts)}
    meta_blocks = [i for i, ts in with_tensors if all(t.is_meta for t in ts)]
    return {"held": held, "meta": meta_blocks}


@pytest.mark.parametrize(("world", "meta"), [(2, False), (2, True), (4, False)], ids=["eager", "meta", "2x2-eager"])
def test_each_stage_owner_gets_rank_0s_weights_and_nothing_else(world: int, meta: bool) -> None:
    """Eager: rank 0's own values reach every owner (the others' differ: seeds 10 + rank). Meta:
    rank 0 initialises each block with reset_parameters() from its RNG (seeded 0 before), which
    equals the unsplit model built eagerly on CPU after manual_seed(0)."""
    results = run_workers(_distribute, world, 2, meta, timeout=60)
    want = _blocks(seed=0) if meta else _blocks(seed=10)
    layout = StageLayout((2, 3), 2)
    for rank, result in enumerate(results):
        mine = [i for i in layout.blocks_of(rank % 2) if tensors_of(want[i])]
        assert sorted(result["held"]) == mine, rank
        assert sorted(result["meta"]) == [i for i in range(5) if tensors_of(want[i]) and i not in mine], rank
        for i in mine:
            assert result["held"][i] == [t.tolist() for t in tensors_of(want[i])], (rank, i)


def _gather(rank: int, world: int) -> dict[str, Any]:
    pp, _ = _groups(world, world)
    blocks = _blocks(seed=0)
    layout = StageLayout((2, 3), world)
    distribute_blocks(blocks, layout, pp_group=pp, dp_group=None, device=torch.device("cpu"))
    owner = {id(t): layout.owner_of_block(i) for i, b in enumerate(blocks) for t in tensors_of(b)}
    state = blocks.state_dict(keep_vars=True)
    owners = {k: owner[id(v)] for k, v in state.items()}
    opt = torch.optim.Adam(blocks.parameters(), lr=0.1)
    for p in blocks.parameters():
        if not p.is_meta:
            p.grad = torch.ones_like(p)
    opt.step()  # state for this rank's parameters only (exp_avg, exp_avg_sq, a CPU step tensor)
    model = gather_state_dict(state, owners, group=pp, device=torch.device("cpu"), spill_dir=None)
    optim = gather_optimizer_state(opt.state_dict(), group=pp, device=torch.device("cpu"))
    return {
        "model": {k: v.tolist() for k, v in model.items()},
        "file_backed": all(_file_backed(v) for v in model.values())
        and all(_file_backed(v) for s in optim.get("state", {}).values() for v in s.values()),
        "optim": {i: {k: v.tolist() for k, v in s.items()} for i, s in optim.get("state", {}).items()},
        "groups": optim.get("param_groups"),
    }


def test_gathered_model_and_adam_state_equal_the_unsplit_models_and_are_memory_mapped() -> None:
    """Rank 0 receives every stage's tensors into memory-mapped files: after one Adam step with
    all-ones gradients, the model and Adam's state equal the unsplit model's after the same step
    (built after the same seed), indexed as over it; the other rank gets nothing."""
    first, second = run_workers(_gather, 2, timeout=60)
    assert second["model"] == {} and second["optim"] == {} and second["groups"] is None
    want = _blocks(seed=0)
    opt = torch.optim.Adam(want.parameters(), lr=0.1)
    for p in want.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    ref = opt.state_dict()
    assert first["model"] == {k: v.tolist() for k, v in want.state_dict().items()}
    assert first["optim"] == {i: {k: v.tolist() for k, v in s.items()} for i, s in ref["state"].items()}
    assert first["groups"] == ref["param_groups"]
    assert first["file_backed"]


def _move(rank: int, world: int) -> dict[str, Any]:
    pp, _ = _groups(world, world)
    blocks = _blocks(seed=0)
    old, new = StageLayout((1, 4), 2), StageLayout((4, 1), 2)
    distribute_blocks(blocks, old, pp_group=pp, dp_group=None, device=torch.device("cpu"))
    opt = torch.optim.SGD(blocks.parameters(), lr=0.1, momentum=0.9)
    for p in blocks.parameters():
        if not p.is_meta:
            p.grad = torch.full_like(p, 2.0)
    opt.step()
    move_blocks(blocks, old, new, group=pp, device=torch.device("cpu"), optimizers=[opt])
    params = [p for g in opt.param_groups for p in g["params"]]
    return {
        "held": [i for i, b in enumerate(blocks) if tensors_of(b) and not any(t.is_meta for t in tensors_of(b))],
        "values": {k: v.tolist() for k, v in blocks.state_dict().items() if not v.is_meta},
        "momentum": {i: opt.state[p]["momentum_buffer"].tolist() for i, p in enumerate(params) if p in opt.state},
        "optimizer_holds_module_params": all(a is b for a, b in zip(params, blocks.parameters(), strict=True)),
    }


def test_moved_blocks_keep_their_values_and_momentum_on_the_new_owner() -> None:
    """Blocks 1-3 move from rank 1 to rank 0 (layout [1, 4] -> [4, 1]) with their SGD momentum
    (2.0 after one step with gradients of 2), and each optimizer lists the new parameter objects."""
    first, second = run_workers(_move, 2, timeout=60)
    want = _blocks(seed=0)
    with torch.no_grad():
        for p in want.parameters():
            p -= 0.1 * 2.0  # one SGD step, gradients 2, lr 0.1
    assert first["held"] == [0, 1, 3] and second["held"] == [4]
    expected = {k: v.tolist() for k, v in want.state_dict().items()}
    for result in (first, second):
        assert result["values"] == {k: expected[k] for k in result["values"]}
        assert result["optimizer_holds_module_params"]
    assert sorted(first["momentum"]) == [0, 1, 2, 3, 4, 5] and sorted(second["momentum"]) == [6, 7]
    for result in (first, second):
        for values in result["momentum"].values():
            assert torch.tensor(values).eq(2.0).all()
