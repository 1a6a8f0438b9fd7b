"""Joining the process group again after a torchrun (elastic) restart.

torch 2.14's workers share the elastic agent's TCP store across restarts (``MASTER_PORT`` is
the same in every attempt) and key it only by group name, so a restarted rank can read the
*dead* attempt's gloo addresses before its peers overwrite them and fail with "Gloo
connectFullMesh failed ... Connection refused" (pytorch/pytorch#167288 looks like the same
with NCCL; older torch prefixed ``/worker/attempt_<n>`` itself). Our strategies join through a
store prefixed by the attempt number instead; Lightning then finds the group initialised and
leaves it alone.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

__all__ = ["ElasticRestartMixin", "join_restarted_process_group"]


def join_restarted_process_group(backend: str, timeout: timedelta | None) -> bool:
    """Initialise the default process group through a per-attempt store after a torchrun restart.

    A no-op (returning False) outside torchrun, in the first attempt, when torchrun does not
    share its agent's store, or when a group exists already.

    Args:
        backend: ``"gloo"`` or ``"nccl"``.
        timeout: the process-group timeout (also used to reach the store).

    Returns:
        Whether this call initialised the group.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return False
    timeout = timeout or timedelta(minutes=30)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"/worker/attempt_{restart}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timeout,
    )
    return True


class ElasticRestartMixin(DDPStrategy):
    """Put before ``DDPStrategy`` (or a subclass) in the bases: after a torchrun restart the
    process group is joined through a per-attempt store (:func:`join_restarted_process_group`)."""

    @override
    def setup_distributed(self) -> None:
        join_restarted_process_group(self._get_process_group_backend(), self._timeout)
        super().setup_distributed()
