"""param_groups: decayed weights vs biases / 1-D tensors, counts logged, usable by any optimizer."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from lightning_strategies.optim import Lamb, Lars, param_groups


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, bias=False)  # 108 decayed
        self.bn = nn.BatchNorm2d(4)  # weight 4 + bias 4, no decay
        self.fc = nn.Linear(4, 2)  # weight 8 decayed, bias 2 no decay
        self.pos_embed = nn.Parameter(torch.zeros(1, 5))  # 2-D, no decay only when named
        self.frozen = nn.Linear(2, 2)  # requires_grad=False: left out
        for p in self.frozen.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(x)).mean(dim=(2, 3))
        return self.fc(h) + self.pos_embed[:, :2]


def ids(params: list[nn.Parameter]) -> set[int]:
    return {id(p) for p in params}


def test_split_and_group_options() -> None:
    net = Net()
    groups = param_groups(net, 0.05)
    assert [(g["weight_decay"], g["layer_adaptation"]) for g in groups] == [(0.05, True), (0.0, False)]
    assert ids(groups[0]["params"]) == ids([net.conv.weight, net.fc.weight, net.pos_embed])
    assert ids(groups[1]["params"]) == ids([net.bn.weight, net.bn.bias, net.fc.bias])


def test_no_decay_names_and_frozen_parameters() -> None:
    net = Net()
    groups = param_groups(net, 0.05, no_decay=("bias", "pos_embed"))
    assert ids(groups[0]["params"]) == ids([net.conv.weight, net.fc.weight])
    assert ids(groups[1]["params"]) == ids([net.bn.weight, net.bn.bias, net.fc.bias, net.pos_embed])
    every = ids(groups[0]["params"]) | ids(groups[1]["params"])
    assert not every & ids(list(net.frozen.parameters()))
    # full names work too
    assert ids(param_groups(net, 0.05, no_decay=("fc.weight",))[1]["params"]) >= {id(net.fc.weight)}


def test_counts_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="lightning_strategies"):
        param_groups(Net(), 0.05)
    (record,) = [r for r in caplog.records if r.name == "lightning_strategies"]
    message = record.getMessage()
    assert "3 tensors (121 parameters) with weight_decay=0.05" in message  # 108 + 8 + 5
    assert "3 tensors (10 parameters) without weight decay" in message  # 4 + 4 + 2


def test_empty_group_is_dropped() -> None:
    groups = param_groups(nn.Linear(3, 3, bias=False), 0.1)
    assert len(groups) == 1 and groups[0]["weight_decay"] == 0.1


@pytest.mark.parametrize(
    ("weight_decay", "no_decay", "message"),
    [
        (-0.1, ("bias",), "Invalid weight_decay value: -0.1"),
        (0.1, "bias", "no_decay must be a collection of names, found the string 'bias'"),
    ],
)
def test_bad_arguments(weight_decay: float, no_decay: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        param_groups(Net(), weight_decay, no_decay=no_decay)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "make",
    [
        lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9),
        lambda g: torch.optim.AdamW(g, lr=1e-2),
    ],
)
def test_extra_keys_are_harmless_to_torch_optimizers(make: object) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 3, 6, 6)
    results = []
    for strip in (False, True):
        torch.manual_seed(1)
        net = Net()
        groups = param_groups(net, 0.05)
        if strip:  # the same groups without our extra key
            groups = [{k: v for k, v in g.items() if k != "layer_adaptation"} for g in groups]
        opt = make(groups)  # type: ignore[operator]
        for _ in range(2):
            opt.zero_grad()
            net(x).square().sum().backward()
            opt.step()
        results.append([p.detach().clone() for p in net.parameters()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_groups_drive_lamb_and_lars() -> None:
    for make in (lambda g: Lamb(g, lr=1e-2), lambda g: Lars(g, lr=0.1)):
        net = Net()
        opt = make(param_groups(net, 0.05))
        assert [g["layer_adaptation"] for g in opt.param_groups] == [True, False]
        assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
