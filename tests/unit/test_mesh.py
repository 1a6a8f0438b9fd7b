"""``comm.mesh.device_mesh``: a mesh over ``new_group``s equals torch's ``init_device_mesh`` (4 gloo processes)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_workers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_strategies.comm.mesh import device_mesh, mesh_rows


def test_mesh_rows_by_hand() -> None:
    assert mesh_rows((2, 3), 0) == [[0, 3], [1, 4], [2, 5]]
    assert mesh_rows((2, 3), 1) == [[0, 1, 2], [3, 4, 5]]
    assert mesh_rows((4,), 0) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="mesh dimension 2 is out of range for a mesh of shape"):
        mesh_rows((2, 3), 2)


def _compare(rank: int, world: int) -> dict[str, Any]:
    names = ("dp", "tp")
    ours = device_mesh("cpu", (2, 2), names, backend="gloo", timeout=timedelta(seconds=30))
    torchs = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    out: dict[str, Any] = {"mesh": ours.mesh.tolist(), "torch_mesh": torchs.mesh.tolist()}
    for name in names:
        out[f"ranks_{name}"] = dist.get_process_group_ranks(ours.get_group(name))
        out[f"torch_ranks_{name}"] = dist.get_process_group_ranks(torchs.get_group(name))
        out[f"local_{name}"] = ours.get_local_rank(name)
        out[f"torch_local_{name}"] = torchs.get_local_rank(name)
        summed = torch.tensor([float(rank)])
        dist.all_reduce(summed, group=ours.get_group(name))
        out[f"sum_{name}"] = summed.item()
    # a DTensor sharded over both dimensions (columns over dp, rows over tp): full_tensor() joins the pieces
    whole = torch.arange(8.0).view(4, 2)
    piece = distribute_tensor(whole, ours, [Shard(1), Shard(0)])
    out["local_piece"] = piece.to_local().tolist()
    out["full"] = piece.full_tensor().tolist()
    for bad, match in (((3, 2), "has 6 ranks, but the world has 4"), ((4,), "needs 1 dimension names")):
        try:
            device_mesh("cpu", bad, names, backend="gloo")
        except ValueError as e:
            out[f"error_{bad}"] = match in str(e)
    # torch 2.11's failure on a GPU-bound gloo group (benchmarks/results/gpu_check_2026-12-04_run5.txt), replayed
    real = dist.new_group

    def torch_2_11_gloo_on_a_gpu(*args: Any, **kwargs: Any) -> Any:
        raise AttributeError(
            "'torch._C._distributed_c10d.ProcessGroupGloo' object has no attribute 'perform_nocolor_split'"
        )

    dist.new_group = torch_2_11_gloo_on_a_gpu
    try:
        device_mesh("cuda", (2, 2), names, backend="gloo")
    except RuntimeError as e:
        out["torch_2_11_error"] = str(e)
    finally:
        dist.new_group = real
    return out


def test_device_mesh_equals_init_device_mesh_on_four_ranks() -> None:
    got = run_workers(_compare, 4, timeout=90)
    for rank, out in enumerate(got):
        assert out["mesh"] == out["torch_mesh"] == [[0, 1], [2, 3]]
        for name in ("dp", "tp"):
            assert out[f"ranks_{name}"] == out[f"torch_ranks_{name}"]
            assert out[f"local_{name}"] == out[f"torch_local_{name}"]
        # the math: dp groups are the columns {0, 2} and {1, 3}, tp groups the rows {0, 1} and {2, 3}
        assert out["ranks_dp"] == [rank % 2, rank % 2 + 2]
        assert out["ranks_tp"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert out["sum_dp"] == sum(out["ranks_dp"])
        assert out["sum_tp"] == sum(out["ranks_tp"])
        # placements [Shard(1) over dp, Shard(0) over tp]: columns by dp coordinate, rows by tp coordinate
        whole = torch.arange(8.0).view(4, 2)
        dp, tp = divmod(rank, 2)
        assert out["local_piece"] == whole[2 * tp : 2 * tp + 2, dp : dp + 1].tolist()
        assert out["full"] == whole.tolist()
        assert out["error_(3, 2)"] is True
        assert out["error_(4,)"] is True
        message = out["torch_2_11_error"]
        assert message.startswith("could not make the cuda mesh's group of ranks [0, 2] (backend gloo, torch ")
        assert "perform_nocolor_split" in message
        assert "Fix: on GPUs pass process_group_backend='nccl', or use torch 2.14 (" in message
