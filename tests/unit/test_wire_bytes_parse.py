"""benchmarks/wire_bytes.py: ``ss -tinpH`` parsing and the per-worker sums, on canned output."""

from __future__ import annotations

import pytest

from benchmarks.wire_bytes import parse_ss, traffic

# Two workers (pids 11, 12) joined by one connection, rank 1's store client talking to the store
# on port 5000 inside rank 0 (IPv6-mapped addresses, as TCPStore opens them), and a connection of
# a process we did not start (pid 99). A counter still at 0 is absent, as ss prints it.
BEFORE = """\
ESTAB 0      0               127.0.0.1:43279          127.0.0.1:52182 users:(("python",pid=12,fd=18))
\t bbr wscale:10,10 rto:204 mss:65483 bytes_sent:1000 bytes_acked:1001 bytes_received:2000 segs_out:12
ESTAB 0      0               127.0.0.1:52182          127.0.0.1:43279 users:(("python",pid=11,fd=27))
\t bbr wscale:10,10 rto:204 mss:65483 bytes_sent:2000 bytes_acked:2001 bytes_received:1000 segs_out:12
ESTAB 0      0      [::ffff:127.0.0.1]:5000 [::ffff:127.0.0.1]:45086 users:(("python",pid=11,fd=21))
\t bbr wscale:10,10 bytes_sent:300 bytes_acked:301 bytes_received:500
ESTAB 0      0      [::ffff:127.0.0.1]:45086 [::ffff:127.0.0.1]:5000 users:(("python",pid=12,fd=20))
\t bbr wscale:10,10 bytes_sent:500 bytes_acked:501 bytes_received:300
ESTAB 0      0               127.0.0.1:7000           127.0.0.1:7001 users:(("python",pid=99,fd=3))
\t bbr bytes_sent:5 bytes_received:5
ESTAB 0      0               127.0.0.1:7001           127.0.0.1:7000 users:(("python",pid=99,fd=4))
\t bbr rto:204
"""

AFTER = """\
ESTAB 0      0               127.0.0.1:43279          127.0.0.1:52182 users:(("python",pid=12,fd=18))
\t bbr wscale:10,10 rto:204 mss:65483 bytes_sent:7000 bytes_acked:7001 bytes_retrans:400 bytes_received:4000
ESTAB 0      0               127.0.0.1:52182          127.0.0.1:43279 users:(("python",pid=11,fd=27))
\t bbr wscale:10,10 rto:204 mss:65483 bytes_sent:4000 bytes_acked:4001 bytes_received:7000
ESTAB 0      0      [::ffff:127.0.0.1]:5000 [::ffff:127.0.0.1]:45086 users:(("python",pid=11,fd=21))
\t bbr wscale:10,10 bytes_sent:400 bytes_acked:401 bytes_received:600
ESTAB 0      0      [::ffff:127.0.0.1]:45086 [::ffff:127.0.0.1]:5000 users:(("python",pid=12,fd=20))
\t bbr wscale:10,10 bytes_sent:600 bytes_acked:601 bytes_received:400
ESTAB 0      0               127.0.0.1:7000           127.0.0.1:7001 users:(("python",pid=99,fd=3))
\t bbr bytes_sent:9005 bytes_received:5
ESTAB 0      0               127.0.0.1:7001           127.0.0.1:7000 users:(("python",pid=99,fd=4))
\t bbr rto:204
"""


def test_parse_ss_reads_owner_counters_and_normalises_addresses() -> None:
    sockets = parse_ss(AFTER)
    assert len(sockets) == 6
    end = sockets[("127.0.0.1:5000", "127.0.0.1:45086")]  # the ::ffff: prefix and brackets dropped
    assert (end.pid, end.sent, end.received, end.retrans) == (11, 400, 600, 0)
    assert sockets[("127.0.0.1:43279", "127.0.0.1:52182")].retrans == 400
    idle = sockets[("127.0.0.1:7001", "127.0.0.1:7000")]
    assert (idle.sent, idle.received) == (0, 0)  # absent counters are 0


def test_traffic_sums_worker_links_per_step_apart_from_store_and_strangers() -> None:
    got = traffic(parse_ss(BEFORE), parse_ss(AFTER), pids=[11, 12], store_ports={"5000"}, steps=2)
    # rank 0 (pid 11): 4000 - 2000 sent; rank 1 (pid 12): 7000 - 1000 sent, of which 400 resent
    assert got.sent == [1000.0, (6000 - 400) / 2]
    assert got.received == [3000.0, 1000.0]
    assert got.retrans == 200.0
    assert got.store == (100 + 100 + 100 + 100) / 2  # both ends, both directions
    assert got.connections == 2  # pid 99's sockets are not ours


def test_traffic_refuses_a_connection_closed_between_readings() -> None:
    after = "\n".join(AFTER.splitlines()[2:])  # the worker link's rank-1 end is gone
    with pytest.raises(RuntimeError, match="closed between the readings"):
        traffic(parse_ss(BEFORE), parse_ss(after), pids=[11, 12], store_ports={"5000"}, steps=1)
