"""A peer dies (SIGKILL) mid-epoch or mid-communication, or hangs (SIGSTOP): every other rank fails
loudly and in time, naming the lost rank and the strategy, leaves no process behind and does not
hang at teardown.

For each of ring, ps, ps_ring, async, pipeline and Lightning's ddp, a tiny fit (``_peer_death_fit``) runs on
2 CPU processes, each its own "node" (``num_nodes=2, devices=1``, ``LOCAL_RANK=0``), so no launcher
or agent stops a survivor for us: whatever it does, the strategy does. The ranks are forked from a
pre-imported zygote (``fault_utils``), ~0.2 s per rank instead of ~5 s of imports. The victim:

- ``step``: SIGKILLs itself at the start of step 3 (mid-epoch: 4 steps per epoch);
- ``comm``: SIGKILLs itself inside the strategy's communication of step 3, while its peers are in
  theirs (ring all-reduce, a DDP comm hook, a shard serving a push RPC, a pipeline stage's
  backward while stage 0 waits for the gradient; ``_peer_death_fit`` has the details);
- ``hang``: SIGSTOPs itself at the start of step 3 (its sockets stay open, its heartbeat stops):
  only the strategy's ``timeout`` can end the survivors' wait. Run for ring (its own process group; ps_ring's
  ring calls are the same code, on a group of their own, and its hang is not run again here: CI's time),
  pipeline (the device mesh's groups) and async (RPC, whose timeout is ``timeout`` + 5 s).
- ``freeze``: the same SIGSTOP under a ``timeout`` of ``FREEZE_TIMEOUT_S`` (60 s) and a heartbeat
  watch grace of ``FREEZE_WATCH_S`` (3 s): the watch ends the survivors' wait by aborting their
  communication (gloo: their TCP connections shut down), long before the timeout. Run for ring,
  ps (RPC), pipeline and Lightning's ddp (through ``PeerFailureReport``).

Two more cases: ``ddp`` on 3 ranks (both survivors name rank 1 and not each other: the second
survivor to fail sees the first one's error reported as such, not as a loss), and ``async`` losing
rank 0, which hosts the store, the RPC rendezvous and the async coordinator (the survivor names
rank 0 because the store no longer answers).

What each case asserts, from the zygote's record of every rank's exit and each rank's timeline
(``_peer_death_fit._Timeline``: when the failure reached the diagnosis, when it was named, when
the interpreter began to exit):

- the victim died (or froze) where the case meant (its ``killed.json``);
- every survivor exited with code 1; it noticed a SIGKILLed peer before ``timeout`` (closed
  connections) and a frozen one not before 0.9 x ``timeout`` (so the strategy's own ``timeout``,
  not the 30-minute default, ended the wait), or under ``freeze`` within the watch's grace + a poll
  + ``SLACK_S`` (the watch ended it); it named the loss within ``timeout`` (+ 5 s for
  async's RPC) + the diagnosis (2.5 s) + ``SLACK_S``; its teardown took less than ``SLACK_S``
  (half the SIGKILL cases' ``timeout``: no wait for the dead peer); and its process was gone
  within ``EXIT_MARGIN_S`` more (interpreter exit is slow on a loaded machine, never a hang);
- every survivor's output names the loss as ``"<strategy>: lost peer rank <victim> of <world>:"``
  (the diagnosis of :mod:`lightning_strategies.comm.heartbeat`) and names no survivor as lost;
- no process is left in the zygote's session, and the zygote had to kill no rank (a hang at
  teardown or at interpreter exit would show as a timeout there).

Timing: ``TIMEOUT_S`` (10 s) is the strategies' ``timeout`` in the SIGKILL cases, ``HANG_TIMEOUT_S``
(10 s too) in the SIGSTOP ones. The timeout bounds every wait of a healthy rank too (the join, each
collective), and with 3 s a peer delayed by load on 2 cores failed the ``hang`` cases before the kill
(a join's connect and a collective's recv "timed out after 3000ms", seen at -n 2 beside the tensor
tests). The cases run ``PARALLEL`` at a time: a case mostly waits (heartbeats,
timeouts) rather than computes.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from dist_utils import reserved_port
from fault_utils import Job, Zygote

import lightning_strategies.faults as faults

pytestmark = pytest.mark.slow

TIMEOUT_S = 10.0
HANG_TIMEOUT_S = 10.0  # no shorter: see the module docstring's Timing
FREEZE_TIMEOUT_S = 60.0
FREEZE_WATCH_S = 3.0  # the watch polls every second: it notices by FREEZE_WATCH_S + 1 s
ASYNC_RPC_MARGIN_S = 5.0  # comm.ps: RPCs time out after timeout + max(5 s, 10%)
DIAGNOSIS_S = faults.GRACE_INTERVALS * faults.DEFAULT_INTERVAL  # watching a silent peer's heartbeat
SLACK_S = 5.0  # scheduling on a loaded machine; half the SIGKILL cases' timeout, so no timeout fits in it
EXIT_MARGIN_S = 20.0  # interpreter exit took up to 23 s at load 15 on 2 vCPUs (1 s when quiet)
PARALLEL = 4  # cases at a time
STEP = 3
LABELS = {"ring": "ring", "ps": "parameter_server", "async": "async", "pipeline": "pipeline", "ddp": "ddp",
          "ps_hier": "parameter_server", "async_hier": "async", "ps_ring": "ps_ring"}  # fmt: skip
# (strategy, fault, world size, victim); the longest first, as they run PARALLEL at a time
CASES = [
    *[(name, "hang", 2, 1) for name in ("async", "ring", "pipeline")],
    *[(name, "freeze", 2, 1) for name in ("ring", "ps", "pipeline", "ddp")],
    *[(name, fault, 2, 1) for name in LABELS if not name.endswith("_hier") for fault in ("step", "comm")],
    ("ddp", "step", 3, 1),
    ("async", "step", 2, 0),
]


@dataclass(frozen=True)
class Outcome:
    """What the zygote recorded for one case, and where its files are."""

    answer: dict[str, Any]
    out: Path


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str, int, int], Outcome]]:
    yield from run_cases(tmp_path_factory, CASES)


def run_cases(
    tmp_path_factory: pytest.TempPathFactory, cases: list[tuple[str, str, int, int]]
) -> Iterator[dict[tuple[str, str, int, int], Outcome]]:
    """Every case, ``PARALLEL`` at a time: a case mostly waits (heartbeats, timeouts), not computes."""
    zygote = Zygote(["_peer_death_fit"], tmp_path_factory.mktemp("zygote") / "zygote.log")
    try:
        dirs = {case: tmp_path_factory.mktemp("-".join(map(str, case))) for case in cases}
        jobs = [_job(*case, dirs[case]) for case in cases]
        start = time.monotonic()
        answers = zygote.run_many(jobs, parallel=PARALLEL)
        print(f"\n{len(cases)} peer-death cases, {PARALLEL} at a time: {time.monotonic() - start:.1f} s")
        assert zygote.leftovers() == [], "processes left in the zygote's session after every case ended"
        yield {case: Outcome(answer, dirs[case]) for case, answer in zip(cases, answers, strict=True)}
    finally:
        zygote.close()
        assert zygote.leftovers() == [], "processes left in the zygote's session after it closed"


def _timeout_s(fault: str) -> float:
    return {"hang": HANG_TIMEOUT_S, "freeze": FREEZE_TIMEOUT_S}.get(fault, TIMEOUT_S)


def _job(name: str, fault: str, world: int, victim: int, out: Path) -> Job:
    timeout_s = _timeout_s(fault)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(reserved_port()), "WORLD_SIZE": str(world),
           "NODE_RANK": "{rank}", "LOCAL_RANK": "0"}  # fmt: skip
    kwargs = {"strategy": name, "fault": fault, "victim": victim, "step": STEP, "timeout_s": timeout_s,
              "out_dir": str(out), "watch_grace_s": FREEZE_WATCH_S if fault == "freeze" else None}  # fmt: skip
    return Job("_peer_death_fit:run_rank", world, env, kwargs, out, timeout=120.0,
               kill_stopped=fault in ("hang", "freeze"))  # fmt: skip


def _events(path: Path) -> dict[str, float]:
    """The first time of each event of a rank's timeline (``_peer_death_fit._Timeline``)."""
    events: dict[str, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            event = json.loads(line)
            events.setdefault(event["event"], event["time"])
    return events


@pytest.mark.parametrize(
    ("name", "fault", "world", "victim"), CASES, ids=[f"{n}-{f}-{w}ranks-victim{v}" for n, f, w, v in CASES]
)
def test_survivors_fail_in_time_naming_the_lost_rank(
    outcomes: dict[tuple[str, str, int, int], Outcome], name: str, fault: str, world: int, victim: int
) -> None:
    assert_survivors_named_the_loss(outcomes[(name, fault, world, victim)], name, fault, world, victim)


def assert_survivors_named_the_loss(outcome: Outcome, name: str, fault: str, world: int, victim: int) -> None:
    """What every case asserts (the module docstring's list)."""
    answer, out = outcome.answer, outcome.out
    timeout_s = _timeout_s(fault)
    ranks: dict[int, Any] = answer["ranks"]
    logs = {r: (out / f"rank{r}.log").read_text(errors="replace") for r in range(world)}
    context = "\n".join(f"--- rank {r} (exit {ranks[r]['returncode']}):\n{logs[r][-4000:]}" for r in logs)
    assert answer["timed_out"] == [], f"ranks {answer['timed_out']} hung and were killed\n{context}"

    assert (out / "killed.json").exists(), f"rank {victim} never reached the kill point\n{context}"
    killed = json.loads((out / "killed.json").read_text())
    assert killed["rank"] == victim, killed
    # "comm" arms at STEP and fires at the first communication after it: for async, whose ranks
    # step independently, a peer's push may first reach the victim's shard a step later
    assert killed["step"] == STEP or (fault == "comm" and killed["step"] > STEP), killed
    assert ranks[victim]["returncode"] == -9, context  # SIGKILL, or the zygote's after SIGSTOP
    label = LABELS[name]
    # the strategy's own bound on noticing the fault: RPCs to a frozen async shard wait a little longer
    wait_s = timeout_s + (ASYNC_RPC_MARGIN_S if name == "async" and fault == "hang" else 0.0)
    if fault == "freeze":  # the watch's bound: silent for its grace, noticed at its next poll
        wait_s = FREEZE_WATCH_S + faults.DEFAULT_INTERVAL
    survivors = [r for r in range(world) if r != victim]
    for r in survivors:
        events = {k: t - killed["time"] for k, t in _events(out / f"rank{r}.events").items()}
        noticed, diagnosed, exiting = (events.get(k, float("nan")) for k in ("diagnose", "diagnosed", "exit"))
        exited = ranks[r]["exit_time"] - killed["time"]
        print(
            f"{name}/{fault}/{world} ranks/victim {victim}: rank {r} noticed the loss after {noticed:.2f} s, named "
            f"it after {diagnosed:.2f} s, tore down by {exiting:.2f} s, exited {ranks[r]['returncode']} after "
            f"{exited:.2f} s (CPU {ranks[r]['cpu_s']:.1f} s; case {answer['wall_s']:.1f} s)"
        )
        assert ranks[r]["returncode"] == 1, context
        if fault == "hang":
            assert noticed >= 0.9 * timeout_s, context  # the strategy's timeout ended the wait
        elif fault == "freeze":
            # the watch ended it: its grace runs from the victim's last beat, up to an interval before the stop
            assert FREEZE_WATCH_S - faults.DEFAULT_INTERVAL <= noticed < wait_s + SLACK_S < timeout_s, context
        else:
            assert noticed < timeout_s, context  # closed connections, not a timeout
        assert diagnosed < wait_s + DIAGNOSIS_S + SLACK_S, context
        assert exiting - diagnosed < SLACK_S, context  # teardown waited for no dead peer (nor a timeout)
        assert exited < wait_s + DIAGNOSIS_S + EXIT_MARGIN_S, context
        assert f"{label}: lost peer rank {victim} of {world}:" in logs[r], context
        named = {int(n) for m in re.findall(rf"{label}: lost peer ranks? ([\d, ]+) of", logs[r]) for n in m.split(",")}
        assert named == {victim}, f"rank {r} named {sorted(named)} as lost; {survivors} survived\n{context}"
