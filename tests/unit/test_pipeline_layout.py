"""``comm/pipeline_stages`` in one process: the layout, placeholders, initialisation, the spill files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_strategies.comm.pipeline_stages import (
    Spill,
    StageLayout,
    held_bytes,
    initialize,
    is_materialized,
    materialize,
    tensors_of,
    to_meta,
)
from lightning_strategies.strategies.pipeline import PipelineStrategy


def test_layout_of_an_interleaved_pipeline() -> None:
    """4 stages on 2 ranks: stage s on rank s % 2 (rank 0 holds stages 0 and 2)."""
    layout = StageLayout((1, 2, 2, 1), 2)
    assert layout.bounds == [0, 1, 3, 5, 6]
    assert layout.stages_of(0) == [0, 2] and layout.blocks_of(0) == [0, 3, 4]
    assert layout.blocks_of(1) == [1, 2, 5]
    assert [layout.owner_of_block(i) for i in range(6)] == [0, 1, 1, 0, 0, 1]
    with pytest.raises(ValueError, match=r"counts=\[1, 2, 3\], ranks=2"):
        StageLayout((1, 2, 3), 2)


def test_placeholders_keep_shapes_ties_and_free_the_storage() -> None:
    shared = nn.Linear(3, 3)
    block = nn.Sequential(shared, nn.BatchNorm1d(3), shared)  # the same layer twice: one set of tensors
    # the linear's weight and bias, batch norm's weight, bias, running mean and var (float32) and count (int64)
    assert len(tensors_of(block)) == 2 + 5 and held_bytes(tensors_of(block)) == (9 + 3 + 4 * 3) * 4 + 8
    pairs = to_meta(block)
    assert not is_materialized(block) and held_bytes(tensors_of(block)) == 0
    assert block[0].weight is block[2].weight and block[0].weight.shape == (3, 3)
    assert len(pairs) == 4  # parameters only: the optimizer's to swap (weight, bias, bn weight, bn bias)
    materialize(block, torch.device("cpu"))
    assert is_materialized(block) and block[0].weight is block[2].weight
    assert block[1].running_var.dtype == torch.float32 and block[1].num_batches_tracked.dtype == torch.int64


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.ones(3))


def test_initialize_from_meta_equals_eager_construction_and_names_a_module_it_cannot_start() -> None:
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 2))
    with torch.device("meta"):
        lazy = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 2))
    materialize(lazy, torch.device("cpu"))
    torch.manual_seed(0)
    initialize(lazy)  # each layer's reset_parameters, in order: the constructor's draws
    for a, b in zip(eager.parameters(), lazy.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with torch.device("meta"):
        odd = nn.Sequential(nn.Linear(3, 3), _Scale())
    materialize(odd, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"found _Scale \(1\) built on the meta device .* no reset_parameters"):
        initialize(odd)


def test_spill_keeps_at_most_a_chunk_in_memory_and_leaves_no_file(tmp_path: Path) -> None:
    spill = Spill(str(tmp_path), chunk_bytes=64)
    values = [torch.arange(10.0) * i for i in range(5)]  # 40 bytes each: a chunk is written every 2
    for i, v in enumerate(values):
        spill.add(i, v)
        assert spill._bytes < 64  # what is pending stays under a chunk
    out = spill.finish()
    assert list(tmp_path.iterdir()) == []  # unlinked at once; the mappings hold the data
    for i, v in enumerate(values):
        torch.testing.assert_close(out[i], v, rtol=0, atol=0)
    values[1] += 1  # a snapshot: later changes to the source do not reach it
    assert out[1][1] == 1.0


def test_split_refuses_a_tensor_shared_across_ranks_and_meta_tensors_outside_the_blocks() -> None:
    layer = nn.Linear(2, 2)
    blocks = nn.Sequential(layer, nn.ReLU(), layer)
    with pytest.raises(ValueError, match=r"shared by blocks 0 and 2 .*\(\[2, 1\] blocks per stage\)"):
        PipelineStrategy._check_split(blocks, blocks, StageLayout((2, 1), 2))
    PipelineStrategy._check_split(blocks, blocks, StageLayout((3,), 1))  # one rank holds both: fine

    class WithHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
            with torch.device("meta"):
                self.head = nn.Linear(2, 1)

    module = WithHead()
    with pytest.raises(ValueError, match=r"found head.weight outside pipeline_layers\(\) on the meta device"):
        PipelineStrategy._check_split(module, module.body, StageLayout((1, 1), 2))


def _mapped_from(t: torch.Tensor, path: Path) -> bool:
    with open("/proc/self/maps") as f:
        spans = [line.split()[0] for line in f if line.rstrip().endswith(str(path))]
    return any(int(a, 16) <= t.data_ptr() < int(b, 16) for a, b in (s.split("-") for s in spans))


def test_resume_reads_the_checkpoint_memory_mapped(tmp_path: Path) -> None:
    """The strategy loads a local checkpoint with mmap: its tensors are pages of the file, and each
    rank copies only its own stages' out of it (load_model_state_dict), never the whole model."""
    path = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.arange(4096.0)}, "epoch": 1}, path)
    loaded = PipelineStrategy().load_checkpoint(path)
    assert loaded["epoch"] == 1 and _mapped_from(loaded["state_dict"]["w"], path)
    torch.testing.assert_close(loaded["state_dict"]["w"], torch.arange(4096.0), rtol=0, atol=0)
