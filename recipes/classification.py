"""The recipes' LightningModule: image classification with torchmetrics accuracy.

It is written the plain way (loss from ``self(x)``, optimizer over the parameters) and also
implements the pipeline contract (``pipeline_layers`` / ``pipeline_loss``) so the same module
runs under every strategy.

Two kinds of bad input stop a run with an error that says what was found and what to change,
instead of training on silently:

- **Non-finite values.** After every optimizer step the weights' largest magnitude (one fused
  inf-norm, which a NaN or inf reaches and finite weights cannot overflow) is noted as a flag on
  the device, without waiting for it. The flags are read in one transfer when Lightning writes
  step metrics (``log_every_n_steps``), at each epoch's last batch, before every checkpoint is
  written and at the end of fit: on CUDA the host waits for the device there only, not every
  step. A NaN or inf loss on any rank makes the update non-finite, and the update is the same on
  every replica (DDP and the ring all-reduce the gradients, the parameter servers average them,
  a pipeline's stages back-propagate the one loss), and every rank reads its flags at the same
  steps, so every rank raises :class:`FloatingPointError` together, naming the first step that
  broke the weights, and none is left waiting in a collective for a peer that stopped. The cost
  of the deferral: up to ``log_every_n_steps - 1`` steps train on after the weights broke
  (nothing is saved from them). The loss itself is not checked: it is per rank, and a rank
  raising alone would leave its peers in the next all-reduce until the timeout. Under ``async``
  each rank raises at its first check after a step that pulled the broken weights. The last
  checkpoint, written before the weights broke, stays as it was.
- **A checkpoint of another model** (``ckpt_path`` of a different architecture, width, class or
  channel count): ``on_load_checkpoint`` compares the tensors' names and shapes before
  Lightning's strict load and names the first differences.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.distributed.tensor import DTensor
from torchmetrics.classification import MulticlassAccuracy

from lightning_strategies.scaling import ScalingConfig, ScalingPlan, replicas_of
from lightning_strategies.strategies._base import log_due
from recipes.models import as_blocks

__all__ = ["ClassificationModule", "EpochThroughputMonitor"]

# Step-level metrics are logged unsynchronised on purpose: a per-step all-reduce of the loss
# would add a collective to every step and distort the strategies' communication figures.
warnings.filterwarnings("ignore", message=r".*when logging on epoch level in distributed setting.*")

OptimizerFactory = Callable[..., torch.optim.Optimizer]


class ClassificationModule(pl.LightningModule):
    """Cross-entropy classification of ``model``'s logits.

    Args:
        model: maps images to logits.
        num_classes: classes of the task.
        optimizer: a partial optimizer (Hydra ``_partial_: true``), called with the parameter
            groups and the *scaled* lr.
        scaling: the scaling rule and schedule; the lr the optimizer config gives is the base lr.
        plan: the run's global batch and scaled lr, derived once by the caller (``recipes.train.run``
            derives and logs it before any process starts); ``None`` derives it from the trainer in
            ``configure_optimizers`` and logs it there.
        no_decay_norm_bias: put biases and norm weights in a group without weight decay or
            layer adaptation (Goyal et al. §5.1; You et al. 2020).
        label_smoothing: as in ``nn.CrossEntropyLoss``.
        check_finite: raise :class:`FloatingPointError` once an optimizer step has left a weight
            NaN or inf (costs one pass over the weights per step on the device, and one host read
            per ``log_every_n_steps``, epoch end and checkpoint).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        num_classes: int,
        optimizer: OptimizerFactory,
        scaling: ScalingConfig | None = None,
        plan: ScalingPlan | None = None,
        no_decay_norm_bias: bool = False,
        label_smoothing: float = 0.0,
        check_finite: bool = True,
    ) -> None:
        super().__init__()
        self.model = model
        self.optimizer_factory = optimizer
        self.scaling = scaling or ScalingConfig(rule="none")
        self.no_decay_norm_bias = no_decay_norm_bias
        self.criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)
        self.train_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=num_classes, average="micro")
        self.given_plan = plan
        self.plan: ScalingPlan | None = plan  # the plan in use, known after configure_optimizers
        self.check_finite = check_finite
        self._last_loss: torch.Tensor | None = None
        # (non-finite flag on the device, global step, epoch, batch, loss) of each step not yet read
        self._unread_steps: list[tuple[torch.Tensor, int, int, int, torch.Tensor | None]] = []
        self._landing: tuple[int, int, int, torch.Tensor | None] | None = None  # a step whose values land later

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    # The pipeline contract (lightning_strategies.PipelineModule).
    def pipeline_layers(self) -> nn.Sequential:
        return as_blocks(self.model)

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.criterion(outputs, targets)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        self._note_landed_weights()  # the forward has landed the last step's values (ps with overlap)
        loss = self.criterion(logits, y)
        self.train_acc(logits.detach(), y)
        self._last_loss = loss.detach()  # for the non-finite report; read only when it fires
        self.log("train_loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def optimizer_step(
        self,
        epoch: int,
        batch_idx: int,
        optimizer: Any,
        optimizer_closure: Callable[[], Any] | None = None,
    ) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        if self.check_finite:
            step = self.trainer.global_step + 1  # 1-based; Lightning counts the step once this hook returns
            if getattr(self.trainer.strategy, "overlap", None) is not None:
                # ps with overlap: this step's values land during the next forward (or at a checkpoint, the
                # fit's end), so they are judged then, under this step's name
                self._landing = (step, self.current_epoch, batch_idx, self._last_loss)
            else:
                self._note_finite_weights(step, self.current_epoch, batch_idx, self._last_loss)
            if log_due(self._trainer) is not None:  # the same steps on every rank
                self._raise_if_weights_broke()

    def _note_landed_weights(self) -> None:
        if self._landing is not None:
            landing, self._landing = self._landing, None
            self._note_finite_weights(*landing)

    def _note_finite_weights(self, step: int, epoch: int, batch_idx: int, last_loss: torch.Tensor | None) -> None:
        # this rank's weights: a pipeline rank holds only its stages (the others are meta placeholders)
        params = [p.detach() for p in self.parameters() if not p.is_meta]
        if not params:
            return
        # inf-norm: the largest |w|; NaN and inf reach it, finite weights cannot overflow it.
        # Split (DTensor) and plain parameters apart: torch's foreach norm refuses a mix of them.
        peaks = []
        for group in ([p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]):
            if group:
                peak = torch.nn.utils.get_total_norm(group, norm_type=math.inf)
                # tensor-parallel shards: every rank judges the whole weights
                peaks.append(peak.full_tensor() if isinstance(peak, DTensor) else peak)
        peak = peaks[0] if len(peaks) == 1 else torch.stack(peaks).max()
        self._unread_steps.append((~torch.isfinite(peak), step, epoch, batch_idx, last_loss))

    def _raise_if_weights_broke(self) -> None:
        """Read the flags noted since the last read (one transfer) and raise at the first broken step."""
        unread, self._unread_steps = self._unread_steps, []
        if not unread:
            return
        broke = torch.stack([flag for flag, *_ in unread]).tolist()  # the host waits for the device here only
        if not any(broke):
            return
        _, step, epoch, batch_idx, last_loss = unread[broke.index(True)]
        params = [p for p in self.parameters() if not p.is_meta]
        names = [
            name for name, p in self.named_parameters() if not p.is_meta and not bool(torch.isfinite(p.detach()).all())
        ]
        loss = "n/a" if last_loss is None else f"{float(last_loss):.4g}"
        raise FloatingPointError(
            f"{type(self).__name__}: the weights are not finite after optimizer step {step} "
            f"(epoch {epoch}, batch {batch_idx}): {len(names)} of {len(params)} parameter tensors "
            f"hold NaN or inf now (first: {names[0] if names else 'n/a'}); this rank's loss at that step was {loss}. "
            "Expected finite weights: a NaN or inf loss or gradient on some rank was applied. Fix: lower "
            "optimizer.lr or warm up (scaling.warmup_epochs), clip gradients (trainer.gradient_clip_val=1.0), or "
            "look for NaN/inf in the inputs; resume from the last checkpoint, written before that step."
        )

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Called on every rank by Trainer.save_checkpoint, after the strategy's gathers and before
        # anything is written: a checkpoint never holds weights a noted step broke.
        if self.check_finite:
            self._note_landed_weights()  # the strategy's state dict has landed every value
            self._raise_if_weights_broke()

    def on_train_end(self) -> None:
        if self.check_finite:
            self._note_landed_weights()  # the fit's last values land before on_train_end
            self._raise_if_weights_broke()  # the steps after the last read (a fit stopped mid-epoch)

    def on_train_start(self) -> None:
        self._unread_steps = []  # a new fit
        self._landing = None

    def on_train_epoch_end(self) -> None:
        # Images the data skipped as unreadable (ImageFolderDataModule), summed over ranks; only
        # data modules that count them add this one epoch-end collective.
        datamodule = getattr(self.trainer, "datamodule", None)
        counter = getattr(datamodule, "unreadable_skipped", None)
        if callable(counter):
            self.log("data/unreadable_skipped", float(counter()), reduce_fx="sum", sync_dist=True)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse, with the differences named, a checkpoint whose tensors do not fit this model."""
        saved = checkpoint.get("state_dict")
        if not isinstance(saved, dict):
            return
        own = self.state_dict()
        missing = [k for k in own if k not in saved]
        extra = [k for k in saved if k not in own]
        reshaped = [
            f"{k} is {list(saved[k].shape)} there, {list(v.shape)} here"
            for k, v in own.items()
            if k in saved and isinstance(saved[k], torch.Tensor) and saved[k].shape != v.shape
        ]
        if not (missing or extra or reshaped):
            return
        found = []
        if reshaped:
            found.append(f"{len(reshaped)} tensors differ in shape (first: {reshaped[0]})")
        if missing:
            found.append(f"{len(missing)} of this model's tensors are not in it (first: {missing[0]})")
        if extra:
            found.append(f"{len(extra)} of its tensors are not in this model (first: {extra[0]})")
        raise ValueError(
            f"{type(self).__name__}: the checkpoint holds another model: {'; '.join(found)}. Expected the "
            f"{len(own)} tensors of the model this run builds ({type(self.model).__name__}). Fix: resume with "
            "the model settings the checkpoint was trained with (model name and width, the data's classes "
            "and channels), or start without a checkpoint."
        )

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", self.criterion(logits, y), sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.test_acc(logits, y)
        self.log("test_loss", self.criterion(logits, y), sync_dist=True)
        self.log("test_acc", self.test_acc)

    def _parameter_groups(self, weight_decay: float) -> Iterable[Any]:
        if not self.no_decay_norm_bias:
            return [p for p in self.parameters() if p.requires_grad]
        from lightning_strategies.optim import param_groups

        return param_groups(self, weight_decay)

    def configure_optimizers(self) -> Any:
        trainer = self.trainer
        datamodule = getattr(trainer, "datamodule", None)
        loader_batch = int(getattr(datamodule, "batch_size", 0))  # 0: fit without a DataModule, unknown
        per_device = loader_batch or 1
        replicas, accumulate = replicas_of(trainer.strategy), trainer.accumulate_grad_batches
        if self.given_plan is not None:
            _check_plan_fits(self.given_plan, per_device=loader_batch, replicas=replicas, accumulate=accumulate)
            self.plan = self.given_plan
        else:
            base_lr = (
                float(self.optimizer_factory.keywords["lr"]) if hasattr(self.optimizer_factory, "keywords") else None
            )
            if base_lr is None:
                raise ValueError("the optimizer config must give an lr (the base lr at scaling.base_batch_size)")
            self.plan = self.scaling.plan(
                base_lr=base_lr, per_device=per_device, replicas=replicas, accumulate=accumulate
            )
            rank_zero_info(self.plan.describe())
        weight_decay = float(self.optimizer_factory.keywords.get("weight_decay", 0.0))  # type: ignore[attr-defined]
        optimizer = self.optimizer_factory(self._parameter_groups(weight_decay), lr=self.plan.lr)
        estimated_steps = trainer.estimated_stepping_batches
        if math.isinf(estimated_steps):
            total_steps, steps_per_epoch = self._endless_run_steps(trainer)
        else:
            total_steps = int(estimated_steps)
            epochs = max(1, trainer.max_epochs or 1)
            steps_per_epoch = max(1, total_steps // epochs)
        scheduler = self.scaling.scheduler(
            optimizer, self.plan, steps_per_epoch=steps_per_epoch, total_steps=total_steps
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _endless_run_steps(self, trainer: pl.Trainer) -> tuple[int, int]:
        """(total, per epoch) optimizer steps of a run without a planned end (``max_epochs=-1``).

        Warmup and step decay need only the steps per epoch; a cosine decay needs the end.
        """
        if self.scaling.decay == "cosine":
            raise ValueError(
                "scaling.decay='cosine' decays to zero at the end of the run, but trainer.max_epochs=-1 (and no "
                "max_steps) trains without an end. Fix: set trainer.max_epochs or trainer.max_steps, or use "
                "scaling.decay=none or step."
            )
        if trainer.train_dataloader is None:
            trainer.fit_loop.setup_data()  # as Lightning's estimated_stepping_batches does
        batches = trainer.num_training_batches
        per_epoch = 1 if math.isinf(batches) else max(1, math.ceil(batches / trainer.accumulate_grad_batches))
        return per_epoch, per_epoch  # total only bounds the cosine decay, which is excluded above


def _check_plan_fits(plan: ScalingPlan, *, per_device: int, replicas: int, accumulate: int) -> None:
    """Refuse a plan derived for another batch, replica or accumulation count: its lr would be wrong.

    ``per_device`` 0 (no DataModule tells the loader's batch) compares replicas and accumulation only.
    """
    derived_for = (plan.per_device if per_device else 0, plan.replicas, plan.accumulate)
    if derived_for != (per_device, replicas, accumulate):
        raise ValueError(
            f"the scaling plan was derived for {plan.per_device} per device x {plan.replicas} replicas x "
            f"{plan.accumulate} accumulation steps, but this fit runs {per_device or '?'} x {replicas} x "
            f"{accumulate}; "
            "expected the plan of this trainer and data. Fix: derive the plan from the trainer that fits the "
            "module (ScalingConfig.plan), or pass plan=None to derive it in configure_optimizers."
        )


class EpochThroughputMonitor(pl.Callback):
    """Logs ``throughput/samples_per_s`` and ``throughput/epoch_samples`` each training epoch (all
    replicas together), and
    records the validation accuracy reached against wall time since ``fit`` started.

    Time runs from the epoch's first batch to its last ``on_train_batch_end``, so validation
    and checkpointing are not counted. The rate is measured, not extrapolated from one rank: the
    samples every rank trained on, summed and counted once per replica (the ranks of a pipeline or
    tensor-parallel group share theirs), over the slowest rank's epoch time; under ``async`` the
    ranks train on different numbers of batches. (Named apart from Lightning's own
    ``ThroughputMonitor``, which counts batches per step from a user-given batch size.)
    """

    def __init__(self) -> None:
        self.epoch_rates: list[float] = []
        self.val_curve: list[tuple[float, float]] = []  # (seconds since fit start, val_acc)
        self._fit_start = 0.0
        self._epoch_start: float | None = None  # the epoch's first batch
        self._last_batch_end: float = 0.0
        self._epoch_samples = 0  # this rank's

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fit_start = time.perf_counter()

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        acc = trainer.callback_metrics.get("val_acc")
        if not trainer.sanity_checking and acc is not None:
            self.val_curve.append((time.perf_counter() - self._fit_start, float(acc)))

    def time_to_val_acc(self, target: float) -> float | None:
        """Seconds from the start of ``fit`` to the first validation at ``target`` or better."""
        return next((t for t, acc in self.val_curve if acc >= target), None)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_start, self._epoch_samples = None, 0

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._epoch_start is None:
            self._epoch_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._epoch_samples += _batch_len(batch)
        self._last_batch_end = time.perf_counter()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._epoch_start is None or self._last_batch_end <= self._epoch_start:
            return
        seconds = self._last_batch_end - self._epoch_start
        counted = getattr(trainer.strategy, "epoch_samples", None)
        trained = counted(trainer.current_epoch) if callable(counted) else None
        if trained is not None:  # async with dedicated servers: the chief counts what the workers pushed
            samples = float(trained)
        else:
            samples, seconds = _sum_and_max(trainer, float(self._epoch_samples), seconds, pl_module.device)
            samples *= replicas_of(trainer.strategy) / max(1, trainer.world_size)  # once per replica
        rate = samples / seconds
        self.epoch_rates.append(rate)
        pl_module.log("throughput/samples_per_s", rate, rank_zero_only=True)
        pl_module.log("throughput/epoch_samples", samples, rank_zero_only=True)

    def samples_per_s(self) -> float:
        """Median rate over epochs after the first (which pays for warm-up), or the only one."""
        rates = self.epoch_rates[1:] or self.epoch_rates
        return float(torch.tensor(rates).median()) if rates else float("nan")


def _sum_and_max(trainer: pl.Trainer, total: float, longest: float, device: torch.device) -> tuple[float, float]:
    """``total`` summed and ``longest`` maximised over the ranks (every rank calls this at epoch end)."""
    if trainer.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return total, longest
    summed = torch.tensor([total], dtype=torch.float64, device=device)
    slowest = torch.tensor([longest], dtype=torch.float64, device=device)
    dist.all_reduce(summed)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(summed), float(slowest)


def _batch_len(batch: Any) -> int:
    """Samples in a batch: the length of its first tensor (a tuple, list or dict batch of any module)."""
    if isinstance(batch, torch.Tensor):
        return len(batch)
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, list | tuple) else ()
    return next((len(item) for item in items if isinstance(item, torch.Tensor) and item.ndim > 0), 0)
