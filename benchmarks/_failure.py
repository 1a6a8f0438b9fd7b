"""The failure case of ``stragglers.py``: one of 3 workers dies a third of the way through the run.

Three runs of the digits setup of ``stragglers.py`` (small CNN width 16, 16x16 images, per-worker
batch 32, SGD lr 0.05 with the one-epoch warmup and cosine decay; ``--base-ms`` of sleep per step
so that compute, not the 2 shared cores, sets the pace), each with 3 training workers:

    async_uninterrupted  strategy="async_elastic": 1 dedicated server + 3 workers, 4 processes
    async_loss           the same; worker rank 3 SIGKILLs itself at a third of its steps, the
                         other two go on (its unpushed batches redrawn)
    ps_restart           strategy="ps", 3 processes under ``torchrun --max-restarts 1``; rank 2
                         SIGKILLs itself at a third of the steps, torchrun ends the others and
                         restarts all three, which resume from the last epoch's checkpoint

The async ranks are started as independent processes (the way a cluster starts them: nothing
ends the others when one dies), forked from a zygote that imported torch and Lightning once
(``tests/fault_utils.py``, as the fault tests start theirs): 1 import per run instead of 4.
Each run's rank 0 appends a JSON line per validation (wall time, ``val_acc``) to a file, and one
when ``fit`` starts, so "time to 95%" is wall time from the first ``fit`` start to the first
validation at 95% or better: for ``ps_restart`` it includes torchrun noticing the loss, starting
3 fresh interpreters (imports included) and replaying the interrupted epoch. Samples per second:
the samples the epochs cover over the wall time from the first ``fit`` start to the last validation.

Run by ``stragglers.py``; each ps rank runs ``python benchmarks/_failure.py <json args>`` under torchrun,
each async rank :func:`_zygote_rank`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from benchmarks._workers import reserved_port  # noqa: E402  (the repo root is importable now)

WORKERS = 3
RUN_TIMEOUT_S = 600.0
# what the async runs' zygote imports once, for every rank it forks
PRELOAD = ["lightning.pytorch", "lightning_strategies.strategies.async_elastic", "recipes.classification",
           "recipes.data", "recipes.models", "benchmarks._failure"]  # fmt: skip


def _events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _rank_main(args: dict[str, Any]) -> None:
    """One rank of a failure-case run (``args``: the run's settings, see :func:`run_case`)."""
    import functools

    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    import lightning_strategies  # noqa: F401
    from lightning_strategies.scaling import ScalingConfig
    from lightning_strategies.strategies.async_elastic import AsyncElasticStrategy
    from lightning_strategies.strategies.parameter_server import ParameterServerStrategy
    from recipes.classification import ClassificationModule
    from recipes.data import DigitsDataModule
    from recipes.models import build_model

    torch.set_num_threads(1)
    events = Path(args["events"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    class Timeline(Callback):
        """Rank 0: the fit's start and every validation, as wall times; every rank: the sleep per
        step; the victim: SIGKILL at its step ``kill_at`` (in the first attempt)."""

        def __init__(self) -> None:
            self.epoch_samples = 0

        def _write(self, **record: Any) -> None:
            with events.open("a") as f:
                f.write(json.dumps({**record, "time": time.time(), "restart": restart}) + "\n")

        def on_fit_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
            if trainer.global_rank == 0:
                self._write(event="fit_start")

        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_rank == args["victim"] and restart == 0 and trainer.global_step >= args["kill_at"]:
                self._write(event="killed", rank=trainer.global_rank, step=trainer.global_step)
                os.kill(os.getpid(), signal.SIGKILL)

        def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
            if args["kind"] == "ps" or trainer.global_rank >= 1:  # the workers' compute
                time.sleep(args["base_ms"] / 1000.0)

        def on_validation_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
            if trainer.global_rank == 0 and not trainer.sanity_checking:
                self._write(event="val", epoch=trainer.current_epoch, acc=float(trainer.callback_metrics["val_acc"]))

    torch.manual_seed(0)
    data = DigitsDataModule(batch_size=32, image_size=16, seed=0)
    module = ClassificationModule(
        build_model("small_cnn", num_classes=10, in_channels=1, width=16),
        num_classes=10,
        optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=args["momentum"], weight_decay=5e-4),
        scaling=ScalingConfig(rule="none", base_batch_size=32, warmup_epochs=1, decay="cosine"),
    )
    timeout = timedelta(seconds=30)
    callbacks: list[Callback] = [Timeline()]
    ckpt_path = None
    if args["kind"] == "ps":
        strategy: Any = ParameterServerStrategy(timeout=timeout)
        ckpt_dir = Path(args["ckpt_dir"])
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_epochs=1))
        last = ckpt_dir / "last.ckpt"
        ckpt_path = str(last) if last.exists() else None
        devices, nodes = WORKERS, 1
    else:
        strategy = AsyncElasticStrategy(dedicated_servers=True, num_servers=1, timeout=timeout)
        devices, nodes = 1, WORKERS + 1
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        num_nodes=nodes,
        strategy=strategy,
        max_epochs=args["epochs"],
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=args["kind"] == "ps",
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)


def _zygote_rank(rank: int, world: int, settings: dict[str, Any]) -> None:
    """An async rank forked by the zygote; its environment (``NODE_RANK``...) says which."""
    _rank_main(settings)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for key in [k for k in env if k.startswith(("TORCHELASTIC_", "SLURM_")) or k in ("RANK", "LOCAL_RANK")]:
        del env[key]
    paths = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=paths)
    return env


def _wait(procs: list[subprocess.Popen[bytes]], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the session started here, nothing else
                proc.wait(timeout=10)
    return [int(p.returncode) for p in procs]


def _run_async(settings: dict[str, Any], work: Path) -> list[int]:
    """The async run's 4 ranks, forked by a zygote of their own; their exit statuses."""
    from fault_utils import Job, Zygote

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(reserved_port()), "WORLD_SIZE": str(WORKERS + 1),
           "NODE_RANK": "{rank}", "LOCAL_RANK": "0"}  # fmt: skip
    job = Job(target="benchmarks._failure:_zygote_rank", world=WORKERS + 1, env=env, kwargs={"settings": settings},
              log_dir=work, timeout=RUN_TIMEOUT_S)  # fmt: skip
    zygote = Zygote(PRELOAD, work / "zygote.log")
    try:
        zygote.wait_ready(RUN_TIMEOUT_S)  # its imports: seconds, minutes on a machine as loaded as CI's can be
        answer = zygote.run(job)
    finally:
        zygote.close()
    return [int(answer["ranks"][r]["returncode"]) for r in range(WORKERS + 1)]


def run_case(kind: str, *, kill: bool, epochs: int, base_ms: float, work: Path) -> dict[str, Any]:
    """One run; returns ``{"seconds_to": {target: s}, "curve": [(s, acc)], "samples_per_s", "exits"}``."""
    if work.exists():
        shutil.rmtree(work)  # a checkpoint left by an earlier run would be resumed from
    work.mkdir(parents=True)
    events = work / "events.jsonl"
    steps_per_worker = epochs * 1257 // 32 // WORKERS  # 39 batches per epoch, shared by 3 workers
    settings = {
        "kind": "ps" if kind == "ps" else "async",
        "events": str(events),
        "epochs": epochs,
        "base_ms": base_ms,
        # async: 3 workers take ~1/3 of the steps each; ps: every rank steps every global step
        "kill_at": steps_per_worker // 3 if kill else 10**9,
        "victim": (WORKERS - 1 if kind == "ps" else WORKERS) if kill else -1,
        "momentum": 0.9 if kind == "ps" else 0.3,  # asynchrony adds about 1 - 1/3 (see stragglers.py)
        "ckpt_dir": str(work / "ckpt"),
    }
    if kind == "ps":
        port = reserved_port()
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={WORKERS}",
                    "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--max-restarts=1"]  # fmt: skip
        with (work / "rank0.log").open("wb") as log:
            command = [*torchrun, str(Path(__file__).resolve()), json.dumps(settings)]
            procs = [subprocess.Popen(command, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                      cwd=REPO)]  # fmt: skip
            exits = _wait(procs, RUN_TIMEOUT_S)
    else:
        exits = _run_async(settings, work)  # each rank writes its own rank<r>.log
    records = _events(events)
    start = next((e["time"] for e in records if e["event"] == "fit_start"), None)
    vals = [e for e in records if e["event"] == "val"]
    if start is None or not vals:
        tail = (work / "rank0.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{kind} run (kill={kill}) recorded no validation (exits {exits}):\n{tail}")
    # a resumed attempt replays from the last checkpoint: keep each epoch's first validation
    # only from the attempt that got furthest, i.e. the curve as wall time went on
    curve = [(e["time"] - start, e["acc"]) for e in vals]
    samples = epochs * 1248  # 39 batches of 32 per epoch (the recipe drops the short last batch)
    return {
        "curve": curve,
        "samples_per_s": samples / curve[-1][0],
        "exits": exits,
        "killed": any(e["event"] == "killed" for e in records),
        "epochs_validated": len({e["epoch"] for e in vals}),
    }


if __name__ == "__main__":
    _rank_main(json.loads(sys.argv[1]))
