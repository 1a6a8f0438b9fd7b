"""Models for the recipes: torchvision ResNets (ImageNet or small-image stem) and a small CNN.

Every model can be viewed as an ordered sequence of blocks (:func:`as_blocks`), the form a
pipeline strategy splits into stages; the blocks share parameters with the model itself.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

__all__ = ["MODELS", "as_blocks", "build_model", "small_cnn", "wide_mlp"]

MODELS: tuple[str, ...] = ("resnet18", "resnet50", "small_cnn", "wide_mlp")
Stem = Literal["imagenet", "small"]


def small_cnn(num_classes: int, in_channels: int = 3, width: int = 32) -> nn.Sequential:
    """Four conv blocks with batch norm and a linear head: ~0.2M params at width 32."""
    def block(in_ch: int, out_ch: int, stride: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(out_ch),
            nn.ReLU(inplace=True),
        )

    return nn.Sequential(
        OrderedDict(
            stem=block(in_channels, width, 1),
            block1=block(width, width * 2, 2),
            block2=block(width * 2, width * 4, 2),
            block3=block(width * 4, width * 4, 1),
            head=nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width * 4, num_classes)),
        )
    )


def wide_mlp(num_classes: int, in_channels: int = 3, width: int = 1024) -> nn.Sequential:
    """Images pooled to 8x8, then four fully connected layers, three of them ``width`` wide.

    The model the seed's model parallelism is for: nearly all parameters are in wide FC layers
    (``2 width^2`` of them), which the ``"tensor"`` strategy splits as two column/row pairs.
    """
    return nn.Sequential(
        nn.AdaptiveAvgPool2d(8),
        nn.Flatten(),
        nn.Linear(in_channels * 64, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.ReLU(),
        nn.Linear(width, num_classes),
    )


# Residual block type and blocks per stage (He et al. 2016, Table 1).
_RESNET_LAYOUTS: dict[str, tuple[type[BasicBlock] | type[Bottleneck], list[int]]] = {
    "resnet18": (BasicBlock, [2, 2, 2, 2]),
    "resnet50": (Bottleneck, [3, 4, 6, 3]),
}


def _resnet(
    name: str, *, num_classes: int, in_channels: int, stem: str, width: int, zero_init_residual: bool
) -> ResNet:
    """A torchvision ``ResNet`` whose stage widths are ``width x (1, 2, 4, 8)`` (64 = torchvision's)."""
    block, blocks_per_stage = _RESNET_LAYOUTS[name]
    model = ResNet(block, blocks_per_stage, num_classes=num_classes, zero_init_residual=zero_init_residual)
    if stem == "imagenet" and in_channels == 3 and width == 64:
        return model
    # Rebuild the stem and stages with torchvision's own _make_layer, so the result is still a
    # torchvision ResNet (same forward, same state_dict layout) at another width.
    model.inplanes = width
    if stem == "small":
        # CIFAR-style stem (He et al. 2016 §4.2): a 3x3 stride-1 conv and no max-pool, so a
        # 32 px image still has 4x4 positions at layer4 instead of 1x1.
        model.conv1 = nn.Conv2d(in_channels, width, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    else:
        model.conv1 = nn.Conv2d(in_channels, width, kernel_size=7, stride=2, padding=3, bias=False)
    model.bn1 = nn.BatchNorm2d(width)
    model.layer1 = model._make_layer(block, width, blocks_per_stage[0])
    model.layer2 = model._make_layer(block, width * 2, blocks_per_stage[1], stride=2)
    model.layer3 = model._make_layer(block, width * 4, blocks_per_stage[2], stride=2)
    model.layer4 = model._make_layer(block, width * 8, blocks_per_stage[3], stride=2)
    model.fc = nn.Linear(width * 8 * block.expansion, num_classes)
    for module in model.modules():  # torchvision's initialisation, for the rebuilt modules
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
    if zero_init_residual:
        for module in model.modules():
            if isinstance(module, Bottleneck) and module.bn3.weight is not None:
                nn.init.zeros_(module.bn3.weight)
            elif isinstance(module, BasicBlock) and module.bn2.weight is not None:
                nn.init.zeros_(module.bn2.weight)
    return model


def build_model(
    name: str,
    *,
    num_classes: int,
    in_channels: int = 3,
    stem: str = "small",
    width: int = 64,
    channels_last: bool = False,
    compile: bool = False,
    zero_init_residual: bool = False,
) -> nn.Module:
    """Build a recipe model.

    Args:
        name: ``resnet18``, ``resnet50``, ``small_cnn`` or ``wide_mlp``.
        num_classes: outputs of the classifier.
        in_channels: image channels (1 for digits, 3 for RGB).
        stem: ``"small"`` (3x3 stride-1 conv, no max-pool; for 32 px images) or ``"imagenet"``
            (7x7 stride-2 conv and max-pool; for 224 px images). Ignored by ``small_cnn``.
        width: channels of the first stage; later stages double it (64 is torchvision's
            ResNet; 16 is 1/16 of the FLOPs, for CPU recipes). ``small_cnn`` uses it too;
            ``wide_mlp``'s hidden features.
        channels_last: store weights in NHWC, which tensor cores and oneDNN prefer.
        compile: wrap with ``torch.compile``.
        zero_init_residual: start each residual branch's last BN at zero (Goyal et al. §5.1).

    Raises:
        ValueError: for an unknown name or stem, or a non-positive class count.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(MODELS)} (set model=...)")
    if stem not in ("small", "imagenet"):
        raise ValueError(f"unknown stem {stem!r}; expected 'small' (32 px images) or 'imagenet' (224 px)")
    if num_classes < 2 or in_channels < 1 or width < 1:
        raise ValueError(
            "a classifier needs num_classes >= 2, in_channels >= 1 and width >= 1, found "
            f"{num_classes}, {in_channels} and {width}"
        )
    model: nn.Module
    if name == "small_cnn":
        model = small_cnn(num_classes, in_channels, width)
    elif name == "wide_mlp":
        model = wide_mlp(num_classes, in_channels, width)
    else:
        model = _resnet(
            name,
            num_classes=num_classes,
            in_channels=in_channels,
            stem=stem,
            width=width,
            zero_init_residual=zero_init_residual,
        )
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if compile:
        model = torch.compile(model)  # type: ignore[assignment]
    return model


def as_blocks(model: nn.Module) -> nn.Sequential:
    """The model as an ordered sequence of blocks sharing its parameters.

    A torchvision ResNet becomes ``stem, layer1.0, ..., layer4.N, head``; an ``nn.Sequential``
    is returned as it is. Running the blocks in order computes exactly ``model(x)``.

    Raises:
        TypeError: for a model of another kind (say which blocks it has).
    """
    inner = getattr(model, "_orig_mod", model)  # a torch.compile'd module wraps the original
    if isinstance(inner, nn.Sequential):
        return inner
    if isinstance(inner, ResNet):
        blocks: OrderedDict[str, nn.Module] = OrderedDict(
            stem=nn.Sequential(inner.conv1, inner.bn1, inner.relu, inner.maxpool)
        )
        for layer_name in ("layer1", "layer2", "layer3", "layer4"):
            for i, block in enumerate(getattr(inner, layer_name)):
                blocks[f"{layer_name}_{i}"] = block
        blocks["head"] = nn.Sequential(inner.avgpool, nn.Flatten(1), inner.fc)
        return nn.Sequential(blocks)
    raise TypeError(
        f"cannot split a {type(inner).__name__} into blocks; expected a torchvision ResNet or an "
        "nn.Sequential (write pipeline_layers() for it yourself)"
    )
