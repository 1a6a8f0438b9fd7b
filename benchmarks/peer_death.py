"""Peer death: how long each survivor takes to notice a lost peer, name it and be gone.

The timings of README's "When a peer dies" table. The cases and the harness are those of
``tests/integration/test_peer_death.py`` (which asserts the behaviour; this script only times it):
for each of ring, ps, async, pipeline and Lightning's ddp (with ``PeerFailureReport``), a tiny fit
(``tests/integration/_peer_death_fit.py``) runs on 2 CPU processes, each its own "node", forked
from a pre-imported zygote (``tests/fault_utils.py``), and the victim, rank 1 unless said:

    kill_step   SIGKILLs itself at the start of training step 3 (mid-epoch)
    kill_comm   SIGKILLs itself inside the strategy's communication of step 3, its peers in theirs
    stop        SIGSTOPs itself at the start of step 3 (sockets open, heartbeat silent): only the
                strategy's ``timeout`` ends the wait (ring, pipeline, async)
    freeze      the same SIGSTOP under a 60 s ``timeout`` and a 3 s heartbeat watch grace: the
                watch aborts the survivors' communication (ring, ps, pipeline, ddp)

plus ddp on 3 ranks (kill_step) and async losing rank 0 (the store's host; kill_step). The
strategies' ``timeout`` is 10 s in the SIGKILL cases and 3 s in the SIGSTOP ones (as the test's).
Seconds after the victim's signal (its ``killed.json`` stamp), per survivor, from its timeline
(``_peer_death_fit._Timeline``) and the zygote's reaping:

    peer_death_<case>_noticed_s   the failure reached the diagnosis (the heartbeat watch begins)
    peer_death_<case>_named_s     the diagnosis is done: the error naming the lost rank is raised
    peer_death_<case>_exited_s    the survivor's process has exited (teardown + interpreter exit)

each as the median over rounds and survivors, with ``_min`` and ``_max`` lines, and

    peer_death_survivors_ok       survivors that exited 1 naming exactly the victim, over all
                                  survivors (1 when every case behaved as the test requires)

Cases run ``--parallel`` at a time (they mostly wait on heartbeats and timeouts); on a loaded
2-core machine the exit times (interpreter exit) grow with the load, printed at start and end.

    python benchmarks/peer_death.py              # 19 cases x 2 rounds, 2 at a time (~4 min at load 10)
    python benchmarks/peer_death.py --quick      # ring kill_step, 1 round (CI, ~1 min at load 10)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "integration")]

from benchmarks._common import header, line, load_line, median  # noqa: E402
from benchmarks._workers import reserved_port  # noqa: E402

TIMEOUT_S = 10.0  # the strategies' timeout in the SIGKILL cases (test_peer_death.TIMEOUT_S)
HANG_TIMEOUT_S = 3.0  # ... and in the SIGSTOP ones
FREEZE_TIMEOUT_S, FREEZE_WATCH_S = 60.0, 3.0  # ... and in the watched ones (test_peer_death's)
STEP = 3
LABELS = {"ring": "ring", "ps": "parameter_server", "async": "async", "pipeline": "pipeline", "ddp": "ddp"}
FAULTS = {"step": "kill_step", "comm": "kill_comm", "hang": "stop", "freeze": "stop_watched"}
# (strategy, fault, world size, victim), the longest first; test_peer_death's cases
CASES = [
    *[(name, "hang", 2, 1) for name in ("async", "ring", "pipeline")],
    *[(name, "freeze", 2, 1) for name in ("ring", "ps", "pipeline", "ddp")],
    *[(name, fault, 2, 1) for name in LABELS for fault in ("step", "comm")],
    ("ddp", "step", 3, 1),
    ("async", "step", 2, 0),
]


def case_name(name: str, fault: str, world: int, victim: int) -> str:
    """``ring_kill_step``, ``ddp_kill_step_3ranks``, ``async_kill_step_victim0``."""
    return (
        f"{name}_{FAULTS[fault]}"
        + (f"_{world}ranks" if world != 2 else "")
        + (f"_victim{victim}" if victim != 1 else "")
    )


def _job(case: tuple[str, str, int, int], out: Path) -> Any:
    from fault_utils import Job

    name, fault, world, victim = case
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(reserved_port()), "WORLD_SIZE": str(world),
           "NODE_RANK": "{rank}", "LOCAL_RANK": "0"}  # fmt: skip
    timeout_s = {"hang": HANG_TIMEOUT_S, "freeze": FREEZE_TIMEOUT_S}.get(fault, TIMEOUT_S)
    kwargs = {"strategy": name, "fault": fault, "victim": victim, "step": STEP, "timeout_s": timeout_s,
              "out_dir": str(out), "watch_grace_s": FREEZE_WATCH_S if fault == "freeze" else None}  # fmt: skip
    return Job("_peer_death_fit:run_rank", world, env, kwargs, out, timeout=120.0,
               kill_stopped=fault in ("hang", "freeze"))  # fmt: skip


def _first_events(path: Path) -> dict[str, float]:
    events: dict[str, float] = {}
    if path.exists():
        for text in path.read_text().splitlines():
            event = json.loads(text)
            events.setdefault(event["event"], event["time"])
    return events


def measure(case: tuple[str, str, int, int], answer: dict[str, Any], out: Path) -> list[dict[str, float | bool]]:
    """Per survivor: seconds from the victim's signal to noticed / named / exited, and whether it
    exited 1 naming exactly the victim."""
    name, _, world, victim = case
    killed_file = out / "killed.json"
    if not killed_file.exists():
        print(f"# {case_name(*case)}: the victim never reached its fault (no killed.json)", flush=True)
        return []
    killed = json.loads(killed_file.read_text())["time"]
    label = LABELS[name]
    rows: list[dict[str, float | bool]] = []
    for r in (r for r in range(world) if r != victim):
        events = _first_events(out / f"rank{r}.events")
        log = (out / f"rank{r}.log").read_text(errors="replace")
        named = {int(n) for m in re.findall(rf"{label}: lost peer ranks? ([\d, ]+) of", log) for n in m.split(",")}
        rank = answer["ranks"][r]
        rows.append(
            {
                "noticed": events.get("diagnose", float("nan")) - killed,
                "named": events.get("diagnosed", float("nan")) - killed,
                "exited": rank["exit_time"] - killed,
                "ok": rank["returncode"] == 1 and named == {victim} and r not in answer["timed_out"],
            }
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="ring kill_step only, one round")
    parser.add_argument("--rounds", type=int, default=2, help="times each case runs (default 2)")
    parser.add_argument("--parallel", type=int, default=2, help="cases at a time (default 2)")
    args = parser.parse_args(argv)
    from fault_utils import Zygote

    cases = [("ring", "step", 2, 1)] if args.quick else CASES
    rounds = 1 if args.quick else args.rounds
    print(header(f"peer death: {len(cases)} cases x {rounds} rounds, {args.parallel} at a time"), flush=True)
    print(load_line("start"), flush=True)
    rows: dict[tuple[str, str, int, int], list[dict[str, float | bool]]] = {c: [] for c in cases}
    with tempfile.TemporaryDirectory(prefix="peer_death_") as tmp:
        zygote = Zygote(["_peer_death_fit"], Path(tmp) / "zygote.log")
        try:
            for r in range(rounds):
                dirs = {c: Path(tmp) / f"round{r}" / case_name(*c) for c in cases}
                for d in dirs.values():
                    d.mkdir(parents=True)
                start = time.monotonic()
                answers = zygote.run_many([_job(c, dirs[c]) for c in cases], parallel=args.parallel)
                for case, answer in zip(cases, answers, strict=True):
                    found = measure(case, answer, dirs[case])
                    rows[case] += found
                    for row in found:
                        print(
                            f"# round {r} {case_name(*case)}: noticed {row['noticed']:.2f} s, named "
                            f"{row['named']:.2f} s, exited {row['exited']:.2f} s, ok {row['ok']}",
                            flush=True,
                        )
                print(f"# round {r}: {time.monotonic() - start:.0f} s; {load_line('now')[2:]}", flush=True)
            leftovers = zygote.leftovers()
        finally:
            zygote.close()
    for case in cases:
        for what in ("noticed", "named", "exited"):
            values = [float(x[what]) for x in rows[case] if x[what] == x[what]]  # NaN: event not reached
            if values:
                prefix = f"peer_death_{case_name(*case)}_{what}_s"
                line(prefix, median(values), "s")
                line(f"{prefix}_min", min(values), "s")
                line(f"{prefix}_max", max(values), "s")
    ok = sum(bool(x["ok"]) for found in rows.values() for x in found)
    survivors = rounds * sum(world - 1 for _, _, world, _ in cases)  # a case without its fault counts as failed
    line("peer_death_survivors_ok", ok / survivors, "fraction")
    line("peer_death_leftover_processes", len(leftovers), "processes")
    print(load_line("end"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
