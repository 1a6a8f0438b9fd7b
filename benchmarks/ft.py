"""ft / local_sgd / diloco on torchft: DiLoCo's all-reduce bytes, the stall after a kill, the rejoin.

Lines (``name value unit``):

    diloco_allreduce_bytes_over_ddp  payload bytes DiLoCo hands to its all-reduces over those of ``ft``
                                     (one gradient all-reduce per step, as DDP) for the same steps;
                                     goal 1/H within 2% (accounting: what is all-reduced, not the wire)
    diloco_sync_every                H of that run
    ft_heartbeat_timeout_s           the Lighthouse's heartbeat timeout of the kill case
    ft_stall_s_after_kill            replica 0: from replica 1's SIGKILL (its own stamp) to replica 0's
                                     first step committed without it, median over rounds (+ _max);
                                     goal <= the heartbeat timeout + 1 s
    ft_step_s                        replica 0's median step interval before the kill (for scale)
    ft_rejoin_s                      the restarted replica: from its process start (a fresh
                                     interpreter: imports included) to its first committed step, median

Full mode runs the Lightning strategy: ``tests/integration/_ft_fit.py`` (TinyRegressor, 2 replicas,
each a process started by the strategy's launcher, CPU/gloo) for ``ft`` and ``diloco`` (H = 10,
40 steps each) and ``--rounds`` kill cases (replica 1 SIGKILLs itself at its step 3, replica 0
goes on alone at 0.5 s per step until the restart joins). ``--quick`` (CI, seconds) measures the
bytes lines only, with two replica threads in this process over ``lightning_strategies.comm.ft``
directly (a Lighthouse, two Managers, the outer loop), no Lightning.

    python benchmarks/ft.py                # ~3 min at load 5; writes benchmarks/results/ft.txt
    python benchmarks/ft.py --quick        # seconds, prints only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO)]

from benchmarks._common import header, line, load_line  # noqa: E402

SCRIPT = REPO / "tests" / "integration" / "_ft_fit.py"
H = 10
STEPS = 40
HEARTBEAT_S = 1.0
FAST = {"heartbeat_timeout_s": HEARTBEAT_S, "join_timeout_s": 0.5, "quorum_timeout_s": 60.0, "step_timeout_s": 20.0}


def run_case(out: Path, **cfg: Any) -> dict[tuple[int, int], dict[str, Any]]:
    out.mkdir(parents=True)
    cfg = {"out": str(out), "replicas": 2, "n": 64, "batch_size": 8, **cfg}
    cfg["strategy"] = {**FAST, **cfg.get("strategy", {})}
    (out / "case.json").write_text(json.dumps(cfg))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]), OMP_NUM_THREADS="1")
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out / "case.json")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{out.name}: exit {proc.returncode}\n{proc.stderr[-4000:]}")
    records = {}
    for path in out.glob("replica*_*.pt"):
        replica, start = path.stem.removeprefix("replica").split("_")
        records[(int(replica), int(start))] = torch.load(path, weights_only=False)
    return records


def bytes_lightning(tmp: Path) -> float:
    ft = run_case(tmp / "bytes_ft", max_steps=STEPS, strategy={"min_replicas": 2})
    diloco = run_case(tmp / "bytes_diloco", algorithm="diloco", max_steps=STEPS, optimizer="adamw",
                      strategy={"min_replicas": 2, "sync_every": H})  # fmt: skip
    return float(diloco[(0, 0)]["allreduce_bytes"] / ft[(0, 0)]["allreduce_bytes"])


def bytes_threads() -> float:
    """Both algorithms' bytes from two replica threads over comm.ft (no Lightning)."""
    from lightning_strategies.comm.ft import (
        OuterLoop,
        ReplicaConfig,
        ReplicaGroup,
        average_and_commit,
        start_lighthouse,
    )

    lighthouse = start_lighthouse(min_replicas=2, heartbeat_timeout_s=HEARTBEAT_S, join_timeout_s=0.5)
    totals: dict[tuple[str, int], int] = {}

    def replica(rank: int) -> None:
        group = ReplicaGroup(
            ReplicaConfig(min_replicas=2), lighthouse=lighthouse.address, replica_id=f"replica_{rank}",
            device=torch.device("cpu"), hostname="127.0.0.1",
        )  # fmt: skip
        params = [torch.nn.Parameter(torch.randn(64, 32)), torch.nn.Parameter(torch.randn(32))]
        group.register("params", lambda s: None, lambda: [p.detach() for p in params])
        outer = OuterLoop(params, sync_every=H)
        try:
            for algorithm in ("ft", "diloco"):
                sent = 0
                for step in range(STEPS + 1):
                    fragment = outer.due(step)
                    if algorithm == "ft" and step < STEPS:
                        group.start_quorum()
                        grads = [torch.randn_like(p) for p in params]
                        _, stats = average_and_commit(group.manager, partial(list, grads), attempts=3,
                                                      requorum=group.start_quorum)  # fmt: skip
                        sent += stats.bytes
                    elif algorithm == "diloco" and fragment is not None:
                        group.start_quorum()
                        flat, stats = average_and_commit(group.manager, partial(outer.tensors, fragment),
                                                         attempts=3, requorum=group.start_quorum)  # fmt: skip
                        outer.apply(fragment, flat)
                        sent += stats.bytes
                    with torch.no_grad():  # an inner step
                        for p in params:
                            p.add_(torch.randn_like(p), alpha=0.01)
                totals[(algorithm, rank)] = sent
        finally:
            group.shutdown()

    threads = [threading.Thread(target=replica, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    lighthouse.shutdown()
    return totals[("diloco", 0)] / totals[("ft", 0)]


def kill_rounds(tmp: Path, rounds: int) -> tuple[list[float], list[float], list[float]]:
    stalls, steps, rejoins = [], [], []
    for i in range(rounds):
        out = tmp / f"kill{i}"
        records = run_case(out, max_steps=STEPS, kill=[1, 3], sleep_alone_s=0.5)
        killed = json.loads((out / "killed.json").read_text())["time"]
        survivor, restarted = records[(0, 0)], records[(1, 1)]
        times = survivor["commit_times"]
        before = [t for t in times if t < killed]
        # the first step committed without the dead replica (a commit just after the kill may be of
        # the step both had finished)
        alone = [t for t, n in zip(times, survivor["participants"], strict=True) if t > killed and n == 1]
        stalls.append(alone[0] - killed)
        steps.append(statistics.median(b - a for a, b in pairwise(before)))
        rejoins.append(restarted["t_first"] - restarted["t0"])
    return stalls, steps, rejoins


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the bytes lines from replica threads (seconds)")
    parser.add_argument("--rounds", type=int, default=3, help="kill cases (full mode)")
    args = parser.parse_args()
    out_lines = [header("ft: torchft fault tolerance and DiLoCo"), load_line("start")]
    print("\n".join(out_lines), flush=True)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        ratio = bytes_threads() if args.quick else bytes_lightning(tmp)
        out_lines.append(line("diloco_allreduce_bytes_over_ddp", ratio, "x"))
        out_lines.append(line("diloco_sync_every", H, "steps"))
        if not args.quick:
            stalls, steps, rejoins = kill_rounds(tmp, args.rounds)
            out_lines.append(line("ft_heartbeat_timeout_s", HEARTBEAT_S, "s"))
            out_lines.append(line("ft_stall_s_after_kill", statistics.median(stalls), "s"))
            out_lines.append(line("ft_stall_s_after_kill_max", max(stalls), "s"))
            out_lines.append(line("ft_step_s", statistics.median(steps), "s"))
            out_lines.append(line("ft_rejoin_s", statistics.median(rejoins), "s"))
            out_lines.append(line("ft_rejoin_s_max", max(rejoins), "s"))
    out_lines.append(load_line("end"))
    print(out_lines[-1], flush=True)
    if not args.quick:
        path = REPO / "benchmarks" / "results" / "ft.txt"
        path.write_text("\n".join(out_lines) + "\n")
        print(f"# written: {path}")


if __name__ == "__main__":
    main()
