"""The network refused: every connection from this process to an address off this machine
raises OSError and is recorded. conftest.py installs it for the suite's process (the gloo ranks
and trackers' local services, on the loopback, still connect); a test of its own installs it in
a process it starts (tests/models/test_no_network.py)."""

from __future__ import annotations

import ipaddress
import socket

ATTEMPTS: list[str] = []
"""The addresses something in this process tried to reach, in order."""

_connect = socket.socket.connect
_connect_ex = socket.socket.connect_ex
_getaddrinfo = socket.getaddrinfo
_HOSTNAME = socket.gethostname()


def _local(address) -> bool:
    if not isinstance(address, tuple):  # a Unix socket's path
        return True
    host = str(address[0]).split("%")[0]
    if host in ("localhost", "", _HOSTNAME):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, not an address: resolved off this machine
        return False


def _refused(address) -> OSError:
    ATTEMPTS.append(repr(address))
    return OSError(f"the network is refused in the test suite (a connection to {address!r})")


def _guarded_connect(self, address):
    if not _local(address):
        raise _refused(address)
    return _connect(self, address)


def _guarded_connect_ex(self, address):
    if not _local(address):
        raise _refused(address)
    return _connect_ex(self, address)


def _guarded_getaddrinfo(host, port, *args, **kwargs):
    name = host.decode() if isinstance(host, bytes) else host
    if name is not None and not _local((name, port)):  # a name looked up is a name reached
        raise socket.gaierror(socket.EAI_NONAME, str(_refused((name, port))))
    return _getaddrinfo(host, port, *args, **kwargs)


def refuse() -> None:
    """Refuse, from now on in this process, every connection off this machine and every look-up
    of a name that is not this machine's."""
    socket.socket.connect = _guarded_connect
    socket.socket.connect_ex = _guarded_connect_ex
    socket.getaddrinfo = _guarded_getaddrinfo
