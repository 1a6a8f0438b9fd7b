"""``comm.tensor._settled`` on 2 gloo processes: after an asynchronous redistribution, as torch's parallel
styles make, ``DTensor.to_local`` returns a tensor whose all-reduce may still run; settled, it is a plain
tensor holding the sum (the math: rank 0's ones plus rank 1's twos). A plain tensor comes back as it is."""

from __future__ import annotations

from typing import Any

import torch
from dist_utils import run_workers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate

from lightning_strategies.comm.tensor import _settled


def _settle(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    partial = DTensor.from_local(torch.full((3,), float(rank + 1)), mesh, (Partial(),), run_check=False)
    pending = partial.redistribute(mesh, (Replicate(),), async_op=True).to_local()
    done = _settled(pending)
    plain = torch.zeros(2)
    return {
        "pending_is_plain": type(pending) is torch.Tensor,
        "pending_has_wait": callable(getattr(pending, "wait", None)),
        "done_type": type(done).__name__,
        "done": done.tolist(),
        "plain_is_itself": _settled(plain) is plain,
    }


def test_settled_waits_for_an_asynchronous_redistribution_and_leaves_plain_tensors() -> None:
    for out in run_workers(_settle, 2, timeout=60):
        # torch 2.14 returns the collective's pending tensor here; were that ever a plain tensor, the
        # test would no longer exercise the wait, and says so
        assert not out["pending_is_plain"] and out["pending_has_wait"]
        assert out["done_type"] == "Tensor"
        assert out["done"] == [3.0, 3.0, 3.0]
        assert out["plain_is_itself"]
