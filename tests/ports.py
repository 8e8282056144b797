"""Free loopback port blocks for tests that start servers."""

import socket


def free_port_block(size: int, start: int = 20000, stop: int = 60000) -> int:
    """First port ``p`` in [start, stop) such that p..p+size-1 can all be bound now."""
    port = start
    while port + size < stop:
        socks: list[socket.socket] = []
        try:
            for p in range(port, port + size):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return port
        except OSError:
            port += size + 7
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block")
