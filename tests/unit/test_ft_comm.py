"""The Lightning-free parts of ``ft`` / ``local_sgd`` / ``diloco`` against the math, and the
errors of the strategy's options (found / expected / fix), without torchft's processes."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import torch

from lightning_strategies.comm.ft import (
    CommitFailedError,
    LighthouseUnreachableError,
    OuterLoop,
    OuterSync,
    ReplicaConfig,
    average_and_commit,
    average_buffers,
    check_lighthouse,
    flatten,
    parse_lighthouse,
    snapshot,
    split_fragments,
    unflatten_into,
)


def _params(*shapes: tuple[int, ...]) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]


# -- fragments and the schedule ---------------------------------------------------------------------


def test_fragments_split_whole_tensors_in_order_by_element_count() -> None:
    assert split_fragments([10, 1, 10, 1], 2) == [[0, 1], [2, 3]]
    assert split_fragments([100, 1, 1], 3) == [[0], [1], [2]]  # every group keeps a tensor
    assert split_fragments([5] * 7, 1) == [list(range(7))]
    groups = split_fragments([3, 9, 2, 7, 7, 1], 3)
    assert sorted(i for g in groups for i in g) == list(range(6)) and all(groups)


@pytest.mark.parametrize(("sizes", "fragments", "match"), [([], 1, "without parameters"), ([4, 4], 3, "fragments=3")])
def test_fragment_errors_say_found_expected_fix(sizes: list[int], fragments: int, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        split_fragments(sizes, fragments)
    assert "expected" in str(info.value) and "Fix:" in str(info.value)


def test_streaming_schedule_syncs_one_fragment_every_h_over_f_steps() -> None:
    loop = OuterLoop(_params((2,), (3,)), sync_every=4, fragments=2)
    assert [loop.due(s) for s in range(9)] == [None, None, 0, None, 1, None, 0, None, 1]
    plain = OuterLoop(_params((2,)), sync_every=3)
    assert [plain.due(s) for s in range(7)] == [None, None, None, 0, None, None, 0]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sync_every": 0}, "sync_every=0"),
        ({"sync_every": 4, "outer_lr": 0.0}, "outer_lr=0.0"),
        ({"sync_every": 4, "outer_lr": -1.0}, "outer_lr=-1.0"),
        ({"sync_every": 5, "fragments": 2}, "multiple of fragments"),
        ({"sync_every": 4, "fragments": 3}, "fragments=3"),
        ({"sync_every": 4, "fragments": 2, "fragment_sync_delay": 2}, "fragment_sync_delay=2"),
        ({"sync_every": 4, "fragment_sync_delay": -1}, "fragment_sync_delay=-1"),
        ({"sync_every": 4, "fragment_sync_delay": 1, "algorithm": "local_sgd"}, "algorithm='local_sgd'"),
        ({"sync_every": 4, "fragment_update_alpha": 1.5}, "fragment_update_alpha=1.5"),
    ],
)
def test_outer_loop_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        OuterLoop(_params((2,), (3,)), **kwargs)
    assert "Fix:" in str(info.value)


# -- the outer step against its formula ------------------------------------------------------------


def test_diloco_outer_step_is_nesterov_sgd_on_the_mean_pseudo_gradient() -> None:
    params = _params((3,), (2, 2))
    loop = OuterLoop(params, sync_every=2, outer_lr=0.7, outer_momentum=0.9)
    theta0 = [p.detach().clone() for p in params]
    mean_delta = [torch.full((3,), 0.1), torch.full((2, 2), -0.2)]
    v = [torch.zeros_like(t) for t in theta0]
    expected = theta0
    for _ in range(2):  # two syncs: the momentum buffer matters in the second
        loop.apply(0, flatten(mean_delta))
        v = [0.9 * vi + d for vi, d in zip(v, mean_delta, strict=True)]  # v <- mu v + delta
        expected = [t - 0.7 * (d + 0.9 * vi) for t, d, vi in zip(expected, mean_delta, v, strict=True)]
        for p, b, e in zip(params, loop.backup, expected, strict=True):
            torch.testing.assert_close(p.detach(), e)
            torch.testing.assert_close(b.detach(), e)
    assert loop.syncs == 2


def test_diloco_pseudo_gradient_is_global_minus_local() -> None:
    params = _params((4,))
    loop = OuterLoop(params, sync_every=1)
    with torch.no_grad():
        params[0].add_(1.5)
    torch.testing.assert_close(loop.tensors(0)[0], torch.full((4,), -1.5))


def test_local_sgd_takes_the_mean_of_the_parameters() -> None:
    params = _params((3,))
    loop = OuterLoop(params, algorithm="local_sgd", sync_every=2)
    mean = torch.tensor([1.0, 2.0, 3.0])
    loop.apply(0, mean)
    torch.testing.assert_close(params[0].detach(), mean)
    torch.testing.assert_close(loop.backup[0], mean)
    assert loop.tensors(0)[0] is not None and torch.equal(loop.tensors(0)[0], mean)


def test_outer_state_round_trips_with_the_momentum() -> None:
    a = OuterLoop(_params((3,)), sync_every=1)
    a.apply(0, torch.ones(3))
    b = OuterLoop(_params((3,)), sync_every=1)
    b.load_state_dict(a.state_dict())
    for x, y in zip(a.backup, b.backup, strict=True):
        assert torch.equal(x, y)
    assert torch.equal(
        a.outer[0].state_dict()["state"][0]["momentum_buffer"], b.outer[0].state_dict()["state"][0]["momentum_buffer"]
    )
    with pytest.raises(ValueError, match="Fix:"):
        OuterLoop(_params((3,), (1,)), sync_every=1).load_state_dict(a.state_dict())


# -- the buffers (BatchNorm's running statistics) at the sync ------------------------------------------


def _bn_replica(seed: int) -> torch.nn.Sequential:
    """A small model with BatchNorm, its running statistics gathered on the replica's own batches."""
    torch.manual_seed(0)  # the same initial weights on every replica
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 3, generator=g) * (1 + seed) + seed)  # train mode: the statistics move
            model[0].weight.add_(0.01 * (seed + 1))  # an inner step of its own
    return model


@pytest.mark.parametrize("algorithm", ["diloco", "local_sgd"])
def test_a_sync_averages_the_floating_buffers_and_leaves_the_counters(algorithm: str) -> None:
    a, b = _bn_replica(0), _bn_replica(1)
    bn_a, bn_b = a[1], b[1]
    assert isinstance(bn_a, torch.nn.BatchNorm1d) and isinstance(bn_b, torch.nn.BatchNorm1d)
    assert not torch.equal(bn_a.running_mean, bn_b.running_mean)
    mean_stats = [(x + y) / 2 for x, y in zip((bn_a.running_mean, bn_a.running_var),
                                             (bn_b.running_mean, bn_b.running_var), strict=True)]  # fmt: skip
    # the reference for the parameters: the same sync without buffers
    ref = _bn_replica(0)
    ref_loop = OuterLoop(list(ref.parameters()), algorithm=algorithm, sync_every=1)
    loops = [OuterLoop(list(m.parameters()), algorithm=algorithm, sync_every=1, buffers=list(m.buffers()))
             for m in (a, b)]  # fmt: skip
    for loop in [*loops, ref_loop]:  # the global copy (the start of the inner steps): the initial weights
        for w, v in zip(loop.backup, _initial_params(), strict=True):
            w.data.copy_(v)
    assert [t.dtype for t in loops[0].buffers] == [torch.float32, torch.float32]  # num_batches_tracked left out
    peer = flatten(loops[1].tensors(0))
    sync = OuterSync(loops[0], attempts=1, requorum=lambda: False)
    sync.advance(FakeManager(peer, fail=0), 1)
    torch.testing.assert_close(bn_a.running_mean, mean_stats[0])
    torch.testing.assert_close(bn_a.running_var, mean_stats[1])
    assert int(bn_a.num_batches_tracked) == 3  # the counter stays this replica's
    params = sum(p.numel() for p in ref.parameters())
    ref_loop.apply(0, (flatten(ref_loop.tensors(0)) + peer[:params]) / 2)  # the mean of the parameters' part
    for p, q in zip(a.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach())


def _initial_params() -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    return [p.detach().clone() for p in model.parameters()]


def test_buffers_travel_with_the_last_fragment_only() -> None:
    params, stats = _params((3,), (2,)), [torch.ones(2), torch.tensor(5)]
    loop = OuterLoop(params, sync_every=2, fragments=2, buffers=stats)
    assert [t.numel() for t in loop.tensors(0)] == [3]
    assert [t.numel() for t in loop.tensors(1)] == [2, 2]
    loop.apply(1, torch.tensor([0.0, 0.0, 3.0, 4.0]))
    assert torch.equal(stats[0], torch.tensor([3.0, 4.0])) and int(stats[1]) == 5


def test_average_buffers_is_the_mean_of_the_replicas() -> None:
    replicas = [[torch.tensor([1.0, 2.0]), torch.tensor(3)], [torch.tensor([3.0, 6.0]), torch.tensor(3)]]
    average_buffers(replicas)
    for r in replicas:
        assert torch.equal(r[0], torch.tensor([2.0, 4.0])) and int(r[1]) == 3


# -- the all-reduce-then-commit step -----------------------------------------------------------------


class FakeManager:
    """A Manager whose all-reduce averages with a fixed peer and whose commits fail ``fail`` times."""

    def __init__(self, peer: torch.Tensor, fail: int) -> None:
        self.peer, self.fail, self.calls = peer, fail, 0

    def allreduce(self, t: torch.Tensor) -> Any:
        self.calls += 1
        t.add_(self.peer.to(t.dtype)).div_(2)
        return self

    def wait(self) -> bool:
        return True

    def should_commit(self) -> bool:
        self.fail -= 1
        return self.fail < 0

    def num_participants(self) -> int:
        return 2

    def errored(self) -> None:
        return None


def test_a_failed_commit_is_tried_again_on_a_new_quorum_with_intact_local_tensors() -> None:
    local = [torch.tensor([1.0, 2.0]), torch.tensor([[3.0]])]
    manager, requorums = FakeManager(torch.tensor([3.0, 4.0, 5.0]), fail=1), []
    flat, stats = average_and_commit(manager, lambda: local, attempts=3, requorum=lambda: requorums.append(1) or False)
    torch.testing.assert_close(flat, torch.tensor([2.0, 3.0, 4.0]))
    assert torch.equal(local[0], torch.tensor([1.0, 2.0]))  # the copy was reduced, not the tensors
    assert (stats.attempts, stats.participants, stats.bytes, len(requorums)) == (2, 2, 2 * 3 * 4, 1)
    unflatten_into(flat, local)
    assert torch.equal(local[1], torch.tensor([[4.0]]))


def test_no_commit_in_any_attempt_raises() -> None:
    with pytest.raises(CommitFailedError, match="Fix:"):
        average_and_commit(FakeManager(torch.zeros(1), fail=5), lambda: [torch.ones(1)], attempts=2,
                           requorum=lambda: False)  # fmt: skip


def test_bf16_wire_halves_the_bytes() -> None:
    _, stats = average_and_commit(FakeManager(torch.zeros(8), fail=0), lambda: [torch.ones(8)], attempts=1,
                                  requorum=lambda: False, wire_dtype=torch.bfloat16)  # fmt: skip
    assert stats.bytes == 8 * 2


def test_snapshot_shares_no_storage() -> None:
    state = {"a": torch.ones(2), "b": [torch.zeros(1), (torch.ones(1), 3)]}
    snap = snapshot(state)
    state["a"].add_(1)
    state["b"][1][0].add_(1)
    assert torch.equal(snap["a"], torch.ones(2)) and torch.equal(snap["b"][1][0], torch.ones(1))
    assert snap["b"][1][1] == 3


# -- Streaming DiLoCo's overlap: the all-reduce in flight for tau inner steps ------------------------


class DeferredManager(FakeManager):
    """A Manager whose all-reduce completes only when waited for (the mean with ``peer``, a constant per
    element), and that logs the order of issues, waits and the test's inner steps."""

    def __init__(self, peer: float, fail: int = 0) -> None:
        super().__init__(torch.zeros(1), fail)
        self.peer_value, self.events = peer, []

    def allreduce(self, t: torch.Tensor) -> Any:
        self.events.append("issue")
        manager = self

        class Work:
            def wait(self) -> bool:
                t.add_(manager.peer_value).div_(2)
                manager.events.append("wait")
                return True

        return Work()


def _inner_steps(sync: OuterSync, manager: DeferredManager, params: list[torch.nn.Parameter], steps: range) -> None:
    for step in steps:
        sync.advance(manager, step)
        manager.events.append("inner")
        with torch.no_grad():
            for p in params:
                p.add_(0.1)


def test_an_overlapped_sync_runs_tau_inner_steps_between_issue_and_wait() -> None:
    params = _params((3,), (2,))
    loop = OuterLoop(params, sync_every=4, fragments=2, fragment_sync_delay=1, fragment_update_alpha=0.5)
    assert [loop.starts(s) for s in range(9)] == [None, 0, None, 1, None, 0, None, 1, None]
    quorums: list[int] = []
    sync, manager = OuterSync(loop, attempts=3, requorum=lambda: quorums.append(1) or False), DeferredManager(0.25)
    theta0 = params[0].detach().clone()
    _inner_steps(sync, manager, params, range(2))
    sync.advance(manager, 2)  # fragment 0's outer step lands before inner step 2
    # by hand: Δ = θ0 - (θ0 + 0.1) sent before step 1, its mean with the peer's 0.25; Nesterov's first step
    # θ_g = θ0 - 0.7 (1 + 0.9) mean; then the merge with the local θ0 + 0.2 (one step past Δ)
    mean = (-0.1 + 0.25) / 2
    global_ = theta0 - 0.7 * 1.9 * mean
    torch.testing.assert_close(loop.backup[0].detach(), global_)
    torch.testing.assert_close(params[0].detach(), global_ + 0.5 * (theta0 + 0.2 - global_))
    _inner_steps(sync, manager, params, range(2, 8))
    sync.advance(manager, 8, end=True)
    assert manager.events == ["inner"] + ["issue", "inner", "wait", "inner"] * 3 + ["issue", "inner", "wait"]
    assert [(r.fragment, r.started, r.finished, r.attempts) for r in sync.history] == [
        (0, 1, 2, 1), (1, 3, 4, 1), (0, 5, 6, 1), (1, 7, 8, 1),
    ]  # fmt: skip
    assert len(quorums) == 4 and loop.syncs == 4  # a quorum per start, none to wait


def test_an_overlapped_sync_that_fails_applies_nothing_of_it_and_syncs_again_blocking() -> None:
    params = _params((3,))
    loop = OuterLoop(params, sync_every=2, fragment_sync_delay=1, fragment_update_alpha=0.5)
    quorums: list[int] = []
    sync, manager = OuterSync(loop, attempts=3, requorum=lambda: quorums.append(1) or False), DeferredManager(0.25, 1)
    theta0 = params[0].detach().clone()
    _inner_steps(sync, manager, params, range(2))
    stats = sync.advance(manager, 2)
    # the failed all-reduce's mean is dropped; the retry averages θ0 - (θ0 + 0.2) now, and applies it unmixed
    mean = (-0.2 + 0.25) / 2
    torch.testing.assert_close(params[0].detach(), theta0 - 0.7 * 1.9 * mean)
    assert stats is not None and stats.attempts == 2 and len(quorums) == 2 and loop.syncs == 1
    assert sync.pending is None and (sync.history[-1].started, sync.history[-1].finished) == (2, 2)


def test_a_checkpoint_with_a_sync_in_flight_resumes_it() -> None:
    a_params, b_params = _params((3,)), _params((3,))
    a = OuterSync(OuterLoop(a_params, sync_every=4, fragment_sync_delay=2), attempts=1, requorum=lambda: False)
    a_manager, b_manager = DeferredManager(0.5), DeferredManager(0.5)
    _inner_steps(a, a_manager, a_params, range(3))  # issued before step 2, in flight
    state = a.state_dict()
    assert state["pending"] is not None and state["pending"]["started"] == 2
    b = OuterSync(OuterLoop(b_params, sync_every=4, fragment_sync_delay=2), attempts=1, requorum=lambda: False)
    with torch.no_grad():
        b_params[0].copy_(a_params[0])  # Lightning restores the weights
    b.load_state_dict(state)
    b.advance(b_manager, 3, quorum_open=True)  # the resumed run's first quorum
    assert b_manager.events == ["issue"]
    for sync, manager, params in ((a, a_manager, a_params), (b, b_manager, b_params)):
        _inner_steps(sync, manager, params, range(3, 4))
        sync.advance(manager, 4)
    assert torch.equal(a_params[0], b_params[0]) and torch.equal(a.outer.backup[0], b.outer.backup[0])


# -- the Lighthouse's address and the options' errors --------------------------------------------------


def test_lighthouse_addresses_parse() -> None:
    assert parse_lighthouse("node0:29510") == ("node0", 29510)
    assert parse_lighthouse("http://10.0.0.1:1234/") == ("10.0.0.1", 1234)
    assert parse_lighthouse("[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError, match="host:port"):
        parse_lighthouse("node0")


def test_no_lighthouse_reachable_names_the_address_and_the_command() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(LighthouseUnreachableError) as info:
        check_lighthouse(f"127.0.0.1:{port}", timeout_s=0.3, min_replicas=2, heartbeat_timeout_s=1.0)
    message = str(info.value)
    assert f"127.0.0.1:{port}" in message and "torchft_lighthouse --min_replicas 2" in message
    assert "--heartbeat_timeout_ms 1000" in message and "Fix:" in message


def test_replica_config_checks() -> None:
    with pytest.raises(ValueError, match="min_replicas=0"):
        ReplicaConfig(min_replicas=0)
    with pytest.raises(ValueError, match="quorum_timeout_s"):
        ReplicaConfig(quorum_timeout_s=0.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"algorithm": "diloco", "sync_every": 0}, "sync_every=0"),
        ({"algorithm": "diloco", "outer_lr": 0.0}, "outer_lr=0.0"),
        ({"algorithm": "ft", "pseudo_grad_dtype": "bf16"}, "pseudo_grad_dtype"),
        ({"algorithm": "gossip"}, "algorithm='gossip'"),
        ({"start_method": "fork"}, "start_method='fork'"),
        ({"commit_attempts": 0}, "commit_attempts=0"),
        ({"algorithm": "ft", "fragment_sync_delay": 1}, "fragment_sync_delay=1"),
        ({"algorithm": "diloco", "sync_every": 4, "fragments": 2, "fragment_sync_delay": 2}, "sync_every / fragments"),
    ],
)
def test_strategy_options_fail_when_built(kwargs: dict[str, Any], match: str) -> None:
    from lightning_strategies import FTStrategy

    with pytest.raises(ValueError, match=match) as info:
        FTStrategy(**kwargs)
    assert "Fix:" in str(info.value)


def test_registry_rows_build_the_variants() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    import lightning_strategies  # noqa: F401 - registers the names

    assert StrategyRegistry.get("diloco").algorithm == "diloco"
    assert StrategyRegistry.get("local_sgd").algorithm == "local_sgd"
    assert StrategyRegistry.get("ft").algorithm == "ft"


# -- the checkpoint transport -------------------------------------------------------------------------


@pytest.mark.parametrize("hostname", ["127.0.0.1", "10.9.8.7", "::1"])
def test_checkpoint_transport_advertises_the_replica_address_not_the_host_name(hostname: str) -> None:
    """A healing peer fetches from the address the replica was given (torchft's own transport names
    ``socket.gethostname()``, which on the emulated cluster's nodes does not reach the replica)."""
    pytest.importorskip("torchft")
    from datetime import timedelta

    from torchft.checkpointing import HTTPTransport

    from lightning_strategies.comm.ft.transport import AdvertisedHTTPTransport

    transport = AdvertisedHTTPTransport(hostname=hostname, timeout=timedelta(seconds=10))
    try:
        plain = HTTPTransport.address(transport)  # torchft's URL for the same server
        host = f"[{hostname}]" if ":" in hostname else hostname
        assert plain.startswith(f"http://{socket.gethostname()}:")
        assert transport.metadata() == plain.replace(socket.gethostname(), host, 1)
        if hostname == "127.0.0.1":  # served there: a peer's fetch from the advertised URL returns the state
            state = {"w": torch.arange(6.0).reshape(2, 3), "step": 3}
            transport.send_checkpoint([1], step=3, state_dict=state, timeout=timedelta(seconds=10))
            got = transport.recv_checkpoint(0, transport.metadata(), step=3, timeout=timedelta(seconds=10))
            assert got["step"] == 3 and torch.equal(got["w"], state["w"])
    finally:
        transport.shutdown(wait=False)
