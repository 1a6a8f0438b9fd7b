"""Stragglers: asynchronous against synchronous parameter servers when one worker is k times slower.

P fork-started CPU processes (gloo + TensorPipe RPC on 127.0.0.1, one torch thread each) train
the digits recipe's data (1,257 training images at 16x16) with a small CNN (width 16), a
per-worker batch of 32, SGD (lr 0.05, momentum 0.9) with one warmup epoch and a cosine decay.
Every step sleeps ``--base-ms`` after its backward, standing in for a heavier model so that the
2 shared cores do not decide the result; the last rank then sleeps ``(k-1)`` times its own step
so far (the median of its last 10 steps), i.e. it is ``k`` times slower. Each epoch's training is
timed between barriers (at the epoch's start and when validation starts: the last worker's last
step is in), the first epoch left out of the rates as warm-up; the 270 validation digits are
scored at every epoch end, stamped with the training time so far (validation excluded), which
gives accuracy against wall time. Runs, for every slowdown ``k`` in ``--ks`` (1, 2, 4):

    async       strategy="async", max_staleness=None (no worker ever waits)
    ps          strategy="ps", synchronous (every step waits for the slowest)

and, at the headline slowdown ``--k``, ``async_ssp``: strategy="async", max_staleness=--bound
(stale-synchronous). A round runs, at each k, async and ps back to back (the pair's order
alternating between rounds, the order of the ks rotating), so every ratio compares adjacent fits;
a ``# round`` comment line gives each pair's rates and the load. Printed as ``name value unit``
lines (a tag ``_k{k}`` on every slowdown but the headline one):

    async_over_sync_throughput{_P}   samples/s async / samples/s ps      goal >= 1.35 at P=2, k=2
    async_ssp{b}_over_sync_throughput{_P}
    async_over_sync_throughput_k1{_P}  the same without a straggler: what a synchronous step costs
                                     beyond waiting for a slow worker (barriers, per-step
                                     collectives, and on a shared machine the load's own stragglers)
    straggler_gain_P{P}_k{k}         the gain due to the straggler: async/ps at k over the same
                                     round's async/ps at k = 1 (median over rounds; _min_, _max_ too)
    ideal_gain_P{P}_k{k}             (P-1+1/k) / (P/k): every worker busy vs all at the slow pace
    staleness_mean{_k}{_P}           updates a shard applied between a gradient's pull and its push
    staleness_mean_over_P_minus_1{_P}  that over P-1 (1 when all workers are equally fast)
    test_acc_{async,ps}{_k}{_P}      final accuracy on the 270 held-out digits, side by side
    seconds_to_val_acc_95_{async,ps}{_k}{_P}  training seconds to the first epoch at >= 95% val
    sync_over_async_time_to_val_acc_95{_k}{_P}  the two above, ps / async: > 1 when async gets
                                     there first (epoch-granular: both are epoch ends)

(no suffix for P=2, ``_P3`` for P=3), and draws ``results/stragglers.png``: samples/s against k
and validation accuracy against training time, async beside ps, one row per P. A shared machine
is noisy: the ratios of interleaved runs are the result, not the samples per second.

The failure case (``benchmarks/_failure.py``; ``--failure-rounds 0`` skips it): 3 workers, one of
which dies (SIGKILL) a third of the way through the run, under ``async_elastic`` (1 dedicated
server + 3 workers: the other two go on) and under ``ps`` restarted by ``torchrun --max-restarts 1``
from its last epoch's checkpoint, beside an uninterrupted ``async_elastic`` run; interleaved
rounds, medians. Lines (wall seconds from the first ``fit`` start, restarts included):

    failure_samples_per_s_{async_uninterrupted,async_loss,ps_restart}
    failure_seconds_to_val_acc_95_{async_uninterrupted,async_loss,ps_restart}
    async_loss_time_to_95_over_uninterrupted   async with a lost worker / without   goal <= 1.6
    ps_restart_time_to_95_over_async_loss      ps restarted by torchrun / async that lost a worker

    python benchmarks/stragglers.py           # P = 2 and 3, k = 1, 2, 4, 3 rounds, 5 epochs (18 min, 2 busy cores)
    python benchmarks/stragglers.py --epochs 4   # what results/stragglers.txt holds (~15 min at load 5-8)
    python benchmarks/stragglers.py --quick   # P = 2, k = 1, 2, 1 round, 3 epochs, no PNG (~1 min),
                                              # and the failure case at 5 epochs, 1 round (~1-2 min)
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import header, line, load_line, median, pyplot, save_figure

TARGET_ACC = 0.95  # the accuracy "time to accuracy" is measured at


def _fit(name: str, world: int, k: float, base_ms: float, epochs: int, bound: int) -> dict[str, Any]:
    """One Lightning fit + test; rank 0's measurements (rates, staleness, the accuracy curve)."""
    import lightning.pytorch as pl
    import torch.distributed as dist

    import lightning_strategies  # noqa: F401
    from lightning_strategies.comm.async_ps import AsyncParameterShard
    from lightning_strategies.comm.ps import local_shard
    from lightning_strategies.scaling import ScalingConfig
    from lightning_strategies.strategies.async_ps import AsyncParameterServerStrategy
    from lightning_strategies.strategies.parameter_server import ParameterServerStrategy
    from recipes.classification import ClassificationModule
    from recipes.data import DigitsDataModule
    from recipes.models import build_model

    class Straggle(pl.Callback):
        """Base sleep on every rank, and the last rank k times slower; epoch timing, counts and
        validation accuracy against the training time so far."""

        def __init__(self) -> None:
            self.start = 0.0
            self.samples = 0
            self.epoch_start = 0.0
            self.times: list[float] = []
            self.counts: list[float] = []
            self.own: list[float] = []
            self.curve: list[tuple[float, float]] = []  # (training seconds so far, val_acc)

        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.start = time.perf_counter()
            self.samples += len(batch[0])

        def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: Any, optimizer: Any) -> None:
            # before the push: under "ps" the slow rank's own step, not its wait for the others
            time.sleep(base_ms / 1000.0)
            if trainer.global_rank == trainer.world_size - 1:
                # k - 1 times its own recent step (the median: one noisy step is not amplified)
                self.own = [*self.own[-9:], time.perf_counter() - self.start]
                time.sleep((k - 1) * median(self.own))

        def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
            dist.barrier()
            self.epoch_start, self.samples = time.perf_counter(), 0

        def on_validation_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
            # Validation runs at the end of every training epoch, before on_train_epoch_end:
            # the epoch's training ends when the last worker's last step is in.
            dist.barrier()
            self.times.append(time.perf_counter() - self.epoch_start)
            total = torch.tensor(float(self.samples))
            dist.all_reduce(total)
            self.counts.append(float(total))

        def on_validation_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
            # val_acc is the torchmetrics accuracy over every rank's share of the split
            self.curve.append((sum(self.times), float(trainer.callback_metrics["val_acc"])))

        def on_train_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
            shard = local_shard(trainer.global_rank)
            mine = (shard.staleness_sum, shard.pushes) if isinstance(shard, AsyncParameterShard) else (0, 0)
            parts: list[Any] = [None] * trainer.world_size
            dist.all_gather_object(parts, mine)
            pushes = sum(p for _, p in parts)
            # fork-started ranks hand rank 0's callback_metrics back to the launching process:
            # the measurements travel as tensors (the curve as two 1-D ones)
            m = trainer.callback_metrics
            m["bench/staleness_mean"] = torch.tensor(sum(s for s, _ in parts) / pushes if pushes else 0.0)
            timed = slice(1, None)  # the first epoch pays for warm-up
            m["bench/samples_per_s"] = torch.tensor(sum(self.counts[timed]) / sum(self.times[timed]))
            m["bench/curve_s"] = torch.tensor([t for t, _ in self.curve], dtype=torch.float64)
            m["bench/curve_acc"] = torch.tensor([a for _, a in self.curve], dtype=torch.float64)

    torch.manual_seed(0)
    data = DigitsDataModule(batch_size=32, image_size=16, seed=0)
    module = ClassificationModule(
        build_model("small_cnn", num_classes=10, in_channels=1, width=16),
        num_classes=10,
        optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=5e-4),
        scaling=ScalingConfig(rule="none", base_batch_size=32, warmup_epochs=1, decay="cosine"),
    )
    timeout = timedelta(seconds=120)
    strategy: Any
    if name == "ps":
        strategy = ParameterServerStrategy(start_method="fork", timeout=timeout)
    else:
        max_staleness = None if name == "async" else bound
        strategy = AsyncParameterServerStrategy(start_method="fork", timeout=timeout, max_staleness=max_staleness)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_epochs=epochs,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Straggle()],
    )
    trainer.fit(module, datamodule=data)
    out: dict[str, Any] = {}
    for key, value in trainer.callback_metrics.items():
        if key.startswith("bench/"):
            out[key.split("/")[1]] = value.tolist() if value.ndim else float(value)
    results = trainer.test(module, datamodule=data, verbose=False)
    out["test_acc"] = float(results[0]["test_acc"])
    return out


def time_to(curve_s: Sequence[float], curve_acc: Sequence[float], target: float) -> float | None:
    """Training seconds at the first validation with accuracy ``target`` or better (None: never)."""
    return next((t for t, acc in zip(curve_s, curve_acc, strict=True) if acc >= target), None)


def compare(
    world: int, k: float, ks: Sequence[float], base_ms: float, epochs: int, rounds: int, bound: int
) -> dict[str, Any]:
    """Every (strategy, slowdown) fitted ``rounds`` times, interleaved; lines printed; plot data returned.

    A round runs, for each slowdown, async and ps back to back (the pair's order alternating from
    round to round), the slowdowns in a rotated order, and async_ssp after the headline pair: a
    ratio compares two adjacent fits, and the gain at k divides it by the same round's k = 1
    ratio, so a load that changes over minutes cancels out of both.
    """
    names = [(name, s) for s in ks for name in ("async", "ps")] + [("async_ssp", k)]
    runs: dict[tuple[str, float], list[dict[str, Any]]] = {n: [] for n in names}
    suffix = "" if world == 2 else f"_P{world}"
    for r in range(rounds):
        shift = r % len(ks)
        for slowdown in [*ks[shift:], *ks[:shift]]:  # no slowdown always goes first
            pair = ("async", "ps") if r % 2 == 0 else ("ps", "async")
            order = [*pair, "async_ssp"] if slowdown == k else list(pair)
            rates = {}
            for name in order:
                result = _fit(name, world, slowdown, base_ms, epochs, bound)
                runs[(name, slowdown)].append(result)
                rates[name] = result["samples_per_s"]
            print(
                f"# round {r} P={world} k={slowdown:g}: "
                + ", ".join(f"{n} {rates[n]:.1f}" for n in order)
                + f" samples/s; async/ps {rates['async'] / rates['ps']:.3f}; {load_line('now')[2:]}",
                flush=True,
            )
    rate = {n: [x["samples_per_s"] for x in runs[n]] for n in names}

    def tag(slowdown: float) -> str:
        return "" if slowdown == k else f"_k{slowdown:g}"

    def ratio(a: tuple[str, float], b: tuple[str, float]) -> list[float]:
        return [x / y for x, y in zip(rate[a], rate[b], strict=True)]

    def curve(n: tuple[str, float]) -> tuple[list[float], list[float]]:
        # per epoch, the median over rounds of the time stamp and of the accuracy
        xs = [x["curve_s"] for x in runs[n]]
        ys = [x["curve_acc"] for x in runs[n]]
        return [median(c) for c in zip(*xs, strict=True)], [median(c) for c in zip(*ys, strict=True)]

    for name, slowdown in names:
        line(f"{name}_samples_per_s{tag(slowdown)}{suffix}", median(rate[(name, slowdown)]), "samples/s")
    # k = 1 is the control without a straggler: async/ps there is what the synchronous step costs
    # beyond waiting for a slow worker (barriers, and the load's own stragglers on a shared machine)
    control = ratio(("async", 1.0), ("ps", 1.0))
    for slowdown in ks:
        line(
            f"async_over_sync_throughput{tag(slowdown)}{suffix}",
            median(ratio(("async", slowdown), ("ps", slowdown))),
            "x",
        )
    line(f"async_ssp{bound}_over_sync_throughput{suffix}", median(ratio(("async_ssp", k), ("ps", k))), "x")
    for slowdown in ks:
        if slowdown == 1.0:
            continue
        straggled = ratio(("async", slowdown), ("ps", slowdown))
        # the gain due to the straggler alone: async/ps at k over the same round's async/ps at k = 1,
        # against the ideal (P-1+1/k)/(P/k): every worker busy vs everybody at the slow pace
        gains = [a / c for a, c in zip(straggled, control, strict=True)]
        line(f"straggler_gain_P{world}_k{slowdown:g}", median(gains), "x")
        line(f"ideal_gain_P{world}_k{slowdown:g}", (world - 1 + 1 / slowdown) / (world / slowdown), "x")
        line(f"straggler_gain_min_P{world}_k{slowdown:g}", min(gains), "x")
        line(f"straggler_gain_max_P{world}_k{slowdown:g}", max(gains), "x")
    for slowdown in ks:
        staleness = median([x["staleness_mean"] for x in runs[("async", slowdown)]])
        line(f"staleness_mean{tag(slowdown)}{suffix}", staleness, "updates")
        if slowdown == k:
            line(f"staleness_mean_over_P_minus_1{suffix}", staleness / (world - 1), "x")
    line(f"staleness_mean_ssp{bound}{suffix}", median([x["staleness_mean"] for x in runs[("async_ssp", k)]]), "updates")
    for name, slowdown in names:
        line(
            f"test_acc_{name}{tag(slowdown)}{suffix}",
            median([x["test_acc"] for x in runs[(name, slowdown)]]),
            "fraction",
        )
    curves = {n: curve(n) for n in names}
    for slowdown in ks:
        reached = {name: time_to(*curves[(name, slowdown)], TARGET_ACC) for name in ("async", "ps")}
        for name, seconds in reached.items():
            if seconds is None:
                print(f"# {name}{tag(slowdown)}{suffix}: validation never reached {TARGET_ACC:.0%}", flush=True)
            else:
                line(f"seconds_to_val_acc_95_{name}{tag(slowdown)}{suffix}", seconds, "s")
        if reached["async"] is not None and reached["ps"] is not None:
            line(f"sync_over_async_time_to_val_acc_95{tag(slowdown)}{suffix}", reached["ps"] / reached["async"], "x")
    return {"world": world, "ks": list(ks), "rate": {n: median(v) for n, v in rate.items()}, "curves": curves}


FAILURE_CASES = ("async_uninterrupted", "async_loss", "ps_restart")


def failure(epochs: int, base_ms: float, rounds: int, work: Path) -> dict[str, Any]:
    """The failure case (module doc): each run ``rounds`` times, the order rotating; lines printed."""
    from benchmarks._failure import run_case

    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in FAILURE_CASES}
    for r in range(rounds):
        order = [*FAILURE_CASES[r % 3 :], *FAILURE_CASES[: r % 3]]
        for name in order:
            kind, kill = ("ps", True) if name == "ps_restart" else ("async", name == "async_loss")
            result = run_case(kind, kill=kill, epochs=epochs, base_ms=base_ms, work=work / f"{name}_{r}")
            assert result["killed"] == kill, (name, result)
            runs[name].append(result)
            reached = time_to([t for t, _ in result["curve"]], [a for _, a in result["curve"]], TARGET_ACC)
            when = "never" if reached is None else f"{reached:.1f} s"
            print(
                f"# failure round {r} {name}: {result['samples_per_s']:.1f} samples/s, 95% after {when}, exits "
                f"{result['exits']}; {load_line('now')[2:]}",
                flush=True,
            )
    seconds: dict[str, list[float]] = {}
    for name in FAILURE_CASES:
        line(f"failure_samples_per_s_{name}", median([x["samples_per_s"] for x in runs[name]]), "samples/s")
        times = [time_to([t for t, _ in x["curve"]], [a for _, a in x["curve"]], TARGET_ACC) for x in runs[name]]
        if any(t is None for t in times):
            print(f"# {name}: validation did not reach {TARGET_ACC:.0%} in every round: {times}", flush=True)
            continue
        seconds[name] = [float(t) for t in times if t is not None]
        line(f"failure_seconds_to_val_acc_95_{name}", median(seconds[name]), "s")
        line(f"failure_final_val_acc_{name}", median([x["curve"][-1][1] for x in runs[name]]), "fraction")
    if "async_loss" in seconds and "async_uninterrupted" in seconds:
        ratios = [a / b for a, b in zip(seconds["async_loss"], seconds["async_uninterrupted"], strict=True)]
        line("async_loss_time_to_95_over_uninterrupted", median(ratios), "x")
    if "ps_restart" in seconds and "async_loss" in seconds:
        ratios = [a / b for a, b in zip(seconds["ps_restart"], seconds["async_loss"], strict=True)]
        line("ps_restart_time_to_95_over_async_loss", median(ratios), "x")
    return runs


def plot(results: Sequence[dict[str, Any]], k: float, bound: int, path: Path) -> None:
    """The seed's claim 2: samples/s against the slowdown k, and validation accuracy against
    training time, async beside ps; one row per P."""
    plt = pyplot()
    fig, axes = plt.subplots(len(results), 2, figsize=(10.0, 3.6 * len(results)), squeeze=False)
    for (ax_rate, ax_acc), r in zip(axes, results, strict=True):
        world, ks, rate = r["world"], r["ks"], r["rate"]
        for name, style, label in (("async", "o-", "async (no waiting)"), ("ps", "s-", "ps (synchronous)")):
            ax_rate.plot(ks, [rate[(name, s)] for s in ks], style, label=label)
        ax_rate.plot([k], [rate[("async_ssp", k)]], "D", color="C2", label=f"async, max_staleness={bound}")
        # what each would reach if the straggler cost only its own share: every worker busy
        # (async), everybody at the slow worker's pace (ps); from the k = 1 rates
        base_async, base_ps = rate[("async", 1.0)], rate[("ps", 1.0)]
        fine = [1 + i * (max(ks) - 1) / 50 for i in range(51)]
        ax_rate.plot(
            fine,
            [base_async * (world - 1 + 1 / s) / world for s in fine],
            ":",
            color="C0",
            label="ideal async: rate(k=1) x (P-1+1/k)/P",
        )
        ax_rate.plot(fine, [base_ps / s for s in fine], ":", color="C1", label="ideal sync: rate(k=1) / k")
        ax_rate.set_xscale("log", base=2)
        ax_rate.set_xticks(ks, [f"{s:g}" for s in ks])
        ax_rate.set_ylim(bottom=0)
        ax_rate.set_xlabel("slowdown k of the last worker")
        ax_rate.set_ylabel("samples / s (all workers)")
        ax_rate.set_title(f"P = {world}: throughput")
        ax_rate.grid(alpha=0.3)
        ax_rate.legend(fontsize=7, loc="lower left")
        # colour = strategy (as on the left), line style = slowdown
        styles = dict(zip(ks, (":", "--", "-", "-."), strict=False))
        for name, color, marker in (("async", "C0", "o"), ("ps", "C1", "s")):  # legend: a column each
            for s in ks:
                xs, ys = r["curves"][(name, s)]
                ax_acc.plot(
                    xs, ys, styles.get(s, "-"), marker=marker, markersize=4, color=color, label=f"{name}, k={s:g}"
                )
        ax_acc.axhline(TARGET_ACC, color="gray", lw=0.8, ls=":")
        ax_acc.set_ylim(max(0.0, min(min(r["curves"][n][1]) for n in r["curves"]) - 0.05), 1.0)
        ax_acc.set_xlabel("training wall time (s, validation excluded)")
        ax_acc.set_ylabel("validation accuracy")
        ax_acc.set_title(f"P = {world}: accuracy vs time (one point per epoch)")
        ax_acc.grid(alpha=0.3)
        ax_acc.legend(fontsize=7, loc="lower right", ncol=2)
    save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="P=2, k = 1 and --k, one round, 3 epochs, no PNG")
    parser.add_argument("--k", type=float, default=2.0, help="the headline slowdown (untagged lines, async_ssp)")
    parser.add_argument("--ks", default=None, help="slowdowns, comma-separated (default 1,2,4; quick 1,--k)")
    parser.add_argument("--base-ms", type=float, default=20.0, help="sleep per step on every worker (ms)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs per fit (default 5; quick 3)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; quick 1)")
    parser.add_argument("--bound", type=int, default=2, help="max_staleness of the async_ssp runs")
    parser.add_argument("--plot", type=Path, default=None, help="PNG path (default results/stragglers.png; quick none)")
    parser.add_argument("--failure-rounds", type=int, default=None, help="failure case rounds (0: skip; 2, quick 1)")
    parser.add_argument("--failure-epochs", type=int, default=None, help="epochs per failure run (6; quick 5)")
    parser.add_argument("--failure-base-ms", type=float, default=40.0, help="sleep per step in the failure case (ms)")
    parser.add_argument("--work", type=Path, default=None, help="where the failure runs write (default: a temp dir)")
    parser.add_argument("--skip-stragglers", action="store_true", help="only the failure case")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_strategies"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    print(header("stragglers"), flush=True)
    print(load_line("start"), flush=True)
    epochs = args.epochs or (3 if args.quick else 5)
    rounds = args.rounds or (1 if args.quick else 3)
    default_ks = (1.0, args.k) if args.quick else (1.0, 2.0, 4.0)
    ks = sorted({1.0, args.k, *(float(s) for s in args.ks.split(","))} if args.ks else set(default_ks) | {args.k})
    if args.plot is None and not args.quick:
        args.plot = Path(__file__).parent / "results" / "stragglers.png"
    line("slowdown_k", args.k, "x")
    print(
        f"# {rounds} rounds, {epochs} epochs per fit, ks {', '.join(f'{s:g}' for s in ks)}, base {args.base_ms:g} ms",
        flush=True,
    )
    if not args.skip_stragglers:
        results = [
            compare(world, args.k, ks, args.base_ms, epochs, rounds, args.bound)
            for world in ((2,) if args.quick else (2, 3))
        ]
        if args.plot is not None:
            plot(results, args.k, args.bound, args.plot)
    failure_rounds = args.failure_rounds if args.failure_rounds is not None else (1 if args.quick else 2)
    if failure_rounds > 0:
        failure_epochs = args.failure_epochs or (5 if args.quick else 6)
        print(
            f"# failure case: {failure_rounds} rounds, {failure_epochs} epochs, base {args.failure_base_ms:g} ms",
            flush=True,
        )
        with tempfile.TemporaryDirectory() as tmp:
            failure(failure_epochs, args.failure_base_ms, failure_rounds, args.work or Path(tmp))
    print(load_line("end"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
