"""The box's link counters read from the kernel's own text (hpcps.box.counters); the real box's drops
under incast are tested in tests/cli/test_box.py."""

import pytest

from hpcps.box import counters
from hpcps.box.counters import Counters

#: /proc/net/snmp and /proc/net/netstat, concatenated as `cat` gives them (trimmed to their Tcp lines)
SNMP = """Ip: Forwarding DefaultTTL
Ip: 1 64
Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens AttemptFails EstabResets CurrEstab InSegs OutSegs RetransSegs InErrs OutRsts InCsumErrors
Tcp: 1 200 120000 -1 8 10 0 1 14 128012 1516907 5536 0 2 0
Udp: InDatagrams NoPorts
Udp: 0 0
TcpExt: SyncookiesSent SyncookiesRecv TCPTimeouts TCPLossProbes
TcpExt: 0 0 3 12
"""

#: `tc -s -j qdisc show dev p0` on a switch port: the root tbf
TC = ('[{"kind":"tbf","handle":"89e4:","root":true,"refcnt":3,"options":{"rate":12500000,"burst":69625,'
      '"lat":35390},"bytes":2251197942,"packets":1541465,"drops":96,"overlimits":129578,"requeues":0,'
      '"backlog":0,"qlen":0}]')


def test_a_counter_is_read_from_the_values_line_under_its_names_line():
    assert counters.snmp_value(SNMP, "Tcp", "RetransSegs") == 5536
    assert counters.snmp_value(SNMP, "TcpExt", "TCPTimeouts") == 3
    with pytest.raises(KeyError):
        counters.snmp_value(SNMP, "Tcp", "NoSuchCounter")


def test_the_root_qdiscs_drops_are_the_ports_drops():
    assert counters.tbf_drops(TC) == 96
    assert counters.tbf_drops('[{"kind":"pfifo","root":false,"drops":5}]') == 0


def test_the_line_names_each_port_that_dropped_and_what_tcp_sent_again():
    change = Counters((120, 0, 7), (300, 20, 0), (1, 0, 0)) - Counters((20, 0, 0), (100, 0, 0), (0, 0, 0))
    assert change == Counters((100, 0, 7), (200, 20, 0), (1, 0, 0))
    line = counters.describe(change, 512_000)
    assert "dropped 107 packets at the ports towards node 0 100, node 2 7" in line
    assert "--buffer 512,000 bytes" in line and "sent 220 segments again (1 retransmission timeouts)" in line
    quiet = counters.describe(Counters((0, 0), (0, 0), (0, 0)), 512_000)
    assert "dropped no packets" in quiet and "sent 0 segments again" in quiet
