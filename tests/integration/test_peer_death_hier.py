"""A peer dies under the hierarchical parameter-server push, and under hierarchical async (the node is the
worker): 4 ranks on 2 "nodes" of 2 (``_peer_death_fit``'s ``ps_hier`` and ``async_hier``), the same cases and
assertions as ``test_peer_death.py``.

The victim is rank 3 (node 1, local rank 1). Its node peer, rank 2, notices it in the node's
reduce-scatter (the connection closes); rank 1 pushes to the victim's shard (the RPC fails); rank 0
pushes only to rank 2's shard, whose barrier waits for node 1's push: it learns of the loss when rank 2
fails and closes its shard with the reason. Under async_hier ranks 1 and 2 notice at once (rank 2 in its
node's collectives, rank 1 in its push to the victim's shard); node 0 has no cross-node barrier, and rank 0
noticed about 2.5 s after the kill (measured), once its node peer had failed. Every survivor must name rank 3,
and only rank 3, in time.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from test_peer_death import Outcome, assert_survivors_named_the_loss, run_cases

pytestmark = pytest.mark.slow

CASES = [(name, fault, 4, 3) for name in ("ps_hier", "async_hier") for fault in ("step", "comm")]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[tuple[str, str, int, int], Outcome]]:
    yield from run_cases(tmp_path_factory, CASES)


@pytest.mark.parametrize(
    ("name", "fault", "world", "victim"), CASES, ids=[f"{n}-{f}-{w}ranks-victim{v}" for n, f, w, v in CASES]
)
def test_survivors_name_the_lost_rank_under_the_hierarchical_push(
    outcomes: dict[tuple[str, str, int, int], Outcome], name: str, fault: str, world: int, victim: int
) -> None:
    assert_survivors_named_the_loss(outcomes[(name, fault, world, victim)], name, fault, world, victim)
