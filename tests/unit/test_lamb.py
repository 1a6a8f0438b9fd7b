"""Lamb against Algorithm 2 of You et al. (ICLR 2020), written out plainly below."""

from __future__ import annotations

import copy
import math
import pickle
from typing import Any

import pytest
import torch
from optim_cases import SHAPES, make_problem
from torch import nn

import lightning_strategies.optim._foreach as foreach_module
from lightning_strategies.optim import Lamb, param_groups


def reference_lamb(
    weights: list[torch.Tensor],
    grad_steps: list[list[torch.Tensor]],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: list[float],
    layer_adaptation: list[bool],
    bias_correction: bool,
    trust_clip: bool,
    max_grad_norm: float | None,
) -> tuple[list[torch.Tensor], list[float], list[float]]:
    """The paper's update, one tensor and one step at a time, in float64.

    Returns the final weights, every trust ratio used and every global gradient norm.
    """
    b1, b2 = betas
    xs = [w.clone().double() for w in weights]
    ms = [torch.zeros_like(x) for x in xs]
    vs = [torch.zeros_like(x) for x in xs]
    trusts: list[float] = []
    global_norms: list[float] = []
    for t, grads in enumerate(grad_steps, start=1):
        gs = [g.double() for g in grads]
        total = math.sqrt(sum(float((g * g).sum()) for g in gs))
        global_norms.append(total)
        if max_grad_norm is not None and total > max_grad_norm:
            gs = [g * (max_grad_norm / total) for g in gs]
        for i, g in enumerate(gs):
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            m_hat = ms[i] / (1 - b1**t) if bias_correction else ms[i]
            v_hat = vs[i] / (1 - b2**t) if bias_correction else vs[i]
            r = m_hat / (v_hat.sqrt() + eps) + weight_decay[i] * xs[i]
            w_norm, r_norm = float(xs[i].norm()), float(r.norm())
            trust = w_norm / r_norm if w_norm > 0 and r_norm > 0 else 1.0
            if trust_clip:
                trust = min(trust, 1.0)
            if not layer_adaptation[i]:
                trust = 1.0
            trusts.append(trust)
            xs[i] = xs[i] - lr * trust * r
    return xs, trusts, global_norms


def run_lamb(
    weights: list[torch.Tensor],
    grad_steps: list[list[torch.Tensor]],
    groups: list[dict[str, Any]] | None = None,
    **kwargs: Any,
) -> list[torch.Tensor]:
    params = [nn.Parameter(w.clone()) for w in weights]
    spec: Any = params if groups is None else [dict(g, params=[params[i] for i in g["idx"]]) for g in groups]
    if groups is not None:
        for g in spec:
            del g["idx"]
    opt = Lamb(spec, **kwargs)
    for grads in grad_steps:
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad.clone()
        opt.step()
    return [p.detach() for p in params]


CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "no_bias_correction": {"bias_correction": False},
    "trust_clip": {"trust_clip": True, "weight_scale": 5.0},
    "max_grad_norm": {"max_grad_norm": 2.0, "eps": 1e-2},
    "max_grad_norm_not_reached": {"max_grad_norm": 1e6},
    "no_weight_decay": {"weight_decay": 0.0},
    "zero_weights": {"weight_scale": 0.0},
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_paper_algorithm(case: str, foreach: bool) -> None:
    options = dict(CASES[case])
    weight_scale = options.pop("weight_scale", 1.0)
    kwargs: dict[str, Any] = {"lr": 0.01, "betas": (0.9, 0.99), "eps": 1e-6, "weight_decay": 0.05}
    kwargs.update(options)
    weights, grads = make_problem(5, weight_scale=weight_scale)
    ours = run_lamb(weights, grads, foreach=foreach, **kwargs)
    ref, trusts, norms = reference_lamb(
        weights,
        grads,
        lr=kwargs["lr"],
        betas=kwargs["betas"],
        eps=kwargs["eps"],
        weight_decay=[kwargs["weight_decay"]] * len(SHAPES),
        layer_adaptation=[True] * len(SHAPES),
        bias_correction=kwargs.get("bias_correction", True),
        trust_clip=kwargs.get("trust_clip", False),
        max_grad_norm=kwargs.get("max_grad_norm"),
    )
    # The cases must exercise what they name (else the comparison proves nothing).
    if case == "trust_clip":
        assert max(reference_lamb(weights, grads, **{**_ref_kwargs(kwargs), "trust_clip": False})[1]) > 1.5
    if case == "max_grad_norm":
        assert min(norms) > kwargs["max_grad_norm"]
    if case == "zero_weights":
        assert all(t == 1.0 for t in trusts[: len(SHAPES)])
    if case == "default":
        assert min(trusts) < 0.9 and max(trusts) > 1.1  # the trust ratio matters here
    # float64 throughout; ours evaluates r in a rearranged but equal form, so only rounding
    # (~1e-16 per op, a few dozen ops over 5 steps) separates the two.
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def _ref_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {
        "lr": kwargs["lr"],
        "betas": kwargs["betas"],
        "eps": kwargs["eps"],
        "weight_decay": [kwargs["weight_decay"]] * len(SHAPES),
        "layer_adaptation": [True] * len(SHAPES),
        "bias_correction": kwargs.get("bias_correction", True),
        "trust_clip": kwargs.get("trust_clip", False),
        "max_grad_norm": kwargs.get("max_grad_norm"),
    }


def test_excluded_group_has_trust_one_and_own_decay(foreach: bool) -> None:
    weights, grads = make_problem(4)
    groups = [
        {"idx": [2, 3]},  # decayed, adapted
        {"idx": [0, 1], "weight_decay": 0.0, "layer_adaptation": False},  # bias / norm style
    ]
    ours = run_lamb(weights, grads, groups, lr=0.01, weight_decay=0.05, foreach=foreach)
    ref, _, _ = reference_lamb(
        weights,
        grads,
        lr=0.01,
        betas=(0.9, 0.999),
        eps=1e-6,
        weight_decay=[0.0, 0.0, 0.05, 0.05],
        layer_adaptation=[False, False, True, True],
        bias_correction=True,
        trust_clip=False,
        max_grad_norm=None,
    )
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_zero_gradient_and_no_decay_leaves_weights() -> None:
    p = nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
    before = p.detach().clone()
    opt = Lamb([p], lr=0.1, weight_decay=0.0)
    p.grad = torch.zeros_like(p)
    opt.step()  # r = 0 -> trust 1 (not nan) and no movement
    torch.testing.assert_close(p.detach(), before, rtol=0, atol=0)


@pytest.mark.parametrize("options", [{}, {"max_grad_norm": 1.0, "trust_clip": True}, {"weight_decay": 0.0}])
@pytest.mark.parametrize("block", [None, 8], ids=["default_blocks", "blocks_of_8"])
def test_foreach_equals_per_tensor(options: dict[str, Any], block: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if block is not None:
        monkeypatch.setattr(foreach_module, "CPU_BLOCK_ELEMENTS", block)
    weights, grads = make_problem(6, dtype=torch.float32, weight_scale=2.0, seed=3)
    groups = [{"idx": [1, 2, 3]}, {"idx": [0], "weight_decay": 0.0, "layer_adaptation": False}]
    a = run_lamb(weights, grads, groups, lr=0.01, foreach=True, **options)
    b = run_lamb(weights, grads, groups, lr=0.01, foreach=False, **options)
    # float32. Both paths run the same elementwise operations in the same order per element;
    # only the norms may be summed in another order (foreach norm kernels, or a chunked
    # tensor's norm from its chunks' norms): a few ulp (~1e-7 relative) on the trust ratio,
    # so ~1e-9 of a weight per step (lr * |r| ~ 1e-2). rtol 1e-6 leaves room for 6 steps;
    # a real difference in the update (a wrong bias correction, a missed decay) is >= 1e-4.
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_channels_last_param_runs_whole_on_the_blocked_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(foreach_module, "CPU_BLOCK_ELEMENTS", 8)
    g = torch.Generator().manual_seed(5)
    weight = torch.randn(4, 3, 3, 3, generator=g).to(memory_format=torch.channels_last)
    grads = [torch.randn(4, 3, 3, 3, generator=g).to(memory_format=torch.channels_last) for _ in range(3)]
    out = []
    for foreach in (True, False):
        p = nn.Parameter(weight.clone(memory_format=torch.channels_last))
        opt = Lamb([p], lr=0.01, foreach=foreach)
        for grad in grads:
            p.grad = grad.clone(memory_format=torch.channels_last)
            opt.step()
        assert p.is_contiguous(memory_format=torch.channels_last)
        out.append(p.detach())
    # not chunked (its flat view is not in logical order), so the same ops on the same tensor
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=0)


def test_bf16_params_keep_bf16_state_and_track_fp32() -> None:
    weights, grads = make_problem(3, dtype=torch.float32)
    ref = run_lamb(weights, grads, lr=0.01)
    for foreach in (False, True):
        params = [nn.Parameter(w.to(torch.bfloat16)) for w in weights]
        opt = Lamb(params, lr=0.01, foreach=foreach)
        for gs in grads:
            for p, g in zip(params, gs, strict=True):
                p.grad = g.to(torch.bfloat16)
            opt.step()
        assert all(opt.state[p]["exp_avg"].dtype == torch.bfloat16 for p in params)
        for p, r in zip(params, ref, strict=True):
            # bf16 keeps 8 bits of mantissa: ~0.4 % per rounding of weights of size ~1-3
            torch.testing.assert_close(p.detach().float(), r, rtol=2e-2, atol=2e-2)


def test_state_dict_round_trip_continues_identically() -> None:
    weights, grads = make_problem(6, dtype=torch.float32)
    params_a = [nn.Parameter(w.clone()) for w in weights]
    opt_a = Lamb(params_a, lr=0.01, trust_clip=True)
    for gs in grads[:3]:
        for p, g in zip(params_a, gs, strict=True):
            p.grad = g.clone()
        opt_a.step()
    saved = copy.deepcopy(opt_a.state_dict())
    params_b = [nn.Parameter(p.detach().clone()) for p in params_a]
    opt_b = Lamb(params_b, lr=0.5)  # hyperparameters come from the state dict
    opt_b.load_state_dict(saved)
    assert opt_b.param_groups[0]["lr"] == 0.01 and opt_b.param_groups[0]["trust_clip"] is True
    for gs in grads[3:]:
        for pa, pb, g in zip(params_a, params_b, gs, strict=True):
            pa.grad, pb.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    for pa, pb in zip(params_a, params_b, strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)  # same ops on the same numbers
    assert float(opt_b.state[params_b[0]]["step"]) == 6.0


def test_old_state_without_new_options_gets_defaults() -> None:
    p = nn.Parameter(torch.randn(3))
    opt = Lamb([p], lr=0.01)
    p.grad = torch.randn(3)
    opt.step()
    old = opt.state_dict()
    for group in old["param_groups"]:
        for key in ("bias_correction", "trust_clip", "layer_adaptation", "foreach", "max_grad_norm"):
            del group[key]
    fresh = Lamb([nn.Parameter(p.detach().clone())], lr=0.01)
    fresh.load_state_dict(old)
    group = fresh.param_groups[0]
    assert (group["bias_correction"], group["trust_clip"], group["layer_adaptation"]) == (True, False, True)
    assert group["foreach"] is None and group["max_grad_norm"] is None
    # a pickled optimizer from before max_grad_norm existed
    state = opt.__getstate__()
    state["defaults"] = {k: v for k, v in state["defaults"].items() if k != "max_grad_norm"}
    unpickled = pickle.loads(pickle.dumps(opt))
    unpickled.__setstate__(state)
    assert unpickled.defaults["max_grad_norm"] is None
    fresh.param_groups[0]["params"][0].grad = torch.randn(3)
    fresh.step()  # and it steps


def test_max_grad_norm_leaves_p_grad_untouched() -> None:
    p = nn.Parameter(torch.randn(4, 4))
    g = torch.randn(4, 4) * 100
    p.grad = g.clone()
    Lamb([p], max_grad_norm=1.0).step()
    torch.testing.assert_close(p.grad, g, rtol=0, atol=0)


def test_closure_loss_is_returned() -> None:
    p = nn.Parameter(torch.ones(2))
    opt = Lamb([p])

    def closure() -> float:
        opt.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return float(loss.detach())

    assert opt.step(closure) == 2.0
    assert p.grad is not None and float(p.detach()[0]) < 1.0


BAD_HYPERPARAMETERS = [
    ({"lr": -1.0}, "Invalid learning rate: -1.0"),
    ({"lr": float("nan")}, "Invalid learning rate: nan"),
    ({"eps": -1e-6}, "Invalid epsilon value: -1e-06"),
    ({"betas": (1.0, 0.999)}, "Invalid beta parameter at index 0: 1.0"),
    ({"betas": (0.9, -0.1)}, "Invalid beta parameter at index 1: -0.1"),
    ({"betas": (0.9,)}, r"Invalid betas: \(0.9,\)"),
    ({"weight_decay": -0.01}, "Invalid weight_decay value: -0.01"),
    ({"max_grad_norm": 0.0}, "Invalid max_grad_norm value: 0.0"),
    ({"max_grad_norm": -1.0}, "Invalid max_grad_norm value: -1.0"),
    ({"trust_clip": "yes"}, "Invalid trust_clip value: 'yes'"),
    ({"foreach": "auto"}, "Invalid foreach value: 'auto'"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_HYPERPARAMETERS)
def test_bad_hyperparameter_raises_naming_it(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Lamb([nn.Parameter(torch.zeros(2))], **kwargs)


def test_bad_group_value_raises_naming_group() -> None:
    good, bad = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match=r"param group 1: Invalid weight_decay value: -1.0"):
        Lamb([{"params": [good]}, {"params": [bad], "weight_decay": -1.0}])
    opt = Lamb([good])
    with pytest.raises(ValueError, match="param group 1: Invalid layer_adaptation value: 0"):
        opt.add_param_group({"params": [bad], "layer_adaptation": 0})
    assert len(opt.param_groups) == 1  # the bad group was not kept


def test_sparse_gradient_is_refused() -> None:
    emb = nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    opt = Lamb(emb.parameters())
    with pytest.raises(RuntimeError, match="Lamb does not support sparse gradients"):
        opt.step()


def test_complex_parameter_is_refused() -> None:
    with pytest.raises(ValueError, match=r"Lamb does not support complex parameters: found a torch.complex64"):
        Lamb([nn.Parameter(torch.zeros(3, dtype=torch.complex64))])


def test_converges_on_digits() -> None:
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    x_np, y_np = sklearn_datasets.load_digits(return_X_y=True)
    x = torch.tensor(x_np, dtype=torch.float32) / 16.0
    y = torch.tensor(y_np)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, test = perm[:1400], perm[1400:]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = Lamb(param_groups(model, 0.01), lr=0.02)
    for _ in range(150):  # full batch: 150 steps ~ 0.3 s
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[train]), y[train])
        loss.backward()
        opt.step()
    with torch.no_grad():
        accuracy = float((model(x[test]).argmax(1) == y[test]).float().mean())
    # chance is 0.10 and the initial loss ln(10) = 2.30; this run reaches loss 0.012, accuracy 0.96
    assert float(loss.detach()) < 0.05, f"train loss {float(loss.detach()):.3f} after 150 steps"
    assert accuracy > 0.93, f"held-out accuracy {accuracy:.3f}"
