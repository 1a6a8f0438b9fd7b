"""The emulated cluster: nodes as namespaces with shaped links (:mod:`.cluster`), and a launcher that
runs torchrun on it (``python -m benchmarks.emulated``, :mod:`.launch`)."""

from benchmarks.emulated.cluster import (
    ClusterUnavailableError,
    EmulatedCluster,
    EmulatedNode,
    NicCounters,
    parse_rate,
)

__all__ = ["ClusterUnavailableError", "EmulatedCluster", "EmulatedNode", "NicCounters", "parse_rate"]
