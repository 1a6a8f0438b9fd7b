"""Gradient clipping on the parameter servers: what Lightning does after DDP's all-reduce, done by the
shards on the averaged gradient.

Lightning clips (``Precision.clip_gradients``) after DDP has averaged the gradient: by value, each
element clamped to ``[-c, c]``; by norm, every gradient scaled by ``min(1, c / (norm + 1e-6))``
(``torch.nn.utils.clip_grad_norm_``), the norm taken over the whole model's gradient. A shard holds
a slice of that gradient: clamping is local, but the norm is not. The shards therefore agree on it
(:class:`NormAgreement`): each one sends the squared norm of its slice (one float) to every other
shard and continues its step once all parts are in, from a future's callback, so no RPC thread waits.
The same agreed norm serves an optimizer that clips by the global norm itself
(``Lamb(max_grad_norm=...)``, through its step's ``global_grad_norm``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor
from torch.futures import Future

from lightning_strategies.comm.rpc import ShardError, call_host, completed

__all__ = [
    "CLIP_ALGORITHMS",
    "ClipSpec",
    "NormAgreement",
    "NormSender",
    "ShardClipping",
    "send_in_process",
    "squared_norm",
]

CLIP_ALGORITHMS: tuple[str, ...] = ("norm", "value")

#: ``send(to_shard, from_shard, step, part)``: deliver a squared-norm part; a future of the delivery.
NormSender = Callable[[int, int, int, float], Future[Any]]


@dataclass(frozen=True)
class ClipSpec:
    """What the shards do to the averaged gradient before the optimizer step.

    Attributes:
        clip_val: ``Trainer(gradient_clip_val=...)``; ``None`` or 0: no clipping (as Lightning).
        algorithm: ``Trainer(gradient_clip_algorithm=...)``: ``"norm"`` or ``"value"``.
        optimizer_norm: the optimizer clips by the global gradient norm itself (``Lamb(max_grad_norm=...)``):
            its step gets the agreed norm as ``global_grad_norm``.
    """

    clip_val: float | None = None
    algorithm: str = "norm"
    optimizer_norm: bool = False

    def __post_init__(self) -> None:
        bad_algorithm = self.algorithm not in CLIP_ALGORITHMS
        if bad_algorithm or (self.clip_val is not None and not self.clip_val >= 0):
            raise ValueError(  # the Trainer's names: its options are where the user fixes them
                f"ClipSpec(algorithm={self.algorithm!r}): expected one of {list(CLIP_ALGORITHMS)}, as "
                "Trainer(gradient_clip_algorithm=...) takes. Fix: pass 'norm' or 'value'."
                if bad_algorithm
                else f"ClipSpec(clip_val={self.clip_val}): expected None or a value >= 0 (0: no clipping). "
                "Fix: pass Trainer(gradient_clip_val=...) a non-negative number."
            )

    @property
    def clips(self) -> bool:
        """Whether the Trainer's clipping is on (Lightning skips a value of 0)."""
        return bool(self.clip_val)

    @property
    def needs_norm(self) -> bool:
        """Whether a step needs the global gradient norm (the agreement between shards)."""
        return (self.clips and self.algorithm == "norm") or self.optimizer_norm


def squared_norm(grads: Sequence[Tensor]) -> float:
    """The sum of squares of ``grads`` as a host float (one device sync).

    Each tensor's norm is taken as ``torch.nn.utils.clip_grad_norm_`` does (in its own dtype), the squares
    summed in float64: a shard holding whole tensors contributes exactly their norms.
    """
    if not grads:
        return 0.0
    norms = torch.stack([torch.linalg.vector_norm(g).to(torch.float64) for g in grads])
    return float(norms.square().sum())


@dataclass
class _Round:
    parts: dict[int, float] = field(default_factory=dict)
    future: Future[float | ShardError] | None = None  # set when this shard opens the round
    deadline: float | None = None  # time.monotonic() by which the last part must arrive


class NormAgreement:
    """Shard ``shard_id``'s side of the agreement on the global gradient norm among ``shards``.

    Each step a shard :meth:`open` s a round with its own part (the squared norm of its slice of the
    averaged gradient) and sends it to the other shards; their parts arrive through :meth:`receive`
    (before or after its own open). The round's future then holds ``sqrt(sum of parts)``, the same
    float on every shard, or a :class:`~lightning_strategies.comm.rpc.ShardError` naming the missing
    or failed shards: after ``timeout`` without a part, at once when a part cannot be delivered or the
    agreement is closed. One watchdog thread per agreement keeps the deadlines.

    Futures are completed outside the agreement's lock, never inside :meth:`open` 's sends: the
    caller's continuation (the shard's step) may take locks of its own.

    Args:
        shard_id: this shard.
        shards: every shard taking part (the ones that receive pushes), this one included.
        timeout: how long an open round waits for the last part.
        send: delivers a part to another shard (default: over RPC to the rank of the shard's index,
            which hosts it; :func:`send_in_process` for shards of one process).
    """

    def __init__(
        self,
        shard_id: int,
        shards: Sequence[int],
        *,
        timeout: timedelta = timedelta(minutes=30),
        send: NormSender | None = None,
    ) -> None:
        if shard_id not in shards:
            raise ValueError(
                f"NormAgreement(shard_id={shard_id}, shards={list(shards)}): expected the shard among the "
                "shards that agree. Fix: pass every shard that receives pushes, this one included."
            )
        self.shard_id = shard_id
        self.shards = sorted(set(shards))
        self.timeout = timeout
        self._send = send if send is not None else _send_over_rpc(timeout)
        self._rounds: dict[int, _Round] = {}
        self._cond = threading.Condition()
        self._failure: str | None = None
        self._closed = False
        # one thread for the agreement's life (as the shard's barrier), sleeping until the earliest open deadline
        self._watchdog = threading.Thread(target=self._watch, name=f"ps-shard-{shard_id}-norm-watchdog", daemon=True)
        if self.peers:
            self._watchdog.start()
        _AGREEMENTS[shard_id] = self

    @property
    def peers(self) -> list[int]:
        """The other shards."""
        return [s for s in self.shards if s != self.shard_id]

    def open(self, step: int, part: float) -> Future[float | ShardError]:
        """Add this shard's ``part`` for ``step``, send it to the others; the future of the global norm."""
        fut: Future[float | ShardError] = Future()
        with self._cond:
            if self._failure is not None:
                fut.set_result(ShardError(self._failure))
                return fut
            rnd = self._rounds.setdefault(step, _Round())
            rnd.parts[self.shard_id] = part
            rnd.future = fut
            done = self._take_if_complete(step)
            if done is None and self.peers:
                rnd.deadline = time.monotonic() + self.timeout.total_seconds()
                self._cond.notify_all()
        for peer in self.peers:
            self._deliver(peer, step, part)
        if done is not None:
            fut.set_result(done)
        return fut

    def receive(self, sender: int, step: int, part: float) -> None:
        """Shard ``sender``'s part of ``step`` (an RPC entry point calls this)."""
        with self._cond:
            if self._failure is not None or sender not in self.shards:
                return  # a failed round answered its workers already; a stranger's part is no one's
            rnd = self._rounds.setdefault(step, _Round())
            rnd.parts.setdefault(sender, part)
            done = self._take_if_complete(step)
        if done is not None and rnd.future is not None:
            rnd.future.set_result(done)

    def close(self, reason: str | None = None) -> None:
        """Stop the watchdog; fail open rounds with ``reason`` (the shard is being dropped)."""
        message = (
            f"parameter server shard {self.shard_id} stopped while agreeing on the gradient norm: "
            f"{reason or 'the shard was dropped'}"
        )
        failed = self._fail(message)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if _AGREEMENTS.get(self.shard_id) is self:
            del _AGREEMENTS[self.shard_id]
        _complete(failed, message, timed_out=False)

    # -- inside ---------------------------------------------------------------------------------

    def _take_if_complete(self, step: int) -> float | None:
        """The global norm when ``step``'s round has every part and is open (it is then dropped)."""
        rnd = self._rounds[step]
        if rnd.future is None or len(rnd.parts) < len(self.shards):
            return None
        del self._rounds[step]
        # summed in shard order: every shard adds the same floats in the same order, so all agree bit for bit
        return float(sum(rnd.parts[s] for s in self.shards)) ** 0.5

    def _deliver(self, peer: int, step: int, part: float) -> None:
        try:
            sent = self._send(peer, self.shard_id, step, part)
        except Exception as err:  # the agent is down: as a failed delivery
            sent = Future()
            sent.set_exception(err)
        sent.add_done_callback(lambda f: self._check_delivery(peer, step, f))

    def _check_delivery(self, peer: int, step: int, sent: Future[Any]) -> None:
        try:
            sent.wait()
        except Exception as err:
            message = (
                f"parameter server shard {self.shard_id} could not send its gradient-norm part of step {step} to "
                f"shard {peer} (hosted by rank {peer}): {err}. Shard {peer} died or is unreachable; check the "
                f"logs of rank {peer}."
            )
            _complete(self._fail(message), message, timed_out=False)

    def _fail(self, message: str) -> list[Future[float | ShardError]]:
        """Mark the agreement failed; the futures of open rounds, to complete outside the lock."""
        with self._cond:
            if self._failure is None:
                self._failure = message
            failed = [r.future for r in self._rounds.values() if r.future is not None]
            self._rounds.clear()
            return failed

    def _watch(self) -> None:
        with self._cond:
            while not self._closed:
                due = min(((r.deadline, s) for s, r in self._rounds.items() if r.deadline is not None), default=None)
                if due is None or due[0] > time.monotonic():
                    self._cond.wait(None if due is None else due[0] - time.monotonic())
                    continue
                message = self._missing_parts(due[1])
                self._cond.release()  # _fail takes the lock; the futures are completed outside it
                try:
                    _complete(self._fail(message), message, timed_out=True)
                finally:
                    self._cond.acquire()

    def _missing_parts(self, step: int) -> str:
        """The timeout's error for ``step``'s round (under the lock)."""
        rnd = self._rounds[step]
        missing = [s for s in self.shards if s not in rnd.parts]
        return (
            f"parameter server shard {self.shard_id} waited {self.timeout.total_seconds():.0f}s for the "
            f"gradient-norm parts of step {step} from shard(s) {missing} (hosted by rank(s) {missing}; "
            f"received from {sorted(rnd.parts)}), needed to clip by the global norm. Shard(s) {missing} "
            "died or are stuck (or wait for a worker themselves); check their logs. To wait longer, "
            "raise the strategy's `timeout`."
        )


def _complete(futures: Sequence[Future[float | ShardError]], message: str, *, timed_out: bool) -> None:
    for fut in futures:
        if not fut.done():
            fut.set_result(ShardError(message, timed_out=timed_out))


class ShardClipping:
    """A shard's clipping of its slice of the averaged gradient, Lightning's rules on DDP's gradient.

    Args:
        spec: what to clip.
        shard_id: this shard.
        shards: the shards that receive pushes (they agree on the norm).
        timeout: how long a shard waits for the others' norm parts.
        send: as :class:`NormAgreement` 's.
    """

    def __init__(
        self,
        spec: ClipSpec,
        shard_id: int,
        shards: Sequence[int],
        *,
        timeout: timedelta = timedelta(minutes=30),
        send: NormSender | None = None,
    ) -> None:
        self.spec = spec
        self.agreement = NormAgreement(shard_id, shards, timeout=timeout, send=send) if spec.needs_norm else None

    def start(self, step: int, params: Sequence[Tensor]) -> Future[float | ShardError | None]:
        """Clamp the gradients of ``params`` by value (a local rule), then open the norm's agreement.

        Returns:
            The global norm of the (clamped) gradient once agreed, or ``None`` at once when no norm is needed.
        """
        grads = [p.grad for p in params if p.grad is not None]
        if self.spec.clips and self.spec.algorithm == "value":
            torch.nn.utils.clip_grad_value_(params, clip_value=float(self.spec.clip_val or 0.0))
        if self.agreement is None:
            return completed(None)
        return self.agreement.open(step, squared_norm(grads))  # type: ignore[return-value]

    def finish(self, params: Sequence[Tensor], norm: float | None) -> dict[str, Any]:
        """Scale by the norm rule; the keywords the optimizer's step takes (``global_grad_norm``).

        Args:
            norm: the agreed global norm (``None`` when no norm was needed).
        """
        if norm is None:
            return {}
        grads = [p.grad for p in params if p.grad is not None]
        device, dtype = (grads[0].device, grads[0].dtype) if grads else (torch.device("cpu"), torch.float32)
        total = torch.tensor(norm, dtype=dtype, device=device)
        if self.spec.clips and self.spec.algorithm == "norm":
            clip_val = float(self.spec.clip_val or 0.0)
            # torch.nn.utils.clip_grad_norm_'s rule, given the norm: g * min(1, clip / (norm + 1e-6))
            torch.nn.utils.clip_grads_with_norm_(params, clip_val, total)
            total = total * torch.clamp(clip_val / (total + 1e-6), max=1.0)  # the clipped gradient's norm
        return {"global_grad_norm": total} if self.spec.optimizer_norm else {}

    def close(self, reason: str | None = None) -> None:
        """Fail an open agreement with ``reason`` and stop its thread."""
        if self.agreement is not None:
            self.agreement.close(reason)


# -- what this process hosts: the RPC entry point finds the agreement here --------------------

_AGREEMENTS: dict[int, NormAgreement] = {}


def _rpc_norm_part(shard_id: int, sender: int, step: int, part: float) -> None:
    agreement = _AGREEMENTS.get(shard_id)
    if agreement is None:
        raise RuntimeError(
            f"parameter server shard {shard_id} takes no gradient-norm parts here (it is not hosted or was "
            "dropped); the sharding plans of the workers disagree, or its host failed"
        )
    agreement.receive(sender, step, part)


def _send_over_rpc(timeout: timedelta) -> NormSender:
    # rank r hosts shard r, so a peer shard is always another process
    rpc_timeout = timeout.total_seconds() + max(5.0, 0.1 * timeout.total_seconds())

    def send(to: int, sender: int, step: int, part: float) -> Future[Any]:
        return call_host(to, _rpc_norm_part, to, sender, step, part, local=False, timeout=rpc_timeout)

    return send


def send_in_process(to: int, sender: int, step: int, part: float) -> Future[Any]:
    """A :data:`NormSender` for shards of one process (tests): delivered on a thread of its own, as RPC
    delivers, since the sender may hold its shard's lock."""
    fut: Future[Any] = Future()

    def deliver() -> None:
        try:
            _rpc_norm_part(to, sender, step, part)
            fut.set_result(None)
        except Exception as err:
            fut.set_exception(err)

    threading.Thread(target=deliver, name=f"ps-norm-part-{sender}-to-{to}", daemon=True).start()
    return fut
