"""Lars against the formula of You, Gitman and Ginsburg (2017), written out plainly below."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from optim_cases import SHAPES, make_problem
from torch import nn

import lightning_strategies.optim._foreach as foreach_module
from lightning_strategies.optim import Lars, param_groups


def reference_lars(
    weights: list[torch.Tensor],
    grad_steps: list[list[torch.Tensor]],
    *,
    lr: float,
    momentum: float,
    weight_decay: list[float],
    layer_adaptation: list[bool],
    trust_coefficient: float,
    eps: float,
    nesterov: bool,
    trust_clip: bool,
) -> tuple[list[torch.Tensor], list[float]]:
    """LARS one tensor and one step at a time in float64, torch-SGD momentum on top.

    local = tc ||x|| / (||g|| + wd ||x|| + eps) (1 if a norm is 0), LARC-clipped to min(local / lr, 1)
    with trust_clip; d = local (g + wd x);
    b = d at the first step, else mu b + d; step = d + mu b (nesterov) or b; x -= lr step.
    Returns the final weights and every local lr used.
    """
    xs = [w.clone().double() for w in weights]
    bufs: list[torch.Tensor | None] = [None] * len(xs)
    locals_: list[float] = []
    for grads in grad_steps:
        for i, g in enumerate(grads):
            g = g.double()
            w_norm, g_norm = float(xs[i].norm()), float(g.norm())
            if w_norm > 0 and g_norm > 0:
                local = trust_coefficient * w_norm / (g_norm + weight_decay[i] * w_norm + eps)
            else:
                local = 1.0
            if trust_clip:
                local = min(local / lr, 1.0)  # LARC: effective rate lr x local = min(local, lr)
            if not layer_adaptation[i]:
                local = 1.0
            locals_.append(local)
            d = local * (g + weight_decay[i] * xs[i])
            if momentum == 0:
                xs[i] = xs[i] - lr * d
                continue
            buf = bufs[i]
            buf = d.clone() if buf is None else momentum * buf + d
            bufs[i] = buf
            step = d + momentum * buf if nesterov else buf
            xs[i] = xs[i] - lr * step
    return xs, locals_


def run_lars(
    weights: list[torch.Tensor],
    grad_steps: list[list[torch.Tensor]],
    groups: list[dict[str, Any]] | None = None,
    **kwargs: Any,
) -> list[torch.Tensor]:
    params = [nn.Parameter(w.clone()) for w in weights]
    spec: Any = params
    if groups is not None:
        spec = [{k: v for k, v in g.items() if k != "idx"} | {"params": [params[i] for i in g["idx"]]} for g in groups]
    opt = Lars(spec, **kwargs)
    for grads in grad_steps:
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad.clone()
        opt.step()
    return [p.detach() for p in params]


CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "nesterov": {"nesterov": True},
    "no_momentum": {"momentum": 0.0},
    "no_weight_decay": {"weight_decay": 0.0},
    "trust_clip": {"trust_clip": True, "trust_coefficient": 0.5},
    "zero_weights": {"weight_scale": 0.0},
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_written_out_formula(case: str, foreach: bool) -> None:
    options = dict(CASES[case])
    weight_scale = options.pop("weight_scale", 1.0)
    kwargs: dict[str, Any] = {
        "lr": 0.5,
        "momentum": 0.9,
        "weight_decay": 1e-2,
        "trust_coefficient": 0.02,
        "eps": 1e-8,
        "nesterov": False,
        "trust_clip": False,
    }
    kwargs.update(options)
    weights, grads = make_problem(5, weight_scale=weight_scale)
    ours = run_lars(weights, grads, foreach=foreach, **kwargs)
    ref_kwargs = dict(kwargs, weight_decay=[kwargs["weight_decay"]] * len(SHAPES))
    ref, locals_ = reference_lars(weights, grads, layer_adaptation=[True] * len(SHAPES), **ref_kwargs)
    if case == "trust_clip":  # the clip must bite on some tensors and not on others
        unclipped = reference_lars(
            weights, grads, layer_adaptation=[True] * len(SHAPES), **dict(ref_kwargs, trust_clip=False)
        )[1]
        assert max(unclipped) > kwargs["lr"] > min(unclipped)
    if case == "zero_weights":
        assert all(t == 1.0 for t in locals_[: len(SHAPES)])
    if case == "default":
        assert max(locals_) / min(locals_) > 2  # local lrs differ across tensors and steps
    # float64 throughout, the same formula; only rounding (~1e-16 per op) separates them.
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("nesterov", [False, True])
def test_excluded_group_is_plain_sgd(foreach: bool, nesterov: bool) -> None:
    weights, grads = make_problem(4)
    groups = [{"idx": [2, 3]}, {"idx": [0, 1], "weight_decay": 0.0, "layer_adaptation": False}]
    ours = run_lars(weights, grads, groups, lr=0.1, weight_decay=1e-3, nesterov=nesterov, foreach=foreach)
    ref, _ = reference_lars(
        weights,
        grads,
        lr=0.1,
        momentum=0.9,
        weight_decay=[0.0, 0.0, 1e-3, 1e-3],
        layer_adaptation=[False, False, True, True],
        trust_coefficient=0.001,
        eps=1e-8,
        nesterov=nesterov,
        trust_clip=False,
    )
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    # and the excluded tensors moved exactly as torch's SGD moves them
    sgd_params = [nn.Parameter(w.clone()) for w in weights[:2]]
    sgd = torch.optim.SGD(sgd_params, lr=0.1, momentum=0.9, nesterov=nesterov)
    for gs in grads:
        for p, g in zip(sgd_params, gs[:2], strict=True):
            p.grad = g.clone()
        sgd.step()
    for a, p in zip(ours[:2], sgd_params, strict=True):
        torch.testing.assert_close(a, p.detach(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("options", [{}, {"nesterov": True, "trust_clip": True}, {"momentum": 0.0}])
@pytest.mark.parametrize("block", [None, 8], ids=["default_blocks", "blocks_of_8"])
def test_foreach_equals_per_tensor(options: dict[str, Any], block: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if block is not None:
        monkeypatch.setattr(foreach_module, "CPU_BLOCK_ELEMENTS", block)
    weights, grads = make_problem(6, dtype=torch.float32, seed=3)
    groups = [{"idx": [1, 2, 3]}, {"idx": [0], "weight_decay": 0.0, "layer_adaptation": False}]
    a = run_lars(weights, grads, groups, lr=1.0, trust_coefficient=0.01, foreach=True, **options)
    b = run_lars(weights, grads, groups, lr=1.0, trust_coefficient=0.01, foreach=False, **options)
    # float32. Both paths run the same elementwise operations in the same order per element;
    # only the norms may be summed in another order (foreach norm kernels, or a chunked
    # tensor's norm from its chunks' norms): a few ulp (~1e-7 relative) on the local lr, far
    # below a weight's rtol 1e-6 after 6 steps; a real difference in the update is >= 1e-4.
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_new_parameter_mid_training_gets_a_fresh_buffer() -> None:
    # one group where some tensors have momentum buffers and one does not yet
    weights, grads = make_problem(4)
    results = []
    for foreach in (False, True):
        params = [nn.Parameter(w.clone()) for w in weights]
        opt = Lars(params, lr=0.5, trust_coefficient=0.02, foreach=foreach)
        for k, gs in enumerate(grads):
            for i, (p, g) in enumerate(zip(params, gs, strict=True)):
                p.grad = None if (i == 3 and k < 2) else g.clone()
            opt.step()
        results.append([p.detach() for p in params])
    ref_late, _ = reference_lars(
        weights[3:],
        [gs[3:] for gs in grads[2:]],
        lr=0.5,
        momentum=0.9,
        weight_decay=[1e-4],
        layer_adaptation=[True],
        trust_coefficient=0.02,
        eps=1e-8,
        nesterov=False,
        trust_clip=False,
    )
    for res in results:
        torch.testing.assert_close(res[3], ref_late[0], rtol=1e-12, atol=1e-14)
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_state_dict_round_trip_continues_identically() -> None:
    weights, grads = make_problem(6, dtype=torch.float32)
    params_a = [nn.Parameter(w.clone()) for w in weights]
    opt_a = Lars(params_a, lr=0.3, nesterov=True)
    for gs in grads[:3]:
        for p, g in zip(params_a, gs, strict=True):
            p.grad = g.clone()
        opt_a.step()
    saved = copy.deepcopy(opt_a.state_dict())
    params_b = [nn.Parameter(p.detach().clone()) for p in params_a]
    opt_b = Lars(params_b, lr=1.0)
    opt_b.load_state_dict(saved)
    assert opt_b.param_groups[0]["nesterov"] is True
    for gs in grads[3:]:
        for pa, pb, g in zip(params_a, params_b, gs, strict=True):
            pa.grad, pb.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    for pa, pb in zip(params_a, params_b, strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)  # same ops on the same numbers


def test_old_state_without_new_options_gets_defaults() -> None:
    p = nn.Parameter(torch.randn(3))
    opt = Lars([p], lr=0.1)
    p.grad = torch.randn(3)
    opt.step()
    old = opt.state_dict()
    for group in old["param_groups"]:
        for key in ("trust_coefficient", "eps", "nesterov", "trust_clip", "layer_adaptation", "foreach"):
            del group[key]
    fresh = Lars([nn.Parameter(p.detach().clone())], lr=0.1)
    fresh.load_state_dict(old)
    group = fresh.param_groups[0]
    assert (group["trust_coefficient"], group["eps"], group["nesterov"]) == (0.001, 1e-8, False)
    assert (group["trust_clip"], group["layer_adaptation"], group["foreach"]) == (False, True, None)


BAD_HYPERPARAMETERS = [
    ({"lr": -1.0}, "Invalid learning rate: -1.0"),
    ({"lr": float("nan")}, "Invalid learning rate: nan"),
    ({"momentum": -0.1}, "Invalid momentum value: -0.1"),
    ({"momentum": 1.0}, "Invalid momentum value: 1.0"),
    ({"weight_decay": -1e-4}, "Invalid weight_decay value: -0.0001"),
    ({"trust_coefficient": 0.0}, "Invalid trust_coefficient value: 0.0"),
    ({"eps": -1.0}, "Invalid epsilon value: -1.0"),
    ({"nesterov": True, "momentum": 0.0}, "Invalid nesterov value: True with momentum=0.0"),
    ({"trust_clip": 1}, "Invalid trust_clip value: 1"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_HYPERPARAMETERS)
def test_bad_hyperparameter_raises_naming_it(kwargs: dict[str, Any], message: str) -> None:
    kwargs = {"lr": 0.1} | kwargs
    with pytest.raises(ValueError, match=message):
        Lars([nn.Parameter(torch.zeros(2))], **kwargs)


def test_sparse_gradient_is_refused() -> None:
    emb = nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    opt = Lars(emb.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="Lars does not support sparse gradients"):
        opt.step()


def test_sparse_gradient_in_a_later_group_leaves_every_group_untouched() -> None:
    dense = nn.Parameter(torch.ones(4))
    emb = nn.Embedding(10, 3, sparse=True)
    (dense.sum() + emb(torch.tensor([1, 2])).sum()).backward()
    opt = Lars([{"params": [dense]}, {"params": emb.parameters()}], lr=0.1, momentum=0.9)
    before = dense.detach().clone()
    with pytest.raises(RuntimeError, match="Lars does not support sparse gradients"):
        opt.step()
    assert torch.equal(dense.detach(), before)  # group 0 was not stepped before the refusal
    assert not opt.state  # and no momentum buffer was created


def test_complex_parameter_is_refused() -> None:
    with pytest.raises(ValueError, match=r"Lars does not support complex parameters: found a torch.complex64"):
        Lars([nn.Parameter(torch.zeros(3, dtype=torch.complex64))], lr=0.1)


def test_converges_on_digits() -> None:
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    x_np, y_np = sklearn_datasets.load_digits(return_X_y=True)
    x = torch.tensor(x_np, dtype=torch.float32) / 16.0
    y = torch.tensor(y_np)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, test = perm[:1400], perm[1400:]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = Lars(param_groups(model, 1e-4), lr=0.5, trust_coefficient=0.02)
    for _ in range(150):  # full batch: 150 steps ~ 0.3 s
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[train]), y[train])
        loss.backward()
        opt.step()
    with torch.no_grad():
        accuracy = float((model(x[test]).argmax(1) == y[test]).float().mean())
    # chance is 0.10 and the initial loss ln(10) = 2.30; this run reaches loss 0.004, accuracy 0.97
    assert float(loss.detach()) < 0.05, f"train loss {float(loss.detach()):.3f} after 150 steps"
    assert accuracy > 0.93, f"held-out accuracy {accuracy:.3f}"


@pytest.mark.parametrize("trust_clip", [False, True])
@pytest.mark.parametrize("nesterov", [False, True])
def test_matches_timm_lars(foreach: bool, trust_clip: bool, nesterov: bool) -> None:
    """timm's ``Lars`` (always_adapt=True) is the reference implementation of LARS and LARC."""
    timm_optim = pytest.importorskip("timm.optim")
    weights, grads = make_problem(5)
    kwargs = {"lr": 0.5, "momentum": 0.9, "weight_decay": 1e-2, "eps": 1e-8, "nesterov": nesterov}
    ours = run_lars(weights, grads, foreach=foreach, trust_coefficient=0.5, trust_clip=trust_clip, **kwargs)
    params = [nn.Parameter(w.clone()) for w in weights]
    theirs = timm_optim.Lars(params, trust_coeff=0.5, trust_clip=trust_clip, always_adapt=True, **kwargs)
    for step in grads:
        for p, g in zip(params, step, strict=True):
            p.grad = g.clone()
        theirs.step()
    # float64 in both; the same arithmetic in another order: rounding only (~1e-16 per op)
    for a, b in zip(ours, params, strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=1e-12, atol=1e-14)
