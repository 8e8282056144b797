"""Free loopback port blocks for tests that start servers."""

from kvrelay.cluster.launcher import free_port, free_port_block, free_ports

__all__ = ["free_port", "free_port_block", "free_ports"]
