"""``free_ports``: the ports a test gives one server's listeners must differ."""

from kvrelay.cluster.launcher import free_ports


def test_free_ports_are_distinct_even_when_many_are_asked_for() -> None:
    for _ in range(20):  # free_port() twice answered the same port now and then
        ports = free_ports(8)
        assert len(ports) == 8 and len(set(ports)) == 8
        assert all(1024 <= port <= 65535 for port in ports)
