"""LocalSGD and (Streaming) DiLoCo's outer loop over plain tensors.

Every replica takes ``sync_every`` (H) inner optimizer steps on its own data; then the replicas
average, in one all-reduce:

- **LocalSGD** (Lin et al., 2018, arXiv 1808.07217): the parameters themselves;
- **DiLoCo** (Douillard et al., 2023, arXiv 2311.08105): the pseudo-gradients
  ``Δ_i = θ_global - θ_i``, and an outer optimizer (Nesterov SGD, lr 0.7, momentum 0.9 by default)
  steps the global parameters with their mean, which every replica then trains from;
- **Streaming DiLoCo** (Douillard et al., 2025, arXiv 2501.18512): the parameters in ``fragments``
  groups, synchronised in turn, one every H / fragments steps, so each fragment is still averaged
  every H steps while a sync moves 1/fragments of the model; with ``fragment_sync_delay`` (the
  paper's tau) a fragment's all-reduce starts tau inner steps before its outer step is applied, so
  that it overlaps with those inner steps, and the fragment then mixes the new global parameters
  with the local ones (``fragment_update_alpha``, as torchft's ``DiLoCo``).

The all-reduce itself is the caller's (:class:`~lightning_strategies.comm.ft.streaming.OuterSync`);
this module keeps the global copy, builds what is averaged and applies the mean.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from lightning_strategies.comm.ft.buffers import floating_buffers

__all__ = ["ALGORITHMS", "OuterLoop", "check_sync_delay", "split_fragments"]

ALGORITHMS = ("local_sgd", "diloco")


def split_fragments(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """Parameter indices in ``fragments`` consecutive groups of about equal element counts.

    Raises:
        ValueError: no parameters, or more fragments than parameters.
    """
    if not sizes:
        raise ValueError(
            "found a model without parameters: expected at least one trainable parameter, since LocalSGD and "
            "DiLoCo average parameters. Fix: give the LightningModule parameters with requires_grad=True."
        )
    if not 1 <= fragments <= len(sizes):
        raise ValueError(
            f"fragments={fragments} for a model of {len(sizes)} parameter tensors: expected 1 <= fragments <= "
            f"{len(sizes)}, since a fragment holds whole tensors. Fix: pass fragments <= {len(sizes)}."
        )
    n, total = len(sizes), sum(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    cuts = [0]
    for f in range(1, fragments):
        # the first tensor past f/fragments of the elements, leaving every group at least one tensor
        j = next(j for j in range(n + 1) if prefix[j] * fragments >= total * f)
        cuts.append(min(max(j, cuts[-1] + 1), n - (fragments - f)))
    cuts.append(n)
    return [list(range(cuts[f], cuts[f + 1])) for f in range(fragments)]


def check_sync_delay(delay: int, alpha: float, *, algorithm: str, sync_every: int, fragments: int) -> None:
    """Check Streaming DiLoCo's overlap options (tau and the merge weight) against the schedule.

    Raises:
        ValueError: ``delay`` not an integer in ``[0, sync_every / fragments)``, a delay with an
            algorithm other than DiLoCo, or ``alpha`` outside [0, 1].
    """
    if delay and not isinstance(delay, bool) and algorithm != "diloco":
        raise ValueError(
            f"fragment_sync_delay={delay!r} with algorithm={algorithm!r}: expected 0, since the overlapped sync is "
            "Streaming DiLoCo's (an outer step on pseudo-gradients). Fix: use algorithm='diloco' or drop the delay."
        )
    interval = max(1, sync_every // max(1, fragments))
    if isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay < interval:
        raise ValueError(
            f"fragment_sync_delay={delay!r} with sync_every={sync_every}, fragments={fragments}: expected an integer "
            f"0 <= delay < sync_every / fragments = {interval}, since a fragment's all-reduce must land before the "
            f"next fragment's starts. Fix: pass fragment_sync_delay between 0 (blocking) and {interval - 1}."
        )
    if not (isinstance(alpha, int | float) and 0.0 <= alpha <= 1.0):
        raise ValueError(
            f"fragment_update_alpha={alpha!r}: expected a weight in [0, 1] of the local parameters against the new "
            "global ones after an overlapped sync. Fix: pass 0.0 (torchft's default: take the global ones) or 0.5."
        )


class OuterLoop:
    """The global parameters and the outer optimizer of LocalSGD / DiLoCo for ``params``.

    Args:
        params: the model's parameters, trained in place by the inner optimizer.
        algorithm: ``"local_sgd"`` or ``"diloco"``.
        sync_every: H, the inner steps between two syncs of each fragment.
        fragments: parameter groups synced in turn (Streaming DiLoCo); H must be a multiple.
        outer_lr, outer_momentum, nesterov: DiLoCo's outer SGD (one per fragment).
        pseudo_grad_dtype: DiLoCo's all-reduce dtype (``torch.bfloat16`` halves its bytes).
        fragment_sync_delay: tau, inner steps between the start of a fragment's all-reduce and
            its outer step (DiLoCo only; ``0 <= tau < sync_every / fragments``, 0: blocking).
        fragment_update_alpha: after a delayed outer step, the weight of the local parameters
            (trained tau steps past the pseudo-gradient) against the new global ones (0: global).
        buffers: the model's buffers to average at every sync of the last fragment (once per H
            steps), in the same all-reduce: BatchNorm's running statistics
            (:mod:`~lightning_strategies.comm.ft.buffers`). Only the floating-point ones are
            averaged (the values themselves, under DiLoCo too); integer counters are left alone.
            Empty: each replica keeps its own (torchft's behaviour).

    Raises:
        ValueError: ``sync_every < 1``, ``outer_lr <= 0``, momentum outside [0, 1), no parameters,
            more fragments than parameter tensors, H not a multiple of ``fragments``, a delay
            outside ``[0, H / fragments)`` or with LocalSGD, or an alpha outside [0, 1].
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        *,
        algorithm: str = "diloco",
        sync_every: int,
        fragments: int = 1,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        pseudo_grad_dtype: torch.dtype | None = None,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        buffers: Sequence[torch.Tensor] = (),
    ) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm={algorithm!r}: expected one of {ALGORITHMS}. Fix: pick one of them.")
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(
                f"sync_every={sync_every!r}: expected an integer >= 1 (the inner steps between two syncs). "
                "Fix: pass e.g. sync_every=100 (the DiLoCo paper uses 500); sync_every=1 syncs every step."
            )
        if not (math.isfinite(outer_lr) and outer_lr > 0):
            raise ValueError(
                f"outer_lr={outer_lr!r}: expected a learning rate > 0 for the outer optimizer. "
                "Fix: pass outer_lr=0.7 (the DiLoCo paper's), or use algorithm='local_sgd' for plain averaging."
            )
        if not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum={outer_momentum!r}: expected 0 <= momentum < 1. Fix: pass 0.9.")
        self.params = list(params)
        self.groups = split_fragments([p.numel() for p in self.params], fragments)
        if sync_every % fragments:
            raise ValueError(
                f"sync_every={sync_every} with fragments={fragments}: expected a multiple of fragments, since one "
                f"fragment syncs every sync_every / fragments steps. Fix: pass sync_every="
                f"{fragments * max(1, round(sync_every / fragments))}."
            )
        check_sync_delay(fragment_sync_delay, fragment_update_alpha, algorithm=algorithm,
                         sync_every=sync_every, fragments=fragments)  # fmt: skip
        self.delay, self.alpha = fragment_sync_delay, fragment_update_alpha
        self.algorithm = algorithm
        self.sync_every = sync_every
        self.fragments = fragments
        self.pseudo_grad_dtype = pseudo_grad_dtype
        self.syncs = 0  # committed syncs (all fragments)
        self.buffers = floating_buffers(buffers)
        # the global parameters: where every replica started its inner steps
        self.backup = [p.detach().clone() for p in self.params]
        self.outer: list[torch.optim.SGD] = []
        if algorithm == "diloco":
            for group in self.groups:
                tensors = [self.backup[i] for i in group]
                for t in tensors:
                    t.requires_grad_(True)
                nesterov_on = nesterov and outer_momentum > 0  # torch refuses Nesterov without momentum
                self.outer.append(torch.optim.SGD(tensors, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov_on))

    @property
    def interval(self) -> int:
        """Inner steps between two consecutive syncs (of any fragment)."""
        return self.sync_every // self.fragments

    def due(self, step: int) -> int | None:
        """The fragment to sync before inner step ``step`` (after ``step`` inner steps), else ``None``."""
        if step <= 0 or step % self.interval:
            return None
        return (step // self.interval - 1) % self.fragments

    def starts(self, step: int) -> int | None:
        """The fragment whose all-reduce starts before inner step ``step``, else ``None``: the one
        due ``delay`` steps later (with no delay, the one :meth:`due` now)."""
        return self.due(step + self.delay)

    def synced_buffers(self, fragment: int) -> list[torch.Tensor]:
        """The buffers averaged with ``fragment``: all of them with the last fragment, else none."""
        return self.buffers if fragment == self.fragments - 1 else []

    def tensors(self, fragment: int) -> list[torch.Tensor]:
        """What the replicas average for ``fragment``: its parameters (LocalSGD) or its
        pseudo-gradients ``θ_global - θ_local`` (DiLoCo), then the buffers synced with it."""
        group = self.groups[fragment]
        buffers = [b.detach() for b in self.synced_buffers(fragment)]
        with torch.no_grad():
            if self.algorithm == "local_sgd":
                values = [self.params[i].detach() for i in group]
            else:
                values = [self.backup[i].detach() - self.params[i].detach() for i in group]
        return values + buffers

    @torch.no_grad()
    def apply(self, fragment: int, averaged: torch.Tensor, *, mix: bool = False) -> None:
        """Apply the all-reduced mean ``averaged`` (flat, in the order of :meth:`tensors`).

        ``mix``: the mean was taken ``delay`` inner steps ago (an overlapped sync): DiLoCo's
        parameters become ``lerp(θ_global, θ_local, alpha)`` rather than ``θ_global``.
        """
        group = self.groups[fragment]
        offset = 0
        for i in group:
            p, n = self.params[i], self.params[i].numel()
            mean = averaged[offset : offset + n].view_as(p).to(p.dtype)
            offset += n
            if self.algorithm == "local_sgd":
                p.copy_(mean)  # θ ← mean_i θ_i
                self.backup[i].copy_(mean)
            else:
                self.backup[i].grad = mean.clone()  # the outer gradient: mean_i (θ_global - θ_i)
        for b in self.synced_buffers(fragment):  # BN statistics: their mean over the replicas
            n = b.numel()
            mean = averaged[offset : offset + n].view_as(b).to(b.dtype)
            offset += n
            b.copy_(b.lerp(mean, 1.0 - self.alpha) if mix and self.alpha else mean)
        if self.algorithm == "diloco":
            opt = self.outer[fragment]
            opt.step()  # Nesterov SGD on θ_global: v ← μv + Δ; θ_global ← θ_global - lr (Δ + μv)
            opt.zero_grad(set_to_none=True)
            for i in group:
                if mix and self.alpha:  # Streaming DiLoCo's merge: θ ← (1 - α) θ_global + α θ_local
                    self.params[i].copy_(self.backup[i].detach().lerp(self.params[i].detach(), self.alpha))
                else:
                    self.params[i].copy_(self.backup[i])  # every replica's next inner steps start from θ_global
        self.syncs += 1

    @torch.no_grad()
    def restore(self, fragment: int) -> None:
        """Put ``fragment``'s parameters back to the global copy (a sync that did not commit)."""
        for i in self.groups[fragment]:
            self.params[i].copy_(self.backup[i])

    def state_dict(self) -> dict[str, Any]:
        """The global parameters, the outer optimizers' state and the sync count."""
        return {
            "backup": [b.detach().clone() for b in self.backup],
            "outer": [opt.state_dict() for opt in self.outer],
            "syncs": self.syncs,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (a checkpoint's or a healing peer's)."""
        backup = state["backup"]
        if len(backup) != len(self.backup) or len(state["outer"]) != len(self.outer):
            raise ValueError(
                f"the outer loop's state has {len(backup)} parameters and {len(state['outer'])} outer optimizers: "
                f"expected {len(self.backup)} and {len(self.outer)}. Fix: load a state of the same model, "
                "algorithm and fragments."
            )
        for b, v in zip(self.backup, backup, strict=True):
            b.copy_(v)
        for opt, sd in zip(self.outer, state["outer"], strict=True):
            opt.load_state_dict(sd)
        self.syncs = int(state["syncs"])
