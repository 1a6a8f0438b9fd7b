"""Recipe models: torchvision shapes, and the block view equals the model."""

from __future__ import annotations

import pytest
import torch
from torchvision.models import resnet50

from recipes.models import as_blocks, build_model


def test_resnet50_imagenet_matches_torchvision() -> None:
    ours = build_model("resnet50", num_classes=1000, stem="imagenet")
    ref = resnet50()
    assert [p.shape for p in ours.parameters()] == [p.shape for p in ref.parameters()]
    assert sum(p.numel() for p in ours.parameters()) == 25_557_032 and len(list(ours.parameters())) == 161


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("resnet18", {"width": 8, "in_channels": 1}),
        ("resnet50", {"width": 8}),
        ("small_cnn", {"width": 8}),
        ("wide_mlp", {"width": 16}),
        ("resnet18", {"width": 8, "stem": "imagenet"}),
    ],
)
def test_blocks_compute_the_model(name: str, kwargs: dict) -> None:
    model = build_model(name, num_classes=5, **kwargs).eval()
    x = torch.randn(2, kwargs.get("in_channels", 3), 32, 32)
    blocks = as_blocks(model)
    assert torch.allclose(blocks(x), model(x), atol=1e-6)
    # the blocks share the model's parameters (a pipeline trains the model itself)
    assert {id(p) for p in blocks.parameters()} == {id(p) for p in model.parameters()}


def test_small_stem_keeps_resolution() -> None:
    model = build_model("resnet18", num_classes=10, width=8)
    assert isinstance(model.maxpool, torch.nn.Identity)  # type: ignore[union-attr]
    assert model.conv1.stride == (1, 1)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "vgg16"}, "unknown model 'vgg16'; expected one of resnet18, resnet50, small_cnn, wide_mlp"),
        ({"stem": "tiny"}, "unknown stem 'tiny'"),
        ({"num_classes": 1}, "num_classes >= 2"),
    ],
)
def test_bad_model_config(kwargs: dict, message: str) -> None:
    args = {"name": "resnet18", "num_classes": 10, **kwargs}
    with pytest.raises(ValueError, match=message):
        build_model(**args)


def test_as_blocks_rejects_unknown_models() -> None:
    with pytest.raises(TypeError, match="cannot split a Linear into blocks"):
        as_blocks(torch.nn.Linear(2, 2))
