"""The Lightning side of the lost-peer diagnosis (:mod:`lightning_strategies.faults`).

The heartbeats and the diagnosis themselves are tested in ``test_heartbeat.py``.
"""

from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy

import lightning_strategies.comm.heartbeat as heartbeat
import lightning_strategies.faults as faults
from lightning_strategies import (
    AsyncParameterServerStrategy,
    ParameterServerStrategy,
    PeerLostError,
    PipelineStrategy,
    RingAllReduceStrategy,
)
from lightning_strategies.faults import strategy_label


def test_strategy_labels() -> None:
    assert strategy_label(RingAllReduceStrategy()) == "ring"
    assert strategy_label(ParameterServerStrategy()) == "parameter_server"
    assert strategy_label(AsyncParameterServerStrategy()) == "async"
    assert strategy_label(PipelineStrategy()) == "pipeline"
    assert strategy_label(DDPStrategy()) == "ddp"


def test_the_heartbeat_names_stay_importable_from_faults_and_the_package() -> None:
    for name in ("Heartbeat", "PeerDiagnosis", "PeerLostError", "annotate_peer_failure", "start_heartbeat"):
        assert getattr(faults, name) is getattr(heartbeat, name), name
    assert faults.GRACE_INTERVALS == heartbeat.GRACE_INTERVALS and faults.DEFAULT_INTERVAL == heartbeat.DEFAULT_INTERVAL
    assert PeerLostError is heartbeat.PeerLostError and issubclass(PeerLostError, RuntimeError)
