"""A peer dies under the hierarchical parameter-server push: 4 ranks on 2 "nodes" of 2
(``_peer_death_fit``'s ``ps_hier``), the same cases and assertions as ``test_peer_death.py``.

The victim is rank 3 (node 1, local rank 1). Its node peer, rank 2, notices it in the node's
reduce-scatter (the connection closes); rank 1 pushes to the victim's shard (the RPC fails); rank 0
pushes only to rank 2's shard, whose barrier waits for node 1's push: it learns of the loss when rank 2
fails and closes its shard with the reason. Every survivor must name rank 3, and only rank 3, in time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from fault_utils import Zygote
from test_peer_death import PARALLEL, Outcome, _job, assert_survivors_named_the_loss

pytestmark = pytest.mark.slow

CASES = [("ps_hier", fault, 4, 3) for fault in ("step", "comm")]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str, int, int], Outcome]]:
    zygote = Zygote(["_peer_death_fit"], tmp_path_factory.mktemp("zygote") / "zygote.log")
    try:
        dirs = {case: tmp_path_factory.mktemp("-".join(map(str, case))) for case in CASES}
        start = time.monotonic()
        answers = zygote.run_many([_job(*case, dirs[case]) for case in CASES], parallel=PARALLEL)
        print(f"\n{len(CASES)} hierarchical peer-death cases: {time.monotonic() - start:.1f} s")
        assert zygote.leftovers() == [], "processes left in the zygote's session after every case ended"
        yield {case: Outcome(answer, dirs[case]) for case, answer in zip(CASES, answers, strict=True)}
    finally:
        zygote.close()
        assert zygote.leftovers() == [], "processes left in the zygote's session after it closed"


@pytest.mark.parametrize(
    ("name", "fault", "world", "victim"), CASES, ids=[f"{n}-{f}-{w}ranks-victim{v}" for n, f, w, v in CASES]
)
def test_survivors_name_the_lost_rank_under_the_hierarchical_push(
    outcomes: dict[tuple[str, str, int, int], Outcome], name: str, fault: str, world: int, victim: int
) -> None:
    assert_survivors_named_the_loss(outcomes[(name, fault, world, victim)], name, fault, world, victim)
