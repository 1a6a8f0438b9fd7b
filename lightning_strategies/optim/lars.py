"""LARS: layer-wise adaptive rate scaling for large-batch SGD.

You, Gitman and Ginsburg, "Large Batch Training of Convolutional Networks", 2017 (arXiv:1708.03888), Algorithm 1,
with torch's SGD momentum convention on top (as in NVIDIA's LARC and timm's ``optim/lars.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from lightning_strategies.optim._foreach import (
    _group_by_device_and_dtype,
    _GroupOptions,
    _is_real_number,
    _LayerwiseOptimizer,
    _norm_dtype,
    _require_valid,
    _split_into_cache_units,
    _use_foreach,
)

__all__ = ["Lars"]


class Lars(_LayerwiseOptimizer):
    r"""LARS (You et al. 2017, Algorithm 1): SGD whose step is rescaled per tensor by a local lr.

    For each parameter tensor :math:`x` with gradient :math:`g`:

    .. math::
        \text{local} &= \eta_{tc} \, \|x\| / (\|g\| + \lambda \|x\| + \epsilon)
            \quad (1 \text{ if } \|x\| = 0 \text{ or } \|g\| = 0;
            \min(\cdot / \gamma, 1) \text{ with trust\_clip}; 1 \text{ if layer\_adaptation is False}) \\
        d &= \text{local} \cdot (g + \lambda x) \\
        b &\leftarrow \mu b + d \quad (b = d \text{ at the first step, as torch's SGD}) \\
        d &\leftarrow d + \mu b \text{ (nesterov)} \quad\text{or}\quad d \leftarrow b \\
        x &\leftarrow x - \gamma d

    With ``momentum=0`` there is no buffer and :math:`x \leftarrow x - \gamma d`. Norms are taken in float32
    (float64 for float64 parameters); the momentum buffer has the parameter's dtype. Every option may be set per
    param group, as may ``layer_adaptation`` (default True; False gives local = 1, plain SGD for biases and
    normalisation layers, which :func:`~lightning_strategies.optim.param_groups` sets for them).

    Args:
        lr: global learning rate :math:`\gamma` (no default: it depends on the batch size).
        momentum: momentum factor :math:`\mu`.
        weight_decay: L2 weight decay :math:`\lambda`, inside the local lr and the step.
        trust_coefficient: :math:`\eta_{tc}`, how far one step may move a tensor relative to its norm.
        eps: added to the local-lr denominator.
        nesterov: Nesterov momentum (needs ``momentum > 0``).
        trust_clip: LARC's clipping: scale each tensor's step by ``min(local / lr, 1)``, so its effective rate is
            ``min(local, lr)``: the layer-wise rate may lower the global one, never raise it (NVIDIA apex
            ``LARC(clip=True)``, timm ``trust_clip``).
        foreach: the multi-tensor path, as for :class:`~lightning_strategies.optim.Lamb` (the same operations in
            the same order as the per-tensor one).

    Raises:
        ValueError: a hyperparameter out of range, or a complex parameter.
    """

    _flags = ("nesterov",)

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 1e-4,
        *,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
        nesterov: bool = False,
        trust_clip: bool = False,
        foreach: bool | None = None,
    ) -> None:
        defaults: dict[str, Any] = {
            "lr": lr,
            "momentum": momentum,
            "weight_decay": weight_decay,
            "trust_coefficient": trust_coefficient,
            "eps": eps,
            "nesterov": nesterov,
            "trust_clip": trust_clip,
            "foreach": foreach,
        }
        super().__init__(params, defaults)

    def _validate_options(self, group: dict[str, Any], *, where: str) -> None:
        momentum, tc = group["momentum"], group["trust_coefficient"]
        ok = _is_real_number(momentum) and 0.0 <= momentum < 1.0
        _require_valid(ok, "momentum value", momentum, "0 <= momentum < 1", where)
        _require_valid(
            _is_real_number(tc) and tc > 0.0, "trust_coefficient value", tc, "a float > 0 (the paper uses 0.001)", where
        )
        if group["nesterov"] and momentum <= 0.0:
            raise ValueError(
                f"{where}Invalid nesterov value: True with momentum={momentum!r}; Nesterov momentum needs "
                "momentum > 0. Set momentum (e.g. 0.9) or nesterov=False."
            )

    def _update(self) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [cast(Tensor, p.grad) for p in params]
            bufs: list[Tensor | None] = [self.state[p].get("momentum_buffer") for p in params]
            options = _LarsOptions.from_group(group)
            if _use_foreach(group["foreach"], params):
                _multi_tensor_lars(params, grads, bufs, options)
            else:
                _single_tensor_lars(params, grads, bufs, options)
            if options.momentum != 0:
                for p, buf in zip(params, bufs, strict=True):
                    self.state[p]["momentum_buffer"] = buf


@dataclass(frozen=True)
class _LarsOptions(_GroupOptions):
    lr: float
    momentum: float
    weight_decay: float
    trust_coefficient: float
    eps: float
    nesterov: bool
    trust_clip: bool
    layer_adaptation: bool


def _local_lrs(w_norms: Tensor, g_norms: Tensor, o: _LarsOptions) -> Tensor:
    """tc ||x|| / (||g|| + wd ||x|| + eps) per tensor; 1 when a norm is 0; with trust_clip ``min(local / lr, 1)``."""
    local = o.trust_coefficient * w_norms / (g_norms + o.weight_decay * w_norms + o.eps)
    local = torch.where(torch.minimum(w_norms, g_norms) > 0, local, 1.0)  # norms >= 0: both non-zero
    if o.trust_clip:
        # lr = 0 makes no step whatever the scale; 1 keeps the division finite
        local = (local / o.lr).clamp(max=1.0) if o.lr > 0 else torch.ones_like(local)
    return local


def _single_tensor_lars(params: list[Tensor], grads: list[Tensor], bufs: list[Tensor | None], o: _LarsOptions) -> None:
    """The per-tensor path; creates the momentum buffers it finds missing in ``bufs``, in place."""
    for i, (x, grad) in enumerate(zip(params, grads, strict=True)):
        local: Tensor | None = None
        if o.layer_adaptation:
            w_norm = torch.linalg.vector_norm(x, dtype=_norm_dtype(x)).reshape(1)
            g_norm = torch.linalg.vector_norm(grad, dtype=_norm_dtype(grad)).reshape(1)
            local = _local_lrs(w_norm, g_norm, o)[0]
        d = grad.add(x, alpha=o.weight_decay) if o.weight_decay != 0 else grad  # d = g + wd x
        if o.momentum == 0:
            if local is None:
                x.add_(d, alpha=-o.lr)  # x = x - lr d
            else:
                x.addcmul_(d, local, value=-o.lr)  # x = x - lr local d
            continue
        buf = bufs[i]
        if buf is None:
            # b = local d at the first step (torch SGD initialises the buffer to the step)
            buf = bufs[i] = d.mul(local) if local is not None else d.clone()
        elif local is not None:
            buf.mul_(o.momentum).addcmul_(d, local)  # b = mu b + local d
        else:
            buf.mul_(o.momentum).add_(d)  # b = mu b + d
        if o.nesterov:
            step = d.mul(local) if local is not None else d.clone()
            step.add_(buf, alpha=o.momentum)  # d = local d + mu b
            x.add_(step, alpha=-o.lr)  # x = x - lr d
        else:
            x.add_(buf, alpha=-o.lr)  # x = x - lr b


def _multi_tensor_lars(params: list[Tensor], grads: list[Tensor], bufs: list[Tensor | None], o: _LarsOptions) -> None:
    grouped = _group_by_device_and_dtype([params, grads, bufs])
    for (params_, grads_, bufs_), indices in grouped.values():
        xs, gs = cast(list[Tensor], params_), cast(list[Tensor], grads_)
        dev_bufs: list[Tensor | None] = bufs_
        if o.momentum != 0 and not all(b is not None for b in dev_bufs):
            # First step (or tensors new to the group): buffers are created whole, per tensor.
            sub_bufs = list(dev_bufs)
            _single_tensor_lars(xs, gs, sub_bufs, o)
            for j, sub_buf in zip(indices, sub_bufs, strict=True):
                bufs[j] = sub_buf
            continue
        lists = [xs, gs] if o.momentum == 0 else [xs, gs, cast(list[Tensor], dev_bufs)]
        for unit in _split_into_cache_units(lists):
            # each op below runs on one run / chunk, which stays in cache from the first op to the last
            x_views, g_views = unit.tensor_lists[0], unit.tensor_lists[1]
            local_views: list[Tensor] | None = None
            if o.layer_adaptation:
                w_norms = unit.tensor_norms(list(torch._foreach_norm(x_views, 2, dtype=_norm_dtype(x_views[0]))))
                g_norms = unit.tensor_norms(list(torch._foreach_norm(g_views, 2, dtype=_norm_dtype(g_views[0]))))
                local_views = unit.expand_to_views(_local_lrs(w_norms, g_norms, o).unbind(0))
            for part in unit.op_slices:
                ds = g_views[part]
                if o.weight_decay != 0:
                    ds = list(torch._foreach_add(ds, x_views[part], alpha=o.weight_decay))  # d = g + wd x
                loc = local_views[part] if local_views is not None else None
                if o.momentum == 0:
                    if loc is None:
                        torch._foreach_add_(x_views[part], ds, alpha=-o.lr)  # x = x - lr d
                    else:
                        torch._foreach_addcmul_(x_views[part], ds, loc, value=-o.lr)  # x = x - lr local d
                    continue
                b_views = unit.tensor_lists[2][part]
                torch._foreach_mul_(b_views, o.momentum)
                if loc is not None:
                    torch._foreach_addcmul_(b_views, ds, loc)  # b = mu b + local d
                else:
                    torch._foreach_add_(b_views, ds)  # b = mu b + d
                if o.nesterov:
                    steps = list(torch._foreach_mul(ds, loc) if loc is not None else torch._foreach_mul(ds, 1.0))
                    torch._foreach_add_(steps, b_views, alpha=o.momentum)  # d = local d + mu b
                    torch._foreach_add_(x_views[part], steps, alpha=-o.lr)  # x = x - lr d
                else:
                    torch._foreach_add_(x_views[part], b_views, alpha=-o.lr)  # x = x - lr b
