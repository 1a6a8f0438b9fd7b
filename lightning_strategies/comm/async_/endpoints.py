"""The async coordinator's registry and RPC entry points on rank 0 (called through :mod:`.lease`)."""

from __future__ import annotations

from typing import Any

from torch.futures import Future

from lightning_strategies.comm.async_.coordinator import AsyncCoordinator
from lightning_strategies.comm.async_.messages import DataPlan, GateReply, JoinReply, LeaseReply, ReportReply
from lightning_strategies.comm.rpc import ShardError, async_execution, current_name

__all__ = ["hosted_coordinator", "local_coordinator", "register_coordinator", "unregister_coordinator"]


_COORDINATORS: list[AsyncCoordinator] = []  # at most one


def register_coordinator(coordinator: AsyncCoordinator) -> None:
    """Make ``coordinator`` reachable by RPC in this process (rank 0 hosts it)."""
    _COORDINATORS[:] = [coordinator]


def unregister_coordinator() -> None:
    """Forget this process's coordinator (at teardown)."""
    _COORDINATORS.clear()


def local_coordinator() -> AsyncCoordinator | None:
    """The coordinator when this process hosts it."""
    return _COORDINATORS[0] if _COORDINATORS else None


def hosted_coordinator() -> AsyncCoordinator:
    """The coordinator, which this process must host (``RuntimeError`` if not); RPC entry points call this."""
    if not _COORDINATORS:
        raise RuntimeError(f"{current_name()} hosts no async coordinator; rank 0 should")
    return _COORDINATORS[0]


@async_execution
def _rpc_refill(
    worker: int,
    epoch: int,
    want: int,
    clock: int,
    acks: list[tuple[int, int]],
    plan: DataPlan,
    incarnation: int,
    prefetch: int,
) -> Future[LeaseReply | ShardError]:
    # returns the coordinator's future at once: the RPC thread is free while the refill is held
    return hosted_coordinator().refill(
        worker, epoch, want, clock=clock, acks=acks, plan=plan, incarnation=incarnation, prefetch=prefetch
    )


@async_execution
def _rpc_gate(worker: int, clock: int, incarnation: int) -> Future[GateReply | ShardError]:
    return hosted_coordinator().gate(worker, clock, incarnation=incarnation)


def _rpc_report(
    worker: int,
    clock: int,
    acks: list[tuple[int, int]],
    incarnation: int,
    finished: bool,
    publish: dict[str, Any] | None,
    returned: list[tuple[int, int]],
) -> ReportReply:
    # a last report may arrive after the coordinator's teardown: the clocks no longer matter then
    if (coordinator := local_coordinator()) is None:
        return ReportReply(None)
    return coordinator.report(
        worker, clock, acks, incarnation=incarnation, finished=finished, publish=publish, returned=returned
    )


def _rpc_fail(worker: int, reason: str) -> None:
    if (coordinator := local_coordinator()) is not None:
        coordinator.fail(worker, reason)


def _rpc_join(worker: int, incarnation: int, name: str) -> JoinReply:
    return hosted_coordinator().join(worker, incarnation, name)


def _rpc_leave(worker: int, incarnation: int) -> None:
    if (coordinator := local_coordinator()) is not None:
        coordinator.leave(worker, incarnation)


def _rpc_published(key: str) -> Any:
    coordinator = local_coordinator()
    return coordinator.published(key) if coordinator is not None else None


def _rpc_run_state(epoch: int) -> tuple[int, bool, bool, bool]:
    """(batches of ``epoch`` done, epoch complete, run stopped, every worker gone): servers poll it."""
    coordinator = hosted_coordinator()
    done = coordinator.done_count(epoch)
    complete = done > 0 and done == coordinator.accounting(epoch)["num_batches"]
    return done, complete, coordinator.stopped, coordinator.left_or_lost()
