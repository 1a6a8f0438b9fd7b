"""What the advisor measures of a module on one example batch: bytes per tensor, per block, and time.

Blocks are the module's ``pipeline_layers()`` (:class:`~lightning_strategies.PipelineModule`), run
one after the other on a detached copy of the previous block's output, so each block's forward and
backward are timed alone; a module without them is one block, run through ``training_step``. A block's
time is not proportional to its rows: a small matmul reads its whole weight whatever the rows, and every
call has its fixed cost. So blocks are timed twice, on the batch and on a quarter of it (in turn, repeat
by repeat, so both see the same moments of a shared machine), and a
micro-batch's time comes from the line through both (:meth:`Measurement.block_seconds`): scaled down
in proportion, a pipeline's micro-batches would look several times cheaper than they run
(``benchmarks/results/pipeline_cpu.txt``).
Activation bytes are what autograd saves for the backward pass (parameters excluded), counted once
per storage; the bytes saved between a column- and a row-parallel layer of the tensor plan
(:func:`~lightning_strategies.comm.tensor.auto_plan`) are split by the tensor-parallel group.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_strategies.comm.tensor import auto_plan

__all__ = ["Block", "Measurement", "TensorBytes", "measure"]

OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


@dataclass(frozen=True)
class TensorBytes:
    """One trainable tensor: its bytes, its gradient's and its optimizer state's."""

    name: str
    param: int
    grad: int
    state: int


@dataclass(frozen=True)
class Block:
    """One block at the measured batch.

    Attributes:
        param_bytes: its parameters' bytes (trainable or not).
        output_bytes: its output, the activation a pipeline sends at a boundary after it.
        saved_bytes: what autograd holds for its backward pass.
        split_saved_bytes: the part of ``saved_bytes`` the tensor plan splits.
        forward_s, backward_s: seconds, alone (the stated throughput's when ``tflops`` was given).
        flops: forward + backward, counted.
        forward_fixed_s, backward_fixed_s: the part of ``forward_s`` / ``backward_s`` that does not
            shrink with the rows (from the times at the batch and at a quarter of it; 0 from FLOPs).
    """

    name: str
    param_bytes: int
    output_bytes: int
    saved_bytes: int
    split_saved_bytes: int
    forward_s: float
    backward_s: float
    flops: float
    forward_fixed_s: float = 0.0
    backward_fixed_s: float = 0.0


@dataclass(frozen=True)
class Measurement:
    """A module at one batch: what each strategy's prediction starts from.

    Attributes:
        batch_size: samples of the measured batch.
        tensors: trainable tensors, in ``named_parameters`` order.
        buffer_bytes: the module's buffers (replicated by every strategy).
        blocks: the pipeline blocks (one block for a module without ``pipeline_layers``).
        pipeline: whether the blocks are the module's ``pipeline_layers()``.
        optimizer: the optimizer's class name.
        tensor_payloads: bytes of each activation collective of a tensor-parallel step (forward and
            backward), at the measured batch.
        tensor_split_param_bytes: parameter bytes of the layers the tensor plan splits.
        tensor_split_flops: their forward + backward FLOPs at the measured batch.
        tensor_split_gcd: the greatest common divisor of their split dimensions (0: no plan).
        timed_on: where the times come from.
        tensor_split_layers: the layers the tensor plan splits (each adds DTensor's host work per step).
        tensor_replicated_bytes: parameter bytes the plan leaves whole on every rank of a group (the
            unsplit layers, a row-split layer's bias): their gradients are all-reduced over every
            process each step.
        optimizer_s: seconds of one ``optimizer.step()`` over every trainable tensor, timed here (at lr 0: the
            weights stay as they are); 0 when the times come from a stated throughput.
    """

    batch_size: int
    tensors: tuple[TensorBytes, ...]
    buffer_bytes: int
    blocks: tuple[Block, ...]
    pipeline: bool
    optimizer: str
    tensor_payloads: tuple[float, ...]
    tensor_split_param_bytes: int
    tensor_split_flops: float
    tensor_split_gcd: int
    timed_on: str
    tensor_split_layers: int = 0
    tensor_replicated_bytes: int = 0
    optimizer_s: float = 0.0

    @property
    def param_bytes(self) -> int:
        return sum(t.param for t in self.tensors)

    @property
    def grad_bytes(self) -> int:
        return sum(t.grad for t in self.tensors)

    @property
    def optimizer_bytes(self) -> int:
        return sum(t.state for t in self.tensors)

    @property
    def step_s(self) -> float:
        return sum(b.forward_s + b.backward_s for b in self.blocks)

    def block_seconds(self, index: int, rows: float) -> tuple[float, float]:
        """Forward and backward seconds of block ``index`` on ``rows`` samples: its fixed part plus the rest
        in proportion to the rows (``rows = batch_size`` gives the measured times)."""
        b = self.blocks[index]
        share = rows / self.batch_size

        def at(total: float, fixed: float) -> float:
            fixed = min(fixed, total)
            return fixed + (total - fixed) * share

        return at(b.forward_s, b.forward_fixed_s), at(b.backward_s, b.backward_fixed_s)

    @property
    def saved_bytes(self) -> int:
        return sum(b.saved_bytes for b in self.blocks)

    @property
    def flops(self) -> float:
        return sum(b.flops for b in self.blocks)

    @property
    def tensor_split_share(self) -> float:
        """The share of the compute in the layers the tensor plan splits."""
        return min(1.0, self.tensor_split_flops / self.flops) if self.flops else 0.0


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, Tensor) else 0


def _out_bytes(out: Any) -> int:
    if isinstance(out, Tensor):
        return _nbytes(out)
    if isinstance(out, tuple | list):
        return sum(_out_bytes(o) for o in out)
    return 0


class _Saved:
    """While ``counting``: the bytes autograd saves (once per storage, parameters left out), the
    tensor plan's collectives and the FLOPs of its split layers."""

    def __init__(self, params: set[int]) -> None:
        self.params, self.seen = params, set[int]()
        self.total = self.split = 0
        self.splitting = self.active = False
        self.payloads: list[float] = []
        self.split_flops = 0.0

    def pack(self, t: Tensor) -> Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.params and ptr not in self.seen:
            self.seen.add(ptr)
            self.total += t.untyped_storage().nbytes()
            self.split += t.untyped_storage().nbytes() if self.splitting else 0
        return t

    @contextmanager
    def counting(self) -> Iterator[None]:
        self.total = self.split = 0
        self.seen.clear()
        self.active = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
                yield
        finally:
            self.active = False

    def planned(self, style: str, layer: nn.Linear, x: Tensor, out: Tensor) -> None:
        if not self.active:
            return
        if style != "rowwise" and x.requires_grad:
            self.payloads.append(_nbytes(x))  # the input gradient's all-reduce, backward
        if style == "rowwise":
            self.payloads.append(_nbytes(out))  # the partial outputs' all-reduce, forward
        if style == "colwise_gather":
            self.payloads.append(_nbytes(out) / 2)  # an all-gather moves half an all-reduce's bytes
        self.split_flops += 6.0 * x.numel() * layer.out_features  # 2 x rows x in x out, forward and backward
        self.splitting = style == "colwise"


def _plan_hooks(module: nn.Module, saved: _Saved) -> list[Any]:
    modules = dict(module.named_modules())
    handles = []
    for name, style in auto_plan(module).items():

        def post(mod: nn.Module, args: Any, out: Tensor, style: str = style) -> None:
            saved.planned(style, mod, args[0], out)  # type: ignore[arg-type]

        handles.append(modules[name].register_forward_hook(post))
    return handles


def _loss(module: Any, out: Tensor, batch: Any) -> Tensor:
    targets = batch[1] if isinstance(batch, tuple | list) and len(batch) > 1 else None
    return module.pipeline_loss(out, targets)


def _step_loss(module: Any, batch: Any) -> Tensor:
    out = module.training_step(batch, 0)
    return out["loss"] if isinstance(out, dict) else out


def _time(fn: Callable[[], Any], repeats: int) -> float:
    return _time_each([fn], repeats)[0]


def _time_each(fns: list[Callable[[], Any]], repeats: int) -> list[float]:
    """The median seconds of each call, the calls taken in turn ``repeats`` times: each one's repeats spread
    over the same window as the others', so on a shared machine whose speed moves within seconds their
    ratio holds when each alone would wander (a block's quarter batch and its batch, timed one after the
    other, saw two different CPUs: the line through them, a micro-batch's time, moved with them)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, seconds in zip(fns, times, strict=True):
            _sync()
            start = time.perf_counter()
            fn()
            _sync()
            seconds.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def _sync() -> None:
    """Wait for the GPU's queued work where this process uses CUDA: a call on a CUDA module returns once its
    kernels are queued, and the time is the kernels' (a measurement, not a training step: one sync per call)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _optimizer_state(
    module: nn.Module, optimizer: torch.optim.Optimizer, names: dict[int, str], repeats: int
) -> tuple[dict[str, int], float]:
    """Bytes of state per tensor after one step at lr 0 (the weights stay as they are), and the median seconds of
    ``repeats`` more steps (the first one creates the state; 0: not timed)."""
    lrs = [g.get("lr") for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        if "lr" in g:
            g["lr"] = 0.0 if not isinstance(g["lr"], Tensor) else torch.zeros_like(g["lr"])
    for p in module.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    out = {names[id(p)]: sum(_nbytes(v) for v in s.values()) for p, s in optimizer.state.items() if id(p) in names}
    seconds = _time(optimizer.step, repeats) if repeats > 0 else 0.0
    for g, lr in zip(optimizer.param_groups, lrs, strict=True):
        if lr is not None:
            g["lr"] = lr
    optimizer.state.clear()
    return out, seconds


def _first_optimizer(configured: Any) -> torch.optim.Optimizer:
    """The first optimizer of what ``configure_optimizers`` may return."""
    if isinstance(configured, torch.optim.Optimizer):
        return configured
    if isinstance(configured, dict):
        return _first_optimizer(configured["optimizer"])
    if isinstance(configured, list | tuple) and configured:
        return _first_optimizer(configured[0])
    raise ValueError(
        f"configure_optimizers returned {type(configured).__name__}: expected an optimizer, a dict "
        "with 'optimizer' or a list of them. Fix: pass measure(..., optimizer=factory)"
    )


def measure(
    module: nn.Module,
    batch: Any,
    *,
    optimizer: OptimizerFactory | None = None,
    tflops: float | None = None,
    device: str = "",
    repeats: int = 3,
) -> Measurement:
    """Measure ``module`` on ``batch`` (``(inputs, targets)`` for a pipeline module).

    The module is measured on a copy: its weights, buffers and gradients are left as they were.

    Args:
        module: a LightningModule (or any module with ``training_step``).
        batch: one training batch at the per-device batch size.
        optimizer: builds the optimizer from the parameters; default the module's
            ``configure_optimizers()``.
        tflops: a device's sustained throughput: block times are counted FLOPs over it instead
            of timed here.
        device: the name of that device (for the report).
        repeats: timed runs per block and of the optimizer step (the median is kept).
    """
    module = copy.deepcopy(module)
    module.train()
    lit: Any = module
    names = {id(p): n for n, p in module.named_parameters() if p.requires_grad}
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    opt = optimizer(module.parameters()) if optimizer is not None else _first_optimizer(lit.configure_optimizers())
    pipeline = callable(getattr(module, "pipeline_layers", None)) and callable(getattr(module, "pipeline_loss", None))
    inputs = batch[0] if isinstance(batch, tuple | list) else batch
    size = len(inputs) if isinstance(inputs, Tensor) else 1
    blocks: list[Block] = []
    saved = _Saved(params)
    hooks = _plan_hooks(module, saved)
    try:
        if pipeline:
            blocks = _measure_blocks(module, batch, saved, tflops, repeats)
        else:
            blocks = [_measure_whole(module, batch, saved, tflops, repeats)]
    finally:
        for h in hooks:
            h.remove()
    # the optimizer's step is timed here only (no FLOP count stands for it: it reads and writes memory)
    state, optimizer_s = _optimizer_state(module, opt, names, 0 if tflops else repeats)
    tensors = tuple(
        TensorBytes(n, _nbytes(p), _nbytes(p), state.get(n, 0)) for n, p in module.named_parameters() if p.requires_grad
    )
    plan = auto_plan(module)
    modules = dict(module.named_modules())
    split = sum(_nbytes(p) for n in plan for p in modules[n].parameters())
    # a row-split layer keeps its bias whole (RowwiseParallel); the other planned layers shard every parameter
    whole = sum(_nbytes(modules[n].bias) for n, st in plan.items() if st == "rowwise" and modules[n].bias is not None)
    dims = [getattr(modules[n], "in_features" if st == "rowwise" else "out_features") for n, st in plan.items()]
    timed_on = f"{device or 'device'} at {tflops:g} TFLOPS (counted FLOPs)" if tflops else "this machine, timed"
    return Measurement(
        batch_size=size,
        tensors=tensors,
        buffer_bytes=sum(_nbytes(b) for b in module.buffers()),
        blocks=tuple(blocks),
        pipeline=pipeline,
        optimizer=type(opt).__name__,
        tensor_payloads=tuple(saved.payloads),
        tensor_split_param_bytes=split,
        tensor_split_flops=saved.split_flops,
        tensor_split_gcd=math.gcd(*dims) if dims else 0,
        timed_on=timed_on,
        tensor_split_layers=len(plan),
        tensor_replicated_bytes=max(0, sum(t.param for t in tensors) - split + whole),
        optimizer_s=optimizer_s,
    )


def _flops(fn: Callable[[], Any]) -> float:
    with FlopCounterMode(display=False) as counter:
        fn()
    return float(counter.get_total_flops())


def _head(batch: Any, rows: int) -> Any:
    """The first ``rows`` samples of a ``(inputs, targets, ...)`` batch (tensors sliced on their first dim)."""
    size = len(batch[0])
    return type(batch)(t[:rows] if isinstance(t, Tensor) and t.dim() and len(t) == size else t for t in batch)


def _block_runs(
    module: Any, batch: Any, saved: _Saved | None = None
) -> Iterator[tuple[int, Callable[[], None], Callable[[], None], Tensor, tuple[int, int]]]:
    """Each block, last first: its forward and backward on ``batch`` as calls, its output and (when ``saved``
    counts) the bytes it saves and of those the split ones. Each backward uses the gradient of the block after it."""
    layers: nn.Sequential = module.pipeline_layers()
    x: Any = batch[0]
    leaves, outs = [], []
    for i, layer in enumerate(layers):  # one run: outputs (and, counted, saved bytes and the plan's collectives)
        leaf = x.detach().requires_grad_(i > 0 and x.is_floating_point())  # no gradient for the data
        if saved is not None:
            with saved.counting():
                out = layer(leaf)
            outs.append((out, (saved.total, saved.split)))
        else:
            out = layer(leaf)
            outs.append((out, (0, 0)))
        leaves.append(leaf)
        x = out
    loss = _loss(module, outs[-1][0], batch)
    grads: list[Any] = [None] * len(outs)
    grads[-1] = torch.autograd.grad(loss, outs[-1][0], retain_graph=True)[0]
    for i in reversed(range(len(layers))):
        layer, leaf, (out, counted) = layers[i], leaves[i], outs[i]

        def fwd(layer: nn.Module = layer, leaf: Tensor = leaf) -> None:
            layer(leaf)

        def bwd(out: Tensor = out, i: int = i) -> None:
            if out.requires_grad:  # a block before the first weight (a pooling of the data) has no backward
                torch.autograd.backward(out, grads[i], retain_graph=True)

        if i > 0 and out.requires_grad:
            grads[i - 1] = torch.autograd.grad(out, leaf, grads[i], retain_graph=True)[0]
        yield i, fwd, bwd, out, counted


def _fixed(rows: int, seconds: float, small_rows: int, small_seconds: float) -> float:
    """The intercept at 0 rows of the line through (small_rows, small_seconds) and (rows, seconds), within
    [0, seconds]: a block timed slower on fewer rows (noise) is all fixed, one faster in proportion none."""
    slope = (seconds - small_seconds) / (rows - small_rows)
    return min(seconds, max(0.0, seconds - slope * rows))


def _measure_blocks(module: Any, batch: Any, saved: _Saved, tflops: float | None, repeats: int) -> list[Block]:
    layers: nn.Sequential = module.pipeline_layers()
    size = len(batch[0])
    small = max(1, size // 4)
    # the quarter batch's runs in step with the batch's, block by block, each pair timed in turn
    quarter = _block_runs(module, _head(batch, small)) if not tflops and small < size else None
    blocks = []
    for i, fwd, bwd, out, (nsaved, nsplit) in _block_runs(module, batch, saved):
        fwd_flops, bwd_flops = _flops(fwd), _flops(bwd)
        f_fixed, b_fixed = 0.0, 0.0
        if tflops:
            f_s, b_s = fwd_flops / (tflops * 1e12), bwd_flops / (tflops * 1e12)
        elif quarter is None:
            f_s, b_s = _time(fwd, repeats), _time(bwd, repeats)
        else:
            j, small_fwd, small_bwd, _out, _ = next(quarter)
            assert j == i, f"the quarter batch's block {j} against the batch's {i}"
            f_s, small_f = _time_each([fwd, small_fwd], repeats)
            b_s, small_b = _time_each([bwd, small_bwd], repeats)
            f_fixed, b_fixed = _fixed(size, f_s, small, small_f), _fixed(size, b_s, small, small_b)
        layer = layers[i]
        blocks.append(
            Block(
                f"{i}:{type(layer).__name__}",
                sum(_nbytes(p) for p in layer.parameters()),
                _out_bytes(out),
                nsaved,
                nsplit,
                f_s,
                b_s,
                fwd_flops + bwd_flops,
                f_fixed,
                b_fixed,
            )
        )
    for p in module.parameters():
        p.grad = None
    return blocks[::-1]


def _measure_whole(module: Any, batch: Any, saved: _Saved, tflops: float | None, repeats: int) -> Block:
    with saved.counting():
        loss = _step_loss(module, batch)
    nsaved, nsplit = saved.total, saved.split
    flops = _flops(lambda: _step_loss(module, batch).backward())
    if tflops:
        f_s, b_s = flops / 3 / (tflops * 1e12), 2 * flops / 3 / (tflops * 1e12)
    else:
        f_s = _time(lambda: _step_loss(module, batch), repeats)
        b_s = max(0.0, _time(lambda: _step_loss(module, batch).backward(), repeats) - f_s)
    del loss
    for p in module.parameters():
        p.grad = None
    return Block("model", sum(_nbytes(p) for p in module.parameters()), 0, nsaved, nsplit, f_s, b_s, flops)
