"""`make train` beside other work: the default run's training time quiet and next to one busy
process per core, interleaved (quiet, loaded, quiet, loaded, ...).

    python benchmarks/train_under_load.py            # the default recipe as `make train` runs it
    python benchmarks/train_under_load.py --quick    # 10 batches, CI-sized (a smoke run of the method)
    python benchmarks/train_under_load.py --fixed-threads 2   # also: loaded with OMP_NUM_THREADS=2 (torch's default)

Each run is ``python train.py`` with ``OMP_NUM_THREADS`` unset, so the app picks the torch thread
count (one per free core, recipes/checks.py); "quiet" means this machine's ambient load, which the
output reports (start/end load averages, and the busy cores the app measured). The busy processes
are pure-Python spin loops at normal priority, started before the run and ended after it.
Prints ``name value unit`` lines: the training seconds (metrics.json ``wall_s``), the threads the app
chose, and ``loaded_over_quiet`` (goal: <= 1.5). Beside each run, a fixed one-thread torch workload
(``PROBE``) is timed under the same conditions: ``floor_probe_loaded_over_quiet`` is what the machine
itself allows a one-thread job beside the busy processes (2/3 of a core on 2 fair cores: 1.5 x, more
where the 2 vCPUs are hyperthreads of one core), and ``loaded_over_quiet_over_floor`` the app's
ratio over that floor. The app runs quiet with more threads than loaded (one per free core), so the
same probe is also timed with the thread count the app chose in each run:
``floor_app_threads_loaded_over_quiet`` is what the machine allows a job that parallelises as well as
the probe, run with the app's choices (quiet: every core; loaded: its fair share), and
``loaded_over_quiet_over_app_threads_floor`` the app's ratio over it.

``--quick`` trains 10 batches of one epoch (one validation batch, no test, no checkpoint): its
``*_train_s`` and ratios are a smoke run's, a couple of seconds each, far noisier than the full run's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import header, line, load_line, median  # noqa: E402

SPIN = "while True:\n    pass\n"
# The machine's own floor: a fixed one-thread torch workload (a small conv net's forward and
# backward, as the app's), timed inside the process so start-up does not count.
PROBE = """
import time, torch
torch.set_num_threads(THREADS)
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(32, 32, 3, padding=1),
                          torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10))
x = torch.randn(64, 3, 32, 32)
net(x).sum().backward()
t = time.perf_counter()
for _ in range(ITERS):
    net(x).sum().backward()
print(time.perf_counter() - t)
"""


def _busy(count: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]


def _train(args: list[str], out: Path, threads: int | None) -> tuple[float, str]:
    """Run train.py; return (training seconds, the app's thread line)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={out}", "trainer.enable_progress_bar=false"],
        cwd=out.parent, env=env, capture_output=True, text=True, timeout=3600,
    )
    if proc.returncode != 0:
        raise SystemExit(f"train.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    chosen = re.search(r"torch threads: .*", proc.stdout + proc.stderr)
    return float(json.loads((out / "metrics.json").read_text())["wall_s"]), chosen.group(0) if chosen else "n/a"


def _probe(iters: int, threads: int = 1) -> float:
    """Seconds of the probe workload with ``threads`` torch threads (1: the floor a one-thread run can reach)."""
    code = PROBE.replace("ITERS", str(iters)).replace("THREADS", str(threads))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _app_threads(chosen: str) -> int | None:
    """The torch threads per process the app reported (``torch threads: N per process ...``)."""
    found = re.search(r"torch threads: (\d+) per process", chosen)
    return int(found.group(1)) if found else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 batches of 1 epoch instead of the recipe's 8 epochs")
    parser.add_argument("--rounds", type=int, default=1, help="quiet/loaded pairs, interleaved")
    parser.add_argument("--fixed-threads", type=int, default=None,
                        help="also run loaded with this OMP_NUM_THREADS (the thread count before the app chose it)")
    parser.add_argument("--probe-iters", type=int, default=None,
                        help="iterations of the one-thread probe run quiet and loaded in every round "
                             "(0: skip; default 60, quick 10)")
    parser.add_argument("--out", type=Path, default=None, help="also write the output lines to this file")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quick = ["+trainer.limit_train_batches=10", "+trainer.limit_val_batches=1", "run_test=false", "checkpoint=false"]
    train_args = ["trainer.max_epochs=1", *quick] if args.quick else []
    if args.probe_iters is None:
        args.probe_iters = 10 if args.quick else 60
    lines = [header(f"train under load: `python train.py {' '.join(train_args)}` quiet vs beside {cores} busy "
                    f"processes, {args.rounds} interleaved round(s)"), load_line("start")]
    print("\n".join(lines), flush=True)
    if args.out is not None:  # written as it goes: a run stopped early keeps its finished rounds
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    times: dict[str, list[float]] = {"quiet": [], "loaded": [], "loaded_fixed": [], "probe_quiet": [],
                                     "probe_loaded": [], "probe_app_threads_quiet": [], "probe_app_threads_loaded": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for kind in ("quiet", "loaded", *(["loaded_fixed"] if args.fixed_threads else [])):
                spinners = _busy(cores) if kind != "quiet" else []
                try:
                    time.sleep(1.0 if spinners else 0.0)  # the spinners running before the app measures the cores
                    seconds, chosen = _train(train_args, Path(tmp) / f"{kind}{r}",
                                             args.fixed_threads if kind == "loaded_fixed" else None)
                    if args.probe_iters and kind != "loaded_fixed":  # beside the same spinners
                        times[f"probe_{kind}"].append(_probe(args.probe_iters))
                        chosen += f"; one-thread probe {times[f'probe_{kind}'][-1]:.2f} s"
                        threads = _app_threads(chosen)
                        if threads is not None:  # the probe as the app ran: its thread count, same spinners
                            times[f"probe_app_threads_{kind}"].append(_probe(args.probe_iters, threads))
                            chosen += f"; {threads}-thread probe {times[f'probe_app_threads_{kind}'][-1]:.2f} s"
                finally:
                    for p in spinners:
                        p.kill()
                        p.wait()
                times[kind].append(seconds)
                text = f"# round {r} {kind}: {seconds:.1f} s training; {chosen}; {load_line('end of run')[2:]}"
                print(text, flush=True)
                lines.append(text)
                if args.out is not None:
                    with args.out.open("a") as out:
                        out.write(text + "\n")
    for kind, values in times.items():
        if values:
            lines.append(line(f"{kind}_train_s", median(values), "s"))
    lines.append(line("loaded_over_quiet", median(times["loaded"]) / median(times["quiet"]), "x"))
    if times["probe_quiet"]:
        floor = median(times["probe_loaded"]) / median(times["probe_quiet"])
        lines.append(line("floor_probe_loaded_over_quiet", floor, "x"))
        ratio = median(times["loaded"]) / median(times["quiet"])
        lines.append(line("loaded_over_quiet_over_floor", ratio / floor, "x"))
    if times["probe_app_threads_quiet"] and times["probe_app_threads_loaded"]:
        floor = median(times["probe_app_threads_loaded"]) / median(times["probe_app_threads_quiet"])
        lines.append(line("floor_app_threads_loaded_over_quiet", floor, "x"))
        ratio = median(times["loaded"]) / median(times["quiet"])
        lines.append(line("loaded_over_quiet_over_app_threads_floor", ratio / floor, "x"))
    if times["loaded_fixed"]:
        lines.append(line(f"loaded_{args.fixed_threads}_threads_over_quiet",
                          median(times["loaded_fixed"]) / median(times["quiet"]), "x"))
    lines.append(load_line("end"))
    print(lines[-1], flush=True)
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
