"""The parameter server shards this process hosts, and their RPC entry points.

The push handler runs under :func:`~lightning_strategies.comm.rpc.async_execution`: a blocking
handler deadlocks once the waiting pushes occupy every RPC thread.
"""

from __future__ import annotations

from typing import Any

from torch.futures import Future

from lightning_strategies.comm.heartbeat import PeerDiagnosis, add_abort_hook
from lightning_strategies.comm.ps.shard import ParameterShard, ShardReply
from lightning_strategies.comm.ps.wire import Packed
from lightning_strategies.comm.rpc import ShardError, async_execution, completed, current_name

__all__ = ["hosted_shard", "local_shard", "register_shard", "stop_hosted_shards", "unregister_shard"]


_SHARDS: dict[int, ParameterShard] = {}
# shards dropped because their host failed, with the error late pushes get: a survivor's push
# that arrives after the drop must name the failure, not suggest disagreeing sharding plans
_STOPPED: dict[int, str] = {}


def register_shard(shard: ParameterShard) -> None:
    """Make ``shard`` reachable by RPC in this process (one process may host several)."""
    _STOPPED.pop(shard.shard_id, None)
    _SHARDS[shard.shard_id] = shard


def unregister_shard(shard_id: int, *, reason: str | None = None) -> None:
    """Forget the shard (at teardown), so a later fit in this process starts clean.

    Args:
        reason: why, when this process failed: pushes waiting in the shard's barrier, and any that
            arrive until RPC shuts down, get an error carrying it.
    """
    shard = _SHARDS.pop(shard_id, None)
    if shard is not None:
        failure = shard.close(reason)  # its watchdog thread ends
        if failure is not None:
            _STOPPED[shard_id] = failure


def stop_hosted_shards(diagnosis: PeerDiagnosis | None) -> None:
    """Drop every hosted shard, answering the workers waiting in its barrier with the loss: the
    heartbeat's abort hook (a frozen worker's push never comes, and no connection ends that wait)."""
    text = diagnosis.describe("parameter_server") if diagnosis is not None else None
    reason = f"PeerLostError: {text.splitlines()[0]}" if text else "PeerLostError: a peer is gone"
    for shard_id in list(_SHARDS):
        unregister_shard(shard_id, reason=reason)


add_abort_hook(stop_hosted_shards)


def local_shard(shard_id: int) -> ParameterShard | None:
    """The shard ``shard_id`` when this process hosts it."""
    return _SHARDS.get(shard_id)


def hosted_shard(shard_id: int) -> ParameterShard:
    """The shard ``shard_id``, which this process must host (RPC entry points call this).

    Raises:
        RuntimeError: when this process does not host it.
    """
    shard = _SHARDS.get(shard_id)
    if shard is None and shard_id in _STOPPED:
        raise RuntimeError(_STOPPED[shard_id])
    if shard is None:
        raise RuntimeError(
            f"parameter server shard {shard_id} is not hosted by {current_name()} "
            f"(this process hosts {sorted(_SHARDS)}); the sharding plans of the workers disagree"
        )
    return shard


@async_execution
def _rpc_push(
    shard_id: int, worker: int, step: int, grads: Packed, lrs: list[float], part: list[int] | None = None
) -> Future[ShardReply | ShardError]:
    # returns the barrier's future at once: the RPC thread is free while the step waits
    shard = hosted_shard(shard_id)
    try:
        unpacked = shard.unpack(grads, part)
    except (ValueError, IndexError) as err:
        return completed(ShardError(f"parameter server shard {shard_id}: worker {worker} pushed {err}"))
    return shard.push(worker, step, unpacked, lrs, part)


def _rpc_state_dict(shard_id: int) -> dict[str, Any]:
    return hosted_shard(shard_id).state_dict()
