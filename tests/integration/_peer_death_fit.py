"""What one rank of a peer-death case runs: the tiny fit of ``_torchrun_fit``, launched "by hand".

Each rank is its own node to Lightning (``num_nodes=world``, ``devices=1``, ``NODE_RANK=rank``,
``LOCAL_RANK=0``; ``ps_hier``, ``async_hier``: ``ps``, ``async`` on nodes of 2, so that the push is
hierarchical): the
``LightningEnvironment`` sees ``LOCAL_RANK`` and starts no processes, so
nothing but the strategy itself can stop a survivor.

The victim kills itself with SIGKILL (no handler runs; the kernel closes its sockets), after
writing ``killed.json`` (its rank, step, where, the signal and ``time.time()``; in the ``step``
and ``hang`` cases the survivors wait for that file at the start of the same step):

- ``fault="step"``: at the start of training step ``step`` (mid-epoch).
- ``fault="hang"``: the same with SIGSTOP: the process freezes with its sockets open, so only the
  strategy's ``timeout`` ends the survivors' wait (the test's zygote SIGKILLs it afterwards).
- ``fault="freeze"``: the same SIGSTOP under a long ``timeout`` and a short ``watch_grace_s``: the
  heartbeat's watch, not the timeout, ends the survivors' wait (it aborts their communication).
- ``fault="comm"``: from step ``step`` on, inside the strategy's communication, while its peers
  are inside theirs: ring, in the ring all-reduce after the first segment of a bucket arrived (ps_ring: in
  its push, the ring's reduce-scatter, on the shards' thread);
  ddp, in a DDP communication hook registered on the victim only (after a pause, so the peers
  are waiting in their all-reduce of the bucket); ps and async, in the victim's shard while it
  serves a peer's push (the RPC is in flight); pipeline, in the victim's (last) stage's backward
  of the first micro-batch, while stage 0 waits to receive that gradient.
"""

# No ``from __future__ import annotations``: DDP checks a communication hook's annotations as objects.

import atexit
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from _torchrun_fit import PipeTinyRegressor, make_loader
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning_utils import TinyRegressor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import lightning_strategies.comm.ring.transport as ring_module
import lightning_strategies.faults as faults
from lightning_strategies import (
    AsyncParameterServerStrategy,
    ParameterServerStrategy,
    PeerFailureReport,
    PipelineStrategy,
    RingAllReduceStrategy,
    RingParameterServerStrategy,
)
from lightning_strategies.comm.async_ps import AsyncParameterShard
from lightning_strategies.comm.pipeline import _TimedStage
from lightning_strategies.comm.ps import ParameterShard

STRATEGIES = ("ring", "ps", "async", "pipeline", "ddp", "ps_hier", "async_hier")
MAX_EPOCHS = 3  # 4 steps per epoch: the survivors would finish (and exit 0) only if they missed the death
DDP_HOOK_PAUSE_S = 1.0
WAIT_FOR_VICTIM_S = 60.0  # half the test's job timeout: a victim later than that is a failure to report


def make_strategy(name: str, timeout: timedelta) -> pl.strategies.Strategy:
    if name == "ring":
        return RingAllReduceStrategy(timeout=timeout)
    if name == "ps_ring":
        return RingParameterServerStrategy(timeout=timeout)
    if name in ("ps", "ps_hier"):
        return ParameterServerStrategy(timeout=timeout)
    if name in ("async", "async_hier"):
        return AsyncParameterServerStrategy(timeout=timeout)
    if name == "pipeline":
        return PipelineStrategy(timeout=timeout)
    if name == "ddp":
        return DDPStrategy(timeout=timeout)
    raise ValueError(f"unknown strategy {name!r}: expected one of {STRATEGIES}")


def _die(out_dir: Path, rank: int, step: int, where: str, sig: signal.Signals = signal.SIGKILL) -> None:
    record = {"rank": rank, "step": step, "where": where, "signal": sig.name, "time": time.time()}
    tmp = out_dir / "killed.json.part"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, out_dir / "killed.json")
    os.kill(os.getpid(), sig)  # SIGSTOP: every thread freezes (heartbeat included) with its sockets open


class _Timeline(Callback):
    """Appends ``{"event", "time"}`` lines to ``rank<r>.events``: ``diagnose`` (the failure reached
    :mod:`lightning_strategies.comm.heartbeat`, which starts watching the heartbeats), ``diagnosed`` (the
    diagnosis is done), ``exception`` (Lightning's ``on_exception``) and ``exit`` (an atexit handler,
    after teardown: the interpreter is exiting)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        atexit.register(self._write, "exit")
        diagnose = faults.Heartbeat.diagnose

        def timed_diagnose(beat: faults.Heartbeat, *args: Any, **kwargs: Any) -> faults.PeerDiagnosis:
            self._write("diagnose")
            try:
                return diagnose(beat, *args, **kwargs)
            finally:
                self._write("diagnosed")

        faults.Heartbeat.diagnose = timed_diagnose  # type: ignore[method-assign]

    def _write(self, event: str) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"event": event, "time": time.time()}) + "\n")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._write("exception")


class _KillAtStep(Callback):
    """The victim SIGKILLs (``hang``: SIGSTOPs) itself at the start of training step ``step``."""

    def __init__(self, step: int, out_dir: Path, *, hang: bool = False) -> None:
        self.step, self.out_dir, self.hang = step, out_dir, hang

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            sig = signal.SIGSTOP if self.hang else signal.SIGKILL
            _die(self.out_dir, trainer.global_rank, self.step, "start of the training step", sig)


class _WaitForVictim(Callback):
    """A survivor waits at the start of its training step ``step`` until the victim has reached its
    kill point (``killed.json`` exists), at most ``WAIT_FOR_VICTIM_S``.

    Under ``"async"`` the ranks draw batches from one queue at their own pace: a victim that starts
    late (imports on a fresh clone, a loaded machine) would find the peer had taken nearly all
    the fit's batches, and not reach its step ``step`` before the fit ends. The synchronous
    strategies reach the step together, so the wait only lines up what happens anyway. Not used
    for ``fault="comm"``: there the victim dies inside a communication its peers take part in.
    """

    def __init__(self, step: int, out_dir: Path) -> None:
        self.step, self.marker = step, out_dir / "killed.json"

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step != self.step:
            return
        deadline = time.monotonic() + WAIT_FOR_VICTIM_S
        while not self.marker.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the victim did not reach its kill point within {WAIT_FOR_VICTIM_S:.0f} s")
            time.sleep(0.01)


class _KillInComm(Callback):
    """The victim SIGKILLs itself inside the strategy's communication from step ``step`` on."""

    def __init__(self, name: str, step: int, out_dir: Path) -> None:
        self.name, self.step, self.out_dir = name, step, out_dir
        self.trainer: pl.Trainer | None = None

    def armed(self) -> bool:
        return self.trainer is not None and self.trainer.global_step >= self.step

    def die(self, where: str, step: int | None = None) -> None:
        assert self.trainer is not None
        _die(self.out_dir, self.trainer.global_rank, self.trainer.global_step if step is None else step, where)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.trainer = trainer
        getattr(self, f"_arm_{self.name}")(trainer)

    def _arm_ring(self, trainer: pl.Trainer) -> None:
        reduce_segment = ring_module._reduce_segment

        def reduce_then_maybe_die(dst: torch.Tensor, src: torch.Tensor) -> None:
            # reached on the reducer thread once a peer's segment has arrived: mid-ring
            if self.armed():
                self.die("ring all-reduce, after receiving a segment")
            reduce_segment(dst, src)

        ring_module._reduce_segment = reduce_then_maybe_die  # this process (the victim) only

    _arm_ps_ring = _arm_ring  # its push and pull are the ring's halves, on the shards' thread

    def _arm_ddp(self, trainer: pl.Trainer) -> None:
        def allreduce_or_die(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            if self.armed():
                time.sleep(DDP_HOOK_PAUSE_S)  # the peers reach their all-reduce of this bucket
                self.die("DDP communication hook, peers in their all-reduce")
            return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

        trainer.strategy.model.register_comm_hook(None, allreduce_or_die)  # type: ignore[union-attr]

    def _arm_ps(self, trainer: pl.Trainer) -> None:
        push = ParameterShard.push
        rank = trainer.global_rank

        def push_or_die(shard: ParameterShard, worker: int, step: int, *args: Any) -> Any:
            if worker != rank and self.armed():
                self.die(f"parameter server shard {shard.shard_id} serving worker {worker}'s push (RPC)")
            return push(shard, worker, step, *args)

        ParameterShard.push = push_or_die  # type: ignore[method-assign]

    _arm_ps_hier = _arm_ps  # the victim's shard serves a push of the other node's pusher

    def _arm_async(self, trainer: pl.Trainer) -> None:
        push_pull = AsyncParameterShard.push_pull
        rank = trainer.global_rank

        def push_pull_or_die(shard: AsyncParameterShard, worker: int, *args: Any, **kwargs: Any) -> Any:
            # The ranks draw batches from one queue, each at its own pace: a victim that started
            # late (lazy imports on a fresh clone, a loaded machine) may reach step STEP only after
            # the peer's last push, and never die. So the peer's step, as this shard counts its
            # pushes, arms the kill too: it then misses only if the victim took all but STEP of the
            # fit's 24 batches before the peer's last push.
            peer_step = shard.clocks[worker]
            if worker != rank and (self.armed() or peer_step >= self.step):
                assert self.trainer is not None
                step = max(self.trainer.global_step, peer_step)
                self.die(f"async shard {shard.shard_id} serving worker {worker}'s push (RPC)", step)
            return push_pull(shard, worker, *args, **kwargs)

        AsyncParameterShard.push_pull = push_pull_or_die  # type: ignore[method-assign]

    _arm_async_hier = _arm_async  # the victim's shard serves a node's push (its own node's too)

    def _arm_pipeline(self, trainer: pl.Trainer) -> None:
        backward = _TimedStage.backward_one_chunk

        def backward_or_die(stage: _TimedStage, *args: Any, **kwargs: Any) -> Any:
            if self.armed():
                self.die(f"pipeline stage {stage.stage_index} backward, stage 0 waiting for its gradient")
            return backward(stage, *args, **kwargs)

        _TimedStage.backward_one_chunk = backward_or_die  # type: ignore[method-assign]


def run_rank(rank: int, world: int, *, strategy: str, fault: str, victim: int, step: int, timeout_s: float,
             out_dir: str, watch_grace_s: float | None = None) -> None:  # fmt: skip
    """Fit until the end (3 epochs) or until the victim's death fails this rank.

    ``watch_grace_s``: the heartbeat watch's grace (the strategy's ``peer_watch_grace``, the
    callback's ``watch_grace`` for ``ddp``); ``None``: the default (60 s).
    """
    torch.set_num_threads(1)
    out = Path(out_dir)
    callbacks: list[Callback] = [_Timeline(out / f"rank{rank}.events"), PeerFailureReport(watch_grace=watch_grace_s)]
    if rank == victim:
        if fault == "comm":
            callbacks.append(_KillInComm(strategy, step, out))
        else:
            callbacks.append(_KillAtStep(step, out, hang=fault in ("hang", "freeze")))
    elif fault != "comm":
        callbacks.append(_WaitForVictim(step, out))
    model = PipeTinyRegressor() if strategy == "pipeline" else TinyRegressor()
    per_node = 1
    if strategy in ("ps_hier", "async_hier"):  # nodes of 2 processes, so that the push goes hierarchical
        per_node = 2
        os.environ.update(NODE_RANK=str(rank // per_node), LOCAL_RANK=str(rank % per_node))
    chosen = make_strategy(strategy, timedelta(seconds=timeout_s))
    if isinstance(chosen, faults.PeerFailureMixin):
        chosen.peer_watch_grace = watch_grace_s
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=per_node,
        num_nodes=world // per_node,
        strategy=chosen,
        max_epochs=MAX_EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=callbacks,
    )
    trainer.fit(model, make_loader("pipeline" if strategy == "pipeline" else "ring", world))
    print(f"rank {rank}: fit finished at step {trainer.global_step}", flush=True)
