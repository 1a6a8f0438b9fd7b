"""``ft``, ``local_sgd`` and ``diloco`` on torchft: 2 replicas on CPU (gloo), each its own process,
started by the strategy's launcher from ``_ft_fit.py`` (replica 0 hosts the Lighthouse).

Every case runs :class:`~lightning_utils.TinyRegressor` on 64 regression samples, batches of 8 per
replica from Lightning's ``DistributedSampler`` (4 steps per epoch), and holds the run to a reference:

- ``ft`` with nothing failing equals DDP (``ddp_fork``, same sampler, same SGD + momentum) bit for
  bit: each replica computes the same gradient on the same batch, torchft sums the two and divides
  by 2, DDP divides each by 2 and sums; with two operands both are exactly ``round(a + b) / 2``.
- ``ft`` with replica 1 SIGKILLed at its step 3: replica 0 goes on alone (steps with 1
  participant), the launcher starts replica 1 again, it heals from replica 0 (weights, optimizer,
  Lightning's loop progress) and both end with equal weights and ``global_step == Manager step``.
- ``local_sgd`` / ``diloco`` with nothing failing equal a one-process simulation of the algorithm
  on the same shards (H inner steps per replica on its own batches; the mean of the parameters, or
  of the pseudo-gradients and a Nesterov SGD outer step): the same float operations in the same
  order, so exactly (the two-operand sum is order-free).
  The Manager's step counts the syncs plus the commit of the job's first quorum.
- ``diloco`` on the regressor with a ``BatchNorm1d`` equals the same simulation with each replica's
  running statistics replaced by their mean at every sync (``sync_buffers``' default), exactly.
- ``diloco`` with replica 1 SIGKILLed at the start of a sync: replica 0 commits the sync alone,
  the restarted replica heals (outer loop included) and both end equal.
- ``diloco`` with replica 1 SIGKILLed inside a sync's all-reduce, either right after it issued its
  values (replica 0 commits the sync with both if they had crossed, else alone after a retry) or in
  the sync's quorum before it issued them (replica 0's all-reduce fails in flight: it syncs again
  alone on a new quorum); the restarted replica heals and both end equal.
- Streaming DiLoCo with the overlap (``fragment_sync_delay`` tau = 1, merge weight 0.5) equals a
  one-process simulation of torchft's schedule exactly (the same operations as above, plus the same
  ``lerp``), and each fragment's all-reduce was in flight while tau inner steps ran (timestamps).
- ``diloco`` stopped after step 6 with a checkpoint (one file per replica) and resumed ends as the
  uninterrupted run: weights, inner AdamW state and the outer loop's global copy and momentum
  (a :class:`~lightning_strategies.ResumableDataLoader`, so that the resume takes the next batch;
  a plain loader starts the epoch's batches again, as in Lightning).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from fault_utils import run_forked
from lightning_utils import TinyRegressor, one_process_group_cleanup, quiet_trainer, regression_data
from torch.utils.data import DataLoader, DistributedSampler

from lightning_strategies.comm.ft import average_buffers, split_fragments

pytest.importorskip("torchft")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("_ft_fit.py")
JOB_TIMEOUT_S = 240.0
N, BATCH, REPLICAS = 64, 8, 2
FAST = {"heartbeat_timeout_s": 1.0, "join_timeout_s": 0.5, "quorum_timeout_s": 60.0, "step_timeout_s": 20.0}


def run_case(tmp_path: Path, name: str, **cfg: Any) -> dict[tuple[int, int], dict[str, Any]]:
    """Run one case to its end; the records ``{(replica, start): record}`` it wrote."""
    out = tmp_path / name
    out.mkdir()
    cfg = {"out": str(out), "replicas": REPLICAS, "n": N, "batch_size": BATCH, **cfg}
    cfg["strategy"] = {**FAST, **cfg.get("strategy", {})}
    (out / "case.json").write_text(json.dumps(cfg))
    # PYTHONFAULTHANDLER: a replica that crashes (a signal) prints every thread's stack to its stderr. The launcher
    # (replica 0) is forked from a zygote that imported Lightning once (fault_utils.run_forked, with no LOCAL_RANK
    # or other launcher variables); the replicas it starts are fresh interpreters, as they must be to die alone
    proc = run_forked(str(SCRIPT), [str(out / "case.json")], cwd=ROOT, timeout=JOB_TIMEOUT_S,
                      pythonpath=os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
                      env={"OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"})  # fmt: skip
    records = {}
    for path in out.glob("replica*_*.pt"):
        replica, start = path.stem.removeprefix("replica").split("_")
        records[(int(replica), int(start))] = torch.load(path, weights_only=False)
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return records


def shard_batches(replica: int, epoch: int) -> list[list[int]]:
    """The batches Lightning's DistributedSampler gives ``replica`` in ``epoch`` (seed 0, shuffled)."""
    sampler = DistributedSampler(range(N), num_replicas=REPLICAS, rank=replica, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    order = list(sampler)
    return [order[i : i + BATCH] for i in range(0, len(order), BATCH)]


def inner_steps(data: Any, replicas: list[TinyRegressor], inner: list[torch.optim.Optimizer], step: int) -> None:
    """Inner step ``step`` of every simulated replica, each on its shard's batch of ``data``."""
    epoch, index = divmod(step, N // (REPLICAS * BATCH))
    for r, (model, opt) in enumerate(zip(replicas, inner, strict=True)):
        x, y = data[shard_batches(r, epoch)[index]]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def outer_reference(algorithm: str, steps: int, sync_every: int, *, batchnorm: bool = False) -> dict[str, Any]:
    """Two replicas simulated in one process: AdamW inner steps, the outer step every ``sync_every``
    (with ``batchnorm``, the floating buffers averaged at it too)."""
    data = regression_data(N)
    replicas = [TinyRegressor(batchnorm=batchnorm) for _ in range(REPLICAS)]
    for r in replicas[1:]:
        r.load_state_dict(replicas[0].state_dict())
    inner = [torch.optim.AdamW(r.parameters(), lr=0.01) for r in replicas]
    global_params = [p.detach().clone().requires_grad_(True) for p in replicas[0].parameters()]
    outer = torch.optim.SGD(global_params, lr=0.7, momentum=0.9, nesterov=True)
    for step in range(steps):
        inner_steps(data, replicas, inner, step)
        if (step + 1) % sync_every:
            continue
        with torch.no_grad():
            locals_ = [list(m.parameters()) for m in replicas]
            for i, g in enumerate(global_params):
                if algorithm == "local_sgd":
                    mean = (locals_[0][i].detach().clone() + locals_[1][i].detach()) / REPLICAS
                    g.copy_(mean)
                else:
                    deltas = [g.detach() - loc[i].detach() for loc in locals_]
                    g.grad = (deltas[0] + deltas[1]) / REPLICAS
            if algorithm == "diloco":
                outer.step()
                outer.zero_grad(set_to_none=True)
            for loc in locals_:
                for p, g in zip(loc, global_params, strict=True):
                    p.copy_(g)
            average_buffers([list(m.buffers()) for m in replicas])
    return {k: v.detach().clone() for k, v in replicas[0].state_dict().items()}


def assert_weights_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], **({"rtol": 0.0, "atol": 0.0} | tol), msg=k)


def test_ft_without_faults_equals_ddp(tmp_path: Path) -> None:
    steps = 8
    records = run_case(tmp_path, "ft", max_steps=steps, strategy={"min_replicas": 2})
    with one_process_group_cleanup():
        model = TinyRegressor()
        trainer = quiet_trainer("ddp_fork", REPLICAS, max_steps=steps)
        trainer.fit(model, DataLoader(regression_data(N), batch_size=BATCH))
    reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for r in range(REPLICAS):
        rec = records[(r, 0)]
        assert rec["global_step"] == rec["manager_step"] == steps
        assert rec["participants"] == [REPLICAS] * steps
        assert_weights_equal(rec["weights"], reference)


def test_ft_replica_killed_goes_on_and_the_restart_heals(tmp_path: Path) -> None:
    steps, kill = 100, 3
    # replica 0 sleeps 0.5 s per step while alone (up to ~50 s), so the restart (a fresh interpreter,
    # 10-25 s to import and set up on a loaded 2-core machine) joins mid-run
    records = run_case(tmp_path, "kill", max_steps=steps, kill=[1, kill], sleep_alone_s=0.5)
    survivor, restarted = records[(0, 0)], records[(1, 1)]
    assert (1, 0) not in records  # the killed start wrote nothing
    assert 1 in survivor["participants"]  # it committed steps alone
    assert survivor["participants"][-1] == REPLICAS  # and with the restarted replica at the end
    assert restarted["heals"] >= 1 and restarted["first_step"] > 0
    for rec in (survivor, restarted):
        assert rec["global_step"] == rec["manager_step"] == steps
    assert_weights_equal(survivor["weights"], restarted["weights"])


OUTER_STEPS, OUTER_H = 12, 4
# diloco's uninterrupted run: held to the one-process reference and to a stopped-and-resumed run
DILOCO = {"algorithm": "diloco", "optimizer": "adamw", "resumable": True,
          "strategy": {"min_replicas": 2, "sync_every": OUTER_H}}  # fmt: skip


@pytest.fixture(scope="module")
def diloco_whole(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], dict[str, Any]]:
    """The uninterrupted diloco run two tests compare with (one launch instead of two). Its loader is the
    ResumableDataLoader the resume needs, which gives the batches of the plain one."""
    return run_case(tmp_path_factory.mktemp("diloco"), "whole", max_steps=OUTER_STEPS, **DILOCO)


@pytest.mark.parametrize("algorithm", ["local_sgd", "diloco"])
def test_outer_loop_equals_the_one_process_reference(
    tmp_path: Path, algorithm: str, request: pytest.FixtureRequest
) -> None:
    steps, h = OUTER_STEPS, OUTER_H
    if algorithm == "diloco":
        records = request.getfixturevalue("diloco_whole")
    else:
        records = run_case(
            tmp_path, algorithm, algorithm=algorithm, max_steps=steps, optimizer="adamw",
            strategy={"min_replicas": 2, "sync_every": h},
        )  # fmt: skip
    reference = outer_reference(algorithm, steps, h)
    for r in range(REPLICAS):
        rec = records[(r, 0)]
        assert rec["global_step"] == steps and rec["manager_step"] == steps // h + 1
        assert_weights_equal(rec["weights"], reference)


def test_diloco_averages_the_batchnorm_statistics_as_the_reference(tmp_path: Path) -> None:
    # every replica's BN running statistics (its own batches) replaced by their mean at each sync: the
    # reference's (a + b) / 2, which torchft's all-reduce computes alike (sum, then / 2), so exactly
    records = run_case(tmp_path, "diloco_bn", max_steps=OUTER_STEPS, batchnorm=True, **DILOCO)
    reference = outer_reference("diloco", OUTER_STEPS, OUTER_H, batchnorm=True)
    assert "net.1.running_mean" in reference
    for r in range(REPLICAS):
        assert_weights_equal(records[(r, 0)]["weights"], reference)


def test_diloco_replica_killed_at_a_sync_heals(tmp_path: Path) -> None:
    steps, h = 80, 4
    records = run_case(
        tmp_path, "diloco_kill", algorithm="diloco", max_steps=steps, optimizer="adamw", kill=[1, 8],
        sleep_alone_s=0.6, strategy={"sync_every": h},
    )  # fmt: skip
    survivor, restarted = records[(0, 0)], records[(1, 1)]
    assert 1 in survivor["participants"]
    assert restarted["heals"] >= 1 and restarted["first_step"] > 0
    for rec in (survivor, restarted):
        assert rec["global_step"] == steps and rec["manager_step"] == steps // h + 1
    assert_weights_equal(survivor["weights"], restarted["weights"])
    torch.testing.assert_close(survivor["outer"], restarted["outer"], rtol=0.0, atol=0.0)


def test_diloco_resume_equals_an_uninterrupted_run(
    tmp_path: Path, diloco_whole: dict[tuple[int, int], dict[str, Any]]
) -> None:
    steps, h, stop = OUTER_STEPS, OUTER_H, 6
    whole = diloco_whole
    ckpt = tmp_path / "stop.ckpt"
    run_case(tmp_path, "first", max_steps=steps, ckpt_save=[stop, str(ckpt)], **DILOCO)
    assert ckpt.exists() and Path(f"{ckpt}.replica1").exists()
    resumed = run_case(tmp_path, "resumed", max_steps=steps, ckpt_path=str(ckpt), **DILOCO)
    for r in range(REPLICAS):
        a, b = whole[(r, 0)], resumed[(r, 0)]
        assert b["first_step"] == stop and b["global_step"] == steps and b["manager_step"] == steps // h + 1
        assert_weights_equal(a["weights"], b["weights"])
        torch.testing.assert_close(a["optimizer"], b["optimizer"], rtol=0.0, atol=0.0)
        torch.testing.assert_close(a["outer"], b["outer"], rtol=0.0, atol=0.0)


@pytest.mark.parametrize("when", ["issued", "quorum"])
def test_diloco_replica_killed_inside_the_allreduce_heals(tmp_path: Path, when: str) -> None:
    steps, h = 80, 4
    records = run_case(
        tmp_path, "diloco_kill_in_allreduce", algorithm="diloco", max_steps=steps, optimizer="adamw",
        kill_in_allreduce=[1, 2, when], sleep_alone_s=0.6, hold_alone_s=120.0, strategy={"sync_every": h},
    )  # fmt: skip
    killed = json.loads((tmp_path / "diloco_kill_in_allreduce" / "killed.json").read_text())
    assert killed["when"] == when and killed["step"] % h == 0  # its second sync (step 2h unless it joined late)
    survivor, restarted = records[(0, 0)], records[(1, 1)]
    assert (1, 0) not in records
    hit = next(s for s in survivor["syncs"] if s["finished"] == killed["step"])
    if when == "quorum":  # the survivor's all-reduce lost its peer in flight: it failed, synced again alone
        assert hit["participants"] == 1 and hit["attempts"] >= 2, hit
    else:  # the values crossed before the kill (committed by both), or as above
        assert hit["participants"] == 2 or (hit["participants"] == 1 and hit["attempts"] >= 2), hit
    assert 1 in survivor["participants"] and restarted["heals"] >= 1 and restarted["first_step"] > 0
    for rec in (survivor, restarted):
        assert rec["global_step"] == steps and rec["manager_step"] == steps // h + 1
    assert_weights_equal(survivor["weights"], restarted["weights"])
    torch.testing.assert_close(survivor["outer"], restarted["outer"], rtol=0.0, atol=0.0)


def streaming_reference(
    steps: int, sync_every: int, fragments: int, delay: int, alpha: float
) -> list[dict[str, torch.Tensor]]:
    """Streaming DiLoCo with the overlap, two replicas in one process, on torchft's schedule: fragment
    ``f``'s pseudo-gradients are averaged after inner step ``k H/F - tau`` and its outer step lands after
    inner step ``k H/F``, the fragment then ``lerp(θ_global, θ_local, alpha)``; one in flight at the end
    lands then. Each replica's final weights (with alpha > 0 they differ: each keeps part of its own)."""
    data = regression_data(N)
    replicas = [TinyRegressor() for _ in range(REPLICAS)]
    inner = [torch.optim.AdamW(r.parameters(), lr=0.01) for r in replicas]
    groups = split_fragments([p.numel() for p in replicas[0].parameters()], fragments)
    global_params = [p.detach().clone().requires_grad_(True) for p in replicas[0].parameters()]
    outers = [torch.optim.SGD([global_params[i] for i in g], lr=0.7, momentum=0.9, nesterov=True) for g in groups]
    interval = sync_every // fragments
    pending: tuple[int, int, list[torch.Tensor]] | None = None
    for step in range(steps + 1):
        due = step + delay
        with torch.no_grad():
            if pending is None and due > 0 and due % interval == 0 and (step < steps or delay == 0):
                f = (due // interval - 1) % fragments
                locals_ = [list(m.parameters()) for m in replicas]
                deltas = [[global_params[i].detach() - loc[i].detach() for i in groups[f]] for loc in locals_]
                pending = (f, step, [(a + b) / REPLICAS for a, b in zip(*deltas, strict=True)])
            if pending is not None and (step == pending[1] + delay or step == steps):
                f, _, means = pending
                for i, mean in zip(groups[f], means, strict=True):
                    global_params[i].grad = mean.clone()
                outers[f].step()
                outers[f].zero_grad(set_to_none=True)
                for model in replicas:
                    local = list(model.parameters())
                    for i in groups[f]:
                        g = global_params[i].detach()
                        local[i].copy_(g.lerp(local[i].detach(), alpha) if alpha else g)
                pending = None
        if step == steps:
            break
        inner_steps(data, replicas, inner, step)
    return [{k: v.detach().clone() for k, v in model.state_dict().items()} for model in replicas]


def test_streaming_diloco_overlap_equals_the_one_process_reference(tmp_path: Path) -> None:
    steps, h, fragments, delay, alpha = 12, 4, 2, 1, 0.5
    records = run_case(
        tmp_path, "streaming", algorithm="diloco", max_steps=steps, optimizer="adamw",
        strategy={"min_replicas": 2, "sync_every": h, "fragments": fragments, "fragment_sync_delay": delay,
                  "fragment_update_alpha": alpha},
    )  # fmt: skip
    reference = streaming_reference(steps, h, fragments, delay, alpha)
    interval = h // fragments
    for r in range(REPLICAS):
        rec = records[(r, 0)]
        assert rec["global_step"] == steps and rec["manager_step"] == steps // interval + 1
        assert_weights_equal(rec["weights"], reference[r])
        syncs = rec["syncs"]
        assert [(s["fragment"], s["started"], s["finished"]) for s in syncs] == [
            (k % fragments, (k + 1) * interval - delay, (k + 1) * interval) for k in range(steps // interval)
        ]
        assert all(s["attempts"] == 1 and s["participants"] == REPLICAS for s in syncs)
        # the overlap: the inner steps started..finished-1 ended while the all-reduce was in flight
        # (commit_times[i]: the end of this replica's inner step first_step + i)
        ends = rec["commit_times"]
        for s in syncs:
            inside = [rec["first_step"] + i for i, t in enumerate(ends) if s["issued_t"] < t < s["waited_t"]]
            assert inside == list(range(s["started"], s["finished"])), s
