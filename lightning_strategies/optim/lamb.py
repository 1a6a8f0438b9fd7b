"""LAMB: layer-wise adaptive moments for large-batch training.

You, Li, Reddi, Hseu, Kumar, Bhojanapalli, Song, Demmel, Keutzer and Hsieh, "Large Batch
Optimization for Deep Learning: Training BERT in 76 minutes", ICLR 2020
(arXiv:1904.00962), Algorithm 2. The style follows torch's ``optim/adamw.py`` and timm's
``optim/lamb.py``; ``trust_clip=True`` is timm's LAMBC, ``max_grad_norm`` NVIDIA's
global gradient pre-normalisation (apex ``FusedLAMB``).

The helpers at the bottom (validation, the ``foreach`` decision, the CPU cache blocking of the
multi-tensor path) are shared with :mod:`lightning_strategies.optim.lars`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, cast

import torch
from torch import Tensor
from torch.optim.optimizer import Optimizer, ParamsT

__all__ = ["Lamb"]

# Devices whose tensors the ``torch._foreach_*`` ops accept (CPU runs them as a C++ loop
# over the per-tensor kernels, CUDA/XPU as fused multi-tensor kernels).
_FOREACH_DEVICES = ("cpu", "cuda", "xpu")
_FOREACH_TYPES = (Tensor, torch.nn.Parameter)


class _LayerwiseOptimizer(Optimizer):
    """The torch conventions Lamb and Lars share: every param group validated when added,
    complex parameters refused, and options added after a checkpoint was written filled with
    their defaults (``_GROUP_DEFAULTS``) so old optimizer states load."""

    _GROUP_DEFAULTS: ClassVar[dict[str, Any]] = {}

    def _validate_group(self, group: dict[str, Any], *, where: str) -> None:
        raise NotImplementedError

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self._GROUP_DEFAULTS.items():
                group.setdefault(key, value)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (as torch does), then check its hyperparameters and parameters.

        Args:
            param_group: the group; keys it lacks take the constructor's values.
        """
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        try:
            self._validate_group(self.param_groups[index], where=f"param group {index}: ")
            _refuse_complex(type(self).__name__, self.param_groups[index]["params"], index)
        except ValueError:
            self.param_groups.pop()
            raise


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

    The implementation evaluates :math:`r` as
    :math:`\lambda x + c\, m / (\sqrt{v} + \epsilon\sqrt{1-\beta_2^t})` with
    :math:`c = \sqrt{1-\beta_2^t} / (1-\beta_1^t)`, the same quantity with two passes over the
    tensors fewer. Norms are taken in float32 (float64 for float64 parameters); the moments
    are kept in the parameter's dtype (so bf16/fp16 parameters get bf16/fp16 state, as in
    torch's Adam: use fp32 master weights where that precision matters).

    The multi-tensor path (``torch._foreach_*`` ops, norms by ``torch._foreach_norm``) and the
    per-tensor path run the same elementwise operations in the same order and agree to the
    last bit up to the summation order of norms. On CPU the multi-tensor path is cache
    blocked: runs of small tensors, and large tensors in chunks, of ``CPU_BLOCK_ELEMENTS`` go
    through all their operations while in cache (about 1.5x faster than the per-tensor loop
    on ResNet-50's shapes, where unblocked foreach ops are slower than the loop).

    Per param group: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``bias_correction``,
    ``trust_clip``, ``foreach`` and ``layer_adaptation`` (default True; False gives
    trust = 1, the paper's exclusion of biases and normalisation layers, which
    :func:`~lightning_strategies.optim.param_groups` sets for them).

    Args:
        params: parameters or param groups (dicts) to optimise.
        lr: learning rate :math:`\eta`.
        betas: decay rates :math:`(\beta_1, \beta_2)` of the first and second moments.
        eps: added to :math:`\sqrt{\hat v}` for numerical stability.
        weight_decay: decoupled weight decay :math:`\lambda`, added to the update before the
            trust ratio (as in the paper).
        bias_correction: divide the moments by :math:`1-\beta^t`.
        trust_clip: clip the trust ratio to at most 1 (LAMBC).
        max_grad_norm: when set and the global gradient norm over all groups exceeds it,
            gradients are scaled by ``max_grad_norm / global_norm`` before the moments
            (NVIDIA's variant); ``p.grad`` itself is left untouched. Global, so read from the
            constructor, not from the groups.
        foreach: use the multi-tensor ``torch._foreach_*`` path (``None``: whenever every
            parameter is a plain tensor on CPU, CUDA or XPU). Both paths give the same result.

    Raises:
        ValueError: a hyperparameter out of range, or a complex parameter.

    Example:
        >>> from lightning_strategies.optim import Lamb, param_groups
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = Lamb(param_groups(model, weight_decay=0.01), lr=2e-3)
    """

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
            "layer_adaptation": True,
            "max_grad_norm": max_grad_norm,
            "foreach": foreach,
        }
        _validate_lamb(defaults, where="")
        super().__init__(params, defaults)

    _GROUP_DEFAULTS: ClassVar[dict[str, Any]] = {
        "bias_correction": True,
        "trust_clip": False,
        "layer_adaptation": True,
        "max_grad_norm": None,
        "foreach": None,
    }

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.defaults.setdefault("max_grad_norm", None)

    def _validate_group(self, group: dict[str, Any], *, where: str) -> None:
        _validate_lamb(group, where=where)

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
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimisation step.

        Args:
            closure: re-evaluates the model and returns the loss (called with grad enabled).

        Returns:
            The closure's loss, or None without a closure.

        Raises:
            RuntimeError: a parameter has a sparse gradient.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        params_with_grad = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        _refuse_sparse("Lamb", params_with_grad)
        max_grad_norm = self.defaults["max_grad_norm"]
        grad_scale: Tensor | None = None
        if max_grad_norm is not None and params_with_grad:
            # NVIDIA's pre-normalisation: g <- g * min(1, max_grad_norm / ||all g||), applied
            # as the moments are updated, so p.grad stays as the user (and logging) left it.
            foreach = all(_use_foreach(g["foreach"], g["params"]) for g in self.param_groups)
            grads = [cast(Tensor, p.grad) for p in params_with_grad]
            grad_scale = _global_clip_factor(grads, float(max_grad_norm), foreach=foreach)

        for group in self.param_groups:
            tensors = self._init_group(group)
            if not tensors.params:
                continue
            beta1, beta2 = group["betas"]
            kwargs: dict[str, Any] = {
                "lr": float(group["lr"]),
                "beta1": float(beta1),
                "beta2": float(beta2),
                "eps": float(group["eps"]),
                "weight_decay": float(group["weight_decay"]),
                "bias_correction": bool(group["bias_correction"]),
                "trust_clip": bool(group["trust_clip"]),
                "layer_adaptation": bool(group["layer_adaptation"]),
                "grad_scale": grad_scale,
            }
            if _use_foreach(group["foreach"], tensors.params):
                _multi_tensor_lamb(tensors, **kwargs)
            else:
                _single_tensor_lamb(tensors, **kwargs)
        return loss


class _LambGroup:
    """The tensors of one param group that have a gradient this step, in group order."""

    def __init__(self) -> None:
        self.params: list[Tensor] = []
        self.grads: list[Tensor] = []
        self.exp_avgs: list[Tensor] = []
        self.exp_avg_sqs: list[Tensor] = []
        self.steps: list[Tensor] = []


def _bias_terms(
    steps: Sequence[Tensor], *, beta1: float, beta2: float, eps: float, bias_correction: bool
) -> tuple[list[float], list[float]]:
    """Per tensor ``c = sqrt(1-b2^t)/(1-b1^t)`` and ``eps * sqrt(1-b2^t)`` (1 and eps without correction).

    One vectorised float64 computation on the host step counters for the whole list (the
    per-tensor path calls it with one-element lists, so both paths get the same numbers).
    """
    if not bias_correction:
        return [1.0] * len(steps), [eps] * len(steps)
    t = torch.stack(list(steps)).to(torch.float64)
    bc2_sqrt = (1.0 - torch.pow(beta2, t)).sqrt()
    c = bc2_sqrt / (1.0 - torch.pow(beta1, t))
    return c.tolist(), (bc2_sqrt * eps).tolist()


def _lamb_scales(w_norms: Tensor, r_norms: Tensor, *, lr: float, trust_clip: bool) -> Tensor:
    """``-lr * trust`` per tensor, trust = ||x|| / ||r|| (1 when either is 0; clipped at 1 for LAMBC)."""
    # norms are >= 0, so min > 0 means both are non-zero
    trust = torch.where(torch.minimum(w_norms, r_norms) > 0, w_norms / r_norms, 1.0)
    if trust_clip:
        trust = trust.clamp(max=1.0)
    return trust * -lr


def _single_tensor_lamb(
    g: _LambGroup,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    trust_clip: bool,
    layer_adaptation: bool,
    grad_scale: Tensor | None,
) -> None:
    for x, grad, m, v, step in zip(g.params, g.grads, g.exp_avgs, g.exp_avg_sqs, g.steps, strict=True):
        if grad_scale is not None:
            grad = grad.mul(grad_scale)  # g = g min(1, max_grad_norm / ||all g||)
        step += 1
        (c,), (eps_t,) = _bias_terms([step], beta1=beta1, beta2=beta2, eps=eps, bias_correction=bias_correction)
        m.lerp_(grad, 1 - beta1)  # m = b1 m + (1-b1) g
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)  # v = b2 v + (1-b2) g^2
        denom = v.sqrt().add_(eps_t)  # sqrt(v) + eps sqrt(1-b2^t) = sqrt(1-b2^t) (sqrt(v^) + eps)
        # r = m^/(sqrt(v^)+eps) + wd x
        r = x.mul(weight_decay).addcdiv_(m, denom, value=c) if weight_decay != 0 else m.div(denom).mul_(c)
        if layer_adaptation:
            w_norm = torch.linalg.vector_norm(x, dtype=_norm_dtype(x)).reshape(1)
            r_norm = torch.linalg.vector_norm(r, dtype=_norm_dtype(r)).reshape(1)
            scale = _lamb_scales(w_norm, r_norm, lr=lr, trust_clip=trust_clip)[0]
            x.addcmul_(r, scale)  # x = x - lr trust r
        else:
            x.add_(r, alpha=-lr)  # x = x - lr r  (trust = 1)


def _multi_tensor_lamb(
    g: _LambGroup,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    trust_clip: bool,
    layer_adaptation: bool,
    grad_scale: Tensor | None,
) -> None:
    grouped = Optimizer._group_tensors_by_device_and_dtype(
        [g.params, g.grads, g.exp_avgs, g.exp_avg_sqs, g.steps]  # type: ignore[list-item]
    )
    for (params_, grads_, exp_avgs_, exp_avg_sqs_, steps_), _ in grouped.values():
        xs, grads, ms, vs, steps = (cast(list[Tensor], t) for t in (params_, grads_, exp_avgs_, exp_avg_sqs_, steps_))
        torch._foreach_add_(steps, 1.0)
        c, eps_t = _bias_terms(steps, beta1=beta1, beta2=beta2, eps=eps, bias_correction=bias_correction)
        norm_dtype = _norm_dtype(xs[0])
        for unit in _units([xs, grads, ms, vs], _block_elements(xs[0].device)):
            # A unit is a run of whole tensors, or one large tensor cut into chunks; each op
            # below runs on one run / chunk, which stays in cache from the first op to the last.
            # A chunked tensor's step waits for its norm, so its chunks of r are kept until then.
            ux, ug, um, uv = unit.lists
            uc, ue = unit.per_view(c), unit.per_view(eps_t)
            w_norms: list[Tensor] = []
            r_norms: list[Tensor] = []
            rs: list[Tensor] = []
            for b in unit.blocks:
                gb = ug[b]
                if grad_scale is not None:
                    gb = list(torch._foreach_mul(gb, grad_scale))  # g = g min(1, max_grad_norm / ||all g||)
                torch._foreach_lerp_(um[b], gb, 1 - beta1)  # m = b1 m + (1-b1) g
                torch._foreach_mul_(uv[b], beta2)
                torch._foreach_addcmul_(uv[b], gb, gb, 1 - beta2)  # v = b2 v + (1-b2) g^2
                r = _lamb_direction(ux[b], um[b], uv[b], ue[b], uc[b], weight_decay)
                if not layer_adaptation:
                    torch._foreach_add_(ux[b], r, alpha=-lr)  # x = x - lr r  (trust = 1)
                    continue
                w_norms.extend(torch._foreach_norm(ux[b], 2, dtype=norm_dtype))
                r_norms.extend(torch._foreach_norm(r, 2, dtype=norm_dtype))
                rs.extend(r)
            if not layer_adaptation:
                continue
            scales = _lamb_scales(_unit_norms(unit, w_norms), _unit_norms(unit, r_norms), lr=lr, trust_clip=trust_clip)
            torch._foreach_addcmul_(ux, rs, unit.spread(scales.unbind(0)))  # x = x - lr trust r


def _lamb_direction(
    xs: list[Tensor],
    ms: list[Tensor],
    vs: list[Tensor],
    eps_t: list[float],
    c: list[float],
    weight_decay: float,
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


# ---- helpers shared with lars.py ----------------------------------------------------------

# Cache blocking of the multi-tensor path on CPU. There the foreach ops are a C++ loop over
# the per-tensor kernels, so an op over a whole list streams every tensor through memory once
# per op (ResNet-50: ~100 MB per op), and each op that returns new tensors page-faults in
# fresh memory of that size. Cutting the list into units of at most this many elements
# (runs of whole tensors; a larger tensor alone, in chunks) keeps a unit in cache across all
# of its ops and its temporaries small. GPUs fuse a list into few launches: no blocking.
CPU_BLOCK_ELEMENTS = 1 << 19


def _block_elements(device: torch.device) -> int | None:
    return CPU_BLOCK_ELEMENTS if device.type == "cpu" else None


class _Unit:
    """Parallel tensor lists holding either a run of whole tensors or one tensor's flat chunks.

    Attributes:
        index: the tensors' positions in the original lists (one position when chunked).
        chunked: whether the lists hold chunks of the one tensor ``index[0]``.
        lists: the parallel lists, in the order given to :func:`_units`.
        blocks: slices of the lists to run each op on: everything for a run of whole tensors,
            one chunk at a time for a chunked tensor.
    """

    def __init__(self, index: list[int], lists: list[list[Tensor]], chunked: bool) -> None:
        self.index = index
        self.chunked = chunked
        self.lists = lists
        n = len(lists[0])
        self.blocks = [slice(j, j + 1) for j in range(n)] if chunked else [slice(0, n)]

    def per_view(self, values: Sequence[Any]) -> list[Any]:
        """``values`` (one per tensor of the original lists) for each view of this unit."""
        return self.spread([values[i] for i in self.index])

    def spread(self, values: Sequence[Any]) -> list[Any]:
        """``values`` (one per tensor of this unit) for each view: repeated over a tensor's chunks."""
        return [values[0]] * len(self.lists[0]) if self.chunked else list(values)


def _units(lists: list[list[Tensor]], block: int | None) -> list[_Unit]:
    """Split parallel tensor lists into cache-sized units (one unit of everything for ``block=None``)."""
    n = len(lists[0])
    if block is None:
        return [_Unit(list(range(n)), [list(t) for t in lists], False)]
    units: list[_Unit] = []
    run: list[int] = []
    size = 0

    def flush() -> None:
        if run:
            units.append(_Unit(list(run), [[t[i] for i in run] for t in lists], False))
            run.clear()

    for i in range(n):
        numel = lists[0][i].numel()
        parallel = [t[i] for t in lists]
        if numel > block and all(t.is_contiguous() for t in parallel):
            flush()
            size = 0
            chunks = [list(t.view(-1).split(block)) for t in parallel]
            units.append(_Unit([i], chunks, True))
            continue
        if run and size + numel > block:
            flush()
            size = 0
        run.append(i)
        size += numel
    flush()
    return units


def _unit_norms(unit: _Unit, norms: list[Tensor]) -> Tensor:
    """The unit's tensors' norms (1-D) from its views' norms: sqrt(sum of squares) over chunks."""
    stacked = torch.stack(norms)
    return stacked.square().sum().sqrt().reshape(1) if unit.chunked else stacked


def _use_foreach(foreach: bool | None, params: Iterable[Tensor]) -> bool:
    """``foreach`` when given, else True when every tensor is a plain tensor on a foreach device."""
    if foreach is not None:
        return bool(foreach)
    if torch.jit.is_scripting():
        return False
    return all(type(p) in _FOREACH_TYPES and p.device.type in _FOREACH_DEVICES for p in params)


def _global_clip_factor(grads: list[Tensor], max_norm: float, *, foreach: bool) -> Tensor:
    """``min(1, max_norm / ||grads||)`` over all tensors, a 0-dim float32 tensor (no host sync)."""
    if foreach:
        # grouped by device and dtype, then put back in parameter order (the same sum as below)
        norms: list[Tensor] = [torch.empty(0)] * len(grads)
        grouped = Optimizer._group_tensors_by_device_and_dtype([grads], with_indices=True)  # type: ignore[list-item]
        for (device_grads,), indices in grouped.values():
            dev = cast(list[Tensor], device_grads)
            for i, n in zip(indices, torch._foreach_norm(dev, 2, dtype=_norm_dtype(dev[0])), strict=True):
                norms[i] = n
    else:
        norms = [torch.linalg.vector_norm(g, dtype=_norm_dtype(g)) for g in grads]
    device = norms[0].device
    dtype = torch.float64 if all(n.dtype == torch.float64 for n in norms) else torch.float32
    total = torch.linalg.vector_norm(torch.stack([n.to(device=device, dtype=dtype) for n in norms]))
    return torch.where(total > max_norm, max_norm / total, torch.ones_like(total))


def _norm_dtype(t: Tensor) -> torch.dtype:
    """Norms in float32 (float64 for float64 tensors): bf16/fp16 sums of squares lose too much."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _refuse_sparse(name: str, params: Iterable[Tensor]) -> None:
    for p in params:
        if p.grad is not None and p.grad.is_sparse:
            raise RuntimeError(
                f"{name} does not support sparse gradients: found a sparse gradient for a parameter "
                f"of shape {tuple(p.shape)}; expected dense gradients. Use nn.Embedding(sparse=False) "
                "or torch.optim.SparseAdam for that parameter."
            )


def _refuse_complex(name: str, params: Iterable[Tensor], group: int) -> None:
    for p in params:
        if torch.is_complex(p):
            raise ValueError(
                f"{name} does not support complex parameters: found a {p.dtype} tensor of shape "
                f"{tuple(p.shape)} in param group {group}; expected real floating-point tensors. "
                "Optimise torch.view_as_real(p) (a real parameter) instead."
            )


def _check(ok: bool, what: str, value: object, expected: str, where: str) -> None:
    if not ok:
        raise ValueError(f"{where}Invalid {what}: {value!r}; expected {expected}.")


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _validate_lamb(group: dict[str, Any], *, where: str) -> None:
    lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
    _check(_is_real(lr) and lr >= 0.0, "learning rate", lr, "a float >= 0 (lr=...)", where)
    _check(_is_real(eps) and eps >= 0.0, "epsilon value", eps, "a float >= 0 (eps=...)", where)
    _check(_is_real(wd) and wd >= 0.0, "weight_decay value", wd, "a float >= 0 (weight_decay=...)", where)
    betas = group["betas"]
    _check(
        isinstance(betas, Sequence) and not isinstance(betas, str) and len(betas) == 2,
        "betas",
        betas,
        "a pair (beta1, beta2) such as (0.9, 0.999)",
        where,
    )
    for i, beta in enumerate(betas):
        _check(_is_real(beta) and 0.0 <= beta < 1.0, f"beta parameter at index {i}", beta, "0 <= beta < 1", where)
    mgn = group["max_grad_norm"]
    _check(
        mgn is None or (_is_real(mgn) and mgn > 0.0),
        "max_grad_norm value",
        mgn,
        "None (no pre-normalisation) or a float > 0",
        where,
    )
    for flag in ("bias_correction", "trust_clip", "layer_adaptation"):
        _check(isinstance(group[flag], bool), f"{flag} value", group[flag], "True or False", where)
    _check(
        group["foreach"] in (None, True, False),
        "foreach value",
        group["foreach"],
        "None, True or False",
        where,
    )
