"""LAMB: layer-wise adaptive moments for large-batch training.

You, Li, Reddi, Hseu, Kumar, Bhojanapalli, Song, Demmel, Keutzer and Hsieh, "Large Batch Optimization for Deep
Learning: Training BERT in 76 minutes", ICLR 2020 (arXiv:1904.00962), Algorithm 2, in the style of torch's
``optim/adamw.py`` and timm's ``optim/lamb.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT
from typing_extensions import Self

from lightning_strategies.optim._foreach import (
    _global_clip_factor,
    _group_by_device_and_dtype,
    _GroupOptions,
    _is_real_number,
    _LayerwiseOptimizer,
    _norm_dtype,
    _require_valid,
    _split_into_cache_units,
    _use_foreach,
)

__all__ = ["Lamb"]


class Lamb(_LayerwiseOptimizer):
    r"""LAMB (You et al., ICLR 2020, Algorithm 2): Adam moments scaled per tensor by a trust ratio.

    For each parameter tensor :math:`x` with gradient :math:`g` at step :math:`t`:

    .. math::
        m &\leftarrow \beta_1 m + (1-\beta_1) g, \qquad
        v \leftarrow \beta_2 v + (1-\beta_2) g^2 \\
        \hat m &= m / (1-\beta_1^t), \qquad \hat v = v / (1-\beta_2^t)
            \quad\text{(only with bias\_correction)} \\
        r &= \hat m / (\sqrt{\hat v} + \epsilon) + \lambda x \\
        \text{trust} &= \|x\| / \|r\| \quad (1 \text{ if either norm is } 0;
            \min(\cdot, 1) \text{ with trust\_clip}; 1 \text{ if layer\_adaptation is False}) \\
        x &\leftarrow x - \eta \cdot \text{trust} \cdot r

    Norms are taken in float32 (float64 for float64 parameters); the moments have the parameter's dtype (as in torch's
    Adam: use fp32 master weights where bf16/fp16 state is too coarse). Every option but ``max_grad_norm`` may be set
    per param group, as may ``layer_adaptation`` (default True; False gives trust = 1, the paper's exclusion of biases
    and normalisation layers, which :func:`~lightning_strategies.optim.param_groups` sets for them).

    Args:
        lr: learning rate :math:`\eta`.
        betas: decay rates :math:`(\beta_1, \beta_2)` of the first and second moments.
        eps: added to :math:`\sqrt{\hat v}` for numerical stability.
        weight_decay: decoupled weight decay :math:`\lambda`, added to the update before the trust ratio.
        bias_correction: divide the moments by :math:`1-\beta^t`.
        trust_clip: clip the trust ratio to at most 1 (timm's LAMBC).
        max_grad_norm: when set and the global gradient norm over all groups exceeds it, gradients are scaled by
            ``max_grad_norm / global_norm`` before the moments (NVIDIA's pre-normalisation, apex ``FusedLAMB``);
            ``p.grad`` itself is left untouched. Global, so read from the constructor, not from the groups. When
            this optimizer holds only part of the model (a parameter-server shard), pass the whole model's norm to
            :meth:`step` as ``global_grad_norm``.
        foreach: use the multi-tensor ``torch._foreach_*`` path (``None``: whenever every parameter is a plain tensor
            on CPU, CUDA or XPU; cache blocked on CPU). Both paths run the same operations in the same order and
            agree to the last bit up to the summation order of norms.

    Raises:
        ValueError: a hyperparameter out of range, or a complex parameter.

    Example:
        >>> from lightning_strategies.optim import Lamb, param_groups
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = Lamb(param_groups(model, weight_decay=0.01), lr=2e-3)
    """

    _flags = ("bias_correction",)

    def __init__(
        self,
        params: ParamsT,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        *,
        bias_correction: bool = True,
        trust_clip: bool = False,
        max_grad_norm: float | None = None,
        foreach: bool | None = None,
    ) -> None:
        if isinstance(betas, Sequence) and not isinstance(betas, str):
            betas = cast(tuple[float, float], tuple(betas))  # a Hydra ListConfig -> a plain tuple
        defaults: dict[str, Any] = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "bias_correction": bias_correction,
            "trust_clip": trust_clip,
            "max_grad_norm": max_grad_norm,
            "foreach": foreach,
        }
        super().__init__(params, defaults)

    def _validate_options(self, group: dict[str, Any], *, where: str) -> None:
        betas = group["betas"]
        _require_valid(
            isinstance(betas, Sequence) and not isinstance(betas, str) and len(betas) == 2,
            "betas",
            betas,
            "a pair (beta1, beta2) such as (0.9, 0.999)",
            where,
        )
        for i, beta in enumerate(betas):
            ok = _is_real_number(beta) and 0.0 <= beta < 1.0
            _require_valid(ok, f"beta parameter at index {i}", beta, "0 <= beta < 1", where)
        mgn = group["max_grad_norm"]
        _require_valid(
            mgn is None or (_is_real_number(mgn) and mgn > 0.0),
            "max_grad_norm value",
            mgn,
            "None (no pre-normalisation) or a float > 0",
            where,
        )

    def _init_group(self, group: dict[str, Any]) -> _LambGroup:
        out = _LambGroup()
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            state = self.state[p]
            if len(state) == 0:
                # ``step`` stays a CPU float tensor, as in torch's optimizers (bias corrections
                # are computed from it on the host, no device sync).
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            out.params.append(p)
            out.grads.append(grad)
            out.exp_avgs.append(state["exp_avg"])
            out.exp_avg_sqs.append(state["exp_avg_sq"])
            out.steps.append(state["step"])
        return out

    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Callable[[], float] | None = None, *, global_grad_norm: Tensor | float | None = None
    ) -> float | None:
        """Perform one optimisation step; returns the loss of ``closure`` (called with grad enabled), if given
        (``RuntimeError`` for a sparse gradient).

        Args:
            global_grad_norm: the norm of the *whole model's* gradient for ``max_grad_norm``, when this optimizer
                holds only part of the model's tensors: the parameter servers agree on it across shards and
                pass it here, so every shard pre-normalises as one optimizer over the whole model would.
                ``None``: the norm over this optimizer's own gradients. Ignored without ``max_grad_norm``.
        """
        loss = self._begin_step(closure)
        self._update(global_grad_norm)
        return loss

    def _update(self, global_grad_norm: Tensor | float | None = None) -> None:
        params_with_grad = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        max_grad_norm = self.defaults["max_grad_norm"]
        grad_scale: Tensor | None = None
        if max_grad_norm is not None and params_with_grad:
            # NVIDIA's pre-normalisation: g <- g * min(1, max_grad_norm / ||all g||), applied
            # as the moments are updated, so p.grad stays as the user (and logging) left it.
            foreach = all(_use_foreach(g["foreach"], g["params"]) for g in self.param_groups)
            grads = [cast(Tensor, p.grad) for p in params_with_grad]
            total = None if global_grad_norm is None else torch.as_tensor(global_grad_norm, dtype=torch.float64)
            grad_scale = _global_clip_factor(grads, float(max_grad_norm), foreach=foreach, total=total)

        for group in self.param_groups:
            tensors = self._init_group(group)
            if not tensors.params:
                continue
            options = _LambOptions.from_group(group)
            if _use_foreach(group["foreach"], tensors.params):
                _multi_tensor_lamb(tensors, options, grad_scale)
            else:
                _single_tensor_lamb(tensors, options, grad_scale)


class _LambGroup:
    """The tensors of one param group that have a gradient this step, in group order."""

    def __init__(self) -> None:
        self.params: list[Tensor] = []
        self.grads: list[Tensor] = []
        self.exp_avgs: list[Tensor] = []
        self.exp_avg_sqs: list[Tensor] = []
        self.steps: list[Tensor] = []


@dataclass(frozen=True)
class _LambOptions(_GroupOptions):
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    bias_correction: bool
    trust_clip: bool
    layer_adaptation: bool

    @classmethod
    def from_group(cls, group: dict[str, Any]) -> Self:
        beta1, beta2 = group["betas"]
        return super().from_group({**group, "beta1": beta1, "beta2": beta2})


def _bias_terms(steps: Sequence[Tensor], o: _LambOptions) -> tuple[list[float], list[float]]:
    """Per tensor ``c = sqrt(1-b2^t)/(1-b1^t)`` and ``eps * sqrt(1-b2^t)`` (1 and eps without correction).

    With them ``r = wd x + c m / (sqrt(v) + eps sqrt(1-b2^t))``: the paper's ``r`` with two passes over the tensors
    fewer. Computed in float64 on the host step counters, per tensor too (one-element lists), so both paths agree.
    """
    if not o.bias_correction:
        return [1.0] * len(steps), [o.eps] * len(steps)
    t = torch.stack(list(steps)).to(torch.float64)
    bc2_sqrt = (1.0 - torch.pow(o.beta2, t)).sqrt()
    c = bc2_sqrt / (1.0 - torch.pow(o.beta1, t))
    return c.tolist(), (bc2_sqrt * o.eps).tolist()


def _trust_step_sizes(w_norms: Tensor, r_norms: Tensor, o: _LambOptions) -> Tensor:
    """``-lr * trust`` per tensor, trust = ||x|| / ||r|| (1 when either is 0; clipped at 1 for LAMBC)."""
    # norms are >= 0, so min > 0 means both are non-zero
    trust = torch.where(torch.minimum(w_norms, r_norms) > 0, w_norms / r_norms, 1.0)
    if o.trust_clip:
        trust = trust.clamp(max=1.0)
    return trust * -o.lr


def _single_tensor_lamb(g: _LambGroup, o: _LambOptions, grad_scale: Tensor | None) -> None:
    for x, grad, m, v, step in zip(g.params, g.grads, g.exp_avgs, g.exp_avg_sqs, g.steps, strict=True):
        if grad_scale is not None:
            grad = grad.mul(grad_scale)  # g = g min(1, max_grad_norm / ||all g||)
        step += 1
        (c,), (eps_t,) = _bias_terms([step], o)
        m.lerp_(grad, 1 - o.beta1)  # m = b1 m + (1-b1) g
        v.mul_(o.beta2).addcmul_(grad, grad, value=1 - o.beta2)  # v = b2 v + (1-b2) g^2
        denom = v.sqrt().add_(eps_t)  # sqrt(v) + eps sqrt(1-b2^t) = sqrt(1-b2^t) (sqrt(v^) + eps)
        # r = m^/(sqrt(v^)+eps) + wd x
        r = x.mul(o.weight_decay).addcdiv_(m, denom, value=c) if o.weight_decay != 0 else m.div(denom).mul_(c)
        if o.layer_adaptation:
            w_norm = torch.linalg.vector_norm(x, dtype=_norm_dtype(x)).reshape(1)
            r_norm = torch.linalg.vector_norm(r, dtype=_norm_dtype(r)).reshape(1)
            x.addcmul_(r, _trust_step_sizes(w_norm, r_norm, o)[0])  # x = x - lr trust r
        else:
            x.add_(r, alpha=-o.lr)  # x = x - lr r  (trust = 1)


def _multi_tensor_lamb(g: _LambGroup, o: _LambOptions, grad_scale: Tensor | None) -> None:
    grouped = _group_by_device_and_dtype([g.params, g.grads, g.exp_avgs, g.exp_avg_sqs, g.steps])
    for (params_, grads_, exp_avgs_, exp_avg_sqs_, steps_), _ in grouped.values():
        xs, grads, ms, vs, steps = (cast(list[Tensor], t) for t in (params_, grads_, exp_avgs_, exp_avg_sqs_, steps_))
        torch._foreach_add_(steps, 1.0)
        c, eps_t = _bias_terms(steps, o)
        norm_dtype = _norm_dtype(xs[0])
        for unit in _split_into_cache_units([xs, grads, ms, vs]):
            # Each op below runs on one run / chunk, which stays in cache from the first op to the last;
            # a chunked tensor's step waits for its whole norm, so its chunks of r are kept until then.
            x_views, g_views, m_views, v_views = unit.tensor_lists
            c_views, eps_views = unit.select_for_views(c), unit.select_for_views(eps_t)
            w_norms: list[Tensor] = []
            r_norms: list[Tensor] = []
            rs: list[Tensor] = []
            for part in unit.op_slices:
                g_part = g_views[part]
                if grad_scale is not None:
                    g_part = list(torch._foreach_mul(g_part, grad_scale))  # g = g min(1, max_grad_norm / ||all g||)
                torch._foreach_lerp_(m_views[part], g_part, 1 - o.beta1)  # m = b1 m + (1-b1) g
                torch._foreach_mul_(v_views[part], o.beta2)
                torch._foreach_addcmul_(v_views[part], g_part, g_part, 1 - o.beta2)  # v = b2 v + (1-b2) g^2
                r = _lamb_direction(
                    x_views[part], m_views[part], v_views[part], eps_views[part], c_views[part], o.weight_decay
                )
                if not o.layer_adaptation:
                    torch._foreach_add_(x_views[part], r, alpha=-o.lr)  # x = x - lr r  (trust = 1)
                    continue
                w_norms.extend(torch._foreach_norm(x_views[part], 2, dtype=norm_dtype))
                r_norms.extend(torch._foreach_norm(r, 2, dtype=norm_dtype))
                rs.extend(r)
            if not o.layer_adaptation:
                continue
            sizes = _trust_step_sizes(unit.tensor_norms(w_norms), unit.tensor_norms(r_norms), o)
            torch._foreach_addcmul_(x_views, rs, unit.expand_to_views(sizes.unbind(0)))  # x = x - lr trust r


def _lamb_direction(
    xs: list[Tensor], ms: list[Tensor], vs: list[Tensor], eps_t: list[float], c: list[float], weight_decay: float
) -> list[Tensor]:
    """r = m^/(sqrt(v^)+eps) + wd x for a list of tensors, from the bias terms of ``_bias_terms``."""
    denom = torch._foreach_sqrt(vs)
    torch._foreach_add_(denom, eps_t)  # sqrt(v) + eps sqrt(1-b2^t) = sqrt(1-b2^t) (sqrt(v^) + eps)
    if weight_decay != 0:
        rs = list(torch._foreach_mul(xs, weight_decay))
        torch._foreach_addcdiv_(rs, ms, denom, c)  # r = wd x + c m / denom = m^/(sqrt(v^)+eps) + wd x
    else:
        rs = list(torch._foreach_div(ms, denom))
        torch._foreach_mul_(rs, c)  # r = c m / denom = m^/(sqrt(v^)+eps)
    return rs
