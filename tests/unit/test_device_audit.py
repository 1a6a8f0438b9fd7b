"""The device audit itself (``tests/device_audit.py``): it must flag what NCCL would refuse and what
would block the host on CUDA, and pass what is right, or the strategy tests built on it prove nothing."""

from __future__ import annotations

import torch
import torch.distributed as dist
from device_audit import OUR_CODE, Audit, PlacementMode, audit_collectives, audit_host_reads, is_host
from torch import nn


def test_placement_follows_cudas_rules() -> None:
    param = nn.Linear(2, 2).weight  # made before the audit, like a model moved to root_device
    with PlacementMode():
        host = torch.tensor([1.0, 2.0], dtype=torch.float64)  # no device=: the host on a CUDA run
        assert is_host(host) and is_host(torch.zeros_like(host)) and is_host(host.to(torch.float32)[1:])
        assert is_host(torch.stack([host, host])) and is_host(param.detach().cpu())
        assert not is_host(host.to(param.device))  # an explicit move to the device
        assert not is_host(torch.zeros(3, device=param.device))
        assert not is_host(param.detach() * 2) and not is_host(param.detach().sum() + host.sum())
        assert not is_host(torch.zeros_like(param)) and not is_host(param.new_zeros(3))


def test_the_old_pipeline_all_gather_is_flagged_and_its_fix_passes(world_of_one: None) -> None:
    audit = Audit()
    device = nn.Linear(2, 2).weight.device  # root_device
    all_reduce = dist.all_reduce
    with audit_collectives(audit), PlacementMode():
        # lightning_strategies/strategies/pipeline.py before e508c8d (NCCL: "no backend for device type cpu")
        mine = torch.tensor([0.5, 0.25], dtype=torch.float64)
        gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        assert len(audit.off_device) == 2  # the input and the output list
        assert "all_gather at " in audit.off_device[0] and "test_device_audit.py" in audit.off_device[0]
        audit.off_device.clear()
        # today's: the same on the device
        mine = torch.tensor([0.5, 0.25], dtype=torch.float64, device=device)
        dist.all_gather([torch.zeros_like(mine)], mine)
        dist.all_reduce(nn.Linear(2, 2).weight.detach().clone())
        dist.P2POp(dist.isend, mine, 0)  # P2POp still accepts the wrapped isend
    assert audit.off_device == [] and audit.collectives == {"all_gather": 2, "all_reduce": 1}
    assert dist.all_reduce is all_reduce  # restored


def test_host_reads_are_counted_for_our_code_only() -> None:
    audit = Audit()
    t = torch.ones(2)
    ours = compile("t.sum().item(); bool(t.all()); t.tolist()", OUR_CODE[0] + "fake_module.py", "exec")
    with audit_host_reads(audit):
        audit.step = 7
        exec(ours, {"t": t})
        float(t.sum())  # this test's own read: recorded, but not as ours
    assert [(step, method) for step, method, _ in audit.reads_from_our_code()] == [
        (7, "item"),
        (7, "__bool__"),
        (7, "tolist"),
    ]
    assert len(audit.reads) == 4
    assert torch.Tensor.item is not None and t.sum().item() == 2.0  # restored, and works
