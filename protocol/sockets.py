"""Socket addresses and ZeroMQ helpers shared by the engine-core process and its clients.

An engine core listens on two ROUTER sockets: requests come in on the input address, each
client's outputs leave on the output address. Users name one address; the other is derived:
`tcp://HOST:PORT` -> input PORT, output PORT+1; `ipc://PATH` -> PATH and PATH.out. ipc paths
must live in a directory only their owner can enter.
"""

from __future__ import annotations

import ipaddress
import os
import stat
from urllib.parse import urlsplit


def split_address(address: str) -> tuple[str, str]:
    """The (input, output) socket addresses behind one engine address."""
    if address.startswith("ipc://"):
        return address, address + ".out"
    if address.startswith("tcp://"):
        parts = urlsplit(address)
        if parts.port is None or parts.hostname is None:
            raise ValueError(f"engine address {address!r} needs a host and a port")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        return address, f"tcp://{host}:{parts.port + 1}"
    raise ValueError(f"engine address must start with tcp:// or ipc://, got {address!r}")


def is_loopback(address: str) -> bool:
    if not address.startswith("tcp://"):
        return True  # ipc
    return is_loopback_host(urlsplit(address).hostname or "")


def is_loopback_host(host: str) -> bool:
    """Whether a host name or address stays on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def ensure_private_ipc_dir(address: str) -> None:
    """Creates the directory of an ipc:// path with mode 0700, or refuses one that others
    can enter (they could connect to the engine)."""
    if not address.startswith("ipc://"):
        return
    directory = os.path.dirname(os.path.abspath(address[len("ipc://") :]))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    mode = stat.S_IMODE(os.stat(directory).st_mode)
    if mode & 0o077:
        raise PermissionError(
            f"ipc directory {directory} has mode {oct(mode)}; use a private directory (0700)"
        )


def with_host(address: str, host: str) -> str:
    """The tcp address with its host replaced (the daemon's --host)."""
    parts = urlsplit(address)
    if parts.scheme != "tcp" or parts.port is None:
        raise ValueError(f"--host applies to tcp://HOST:PORT addresses, got {address!r}")
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{host}:{parts.port}"
