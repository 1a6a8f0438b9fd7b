"""The workload and costs the scale model's tests (tests/unit/test_scale_model_*.py) build their cases from.

Each test builds costs in which one term is isolated (every other constant 0 or infinitely fast), so
the prediction must equal the formula written out in the test. Tolerances: float arithmetic on a
handful of operations, rel=1e-12.
"""

from __future__ import annotations

import math

from lightning_strategies.advisor.model import MIB, Costs, Link, Workload

REL = 1e-12
D = 64 * MIB  # gradient bytes of the tests' workload
FAST = Link(0.0, math.inf)


def costs(**kw: object) -> Costs:
    """Every cost 0 unless given; one node of 1024 processes unless ``local_size`` is given."""
    base = Costs(
        compute_s=0.0, local_size=1024, intra=FAST, inter=FAST, bucket_bytes=math.inf, first_bucket_bytes=math.inf
    )
    return base.with_(**kw)


def one_bucket(d: float = D) -> Workload:
    return Workload(grad_bytes=d)
