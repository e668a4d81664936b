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
from dataclasses import dataclass, replace
from typing import Any
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


@dataclass(frozen=True)
class CurveKeys:
    """CURVE keys for sockets that must reach beyond this host (an executor's, when its
    workers are on other nodes): the executor's sockets are CURVE servers with their own key
    pair, and only clients holding the one client key pair made with it are let in (a ZAP
    handler checks the key), so nobody else can send calls, read them or forge replies, and
    all traffic is encrypted. The workers get `for_client()`, which has no server secret."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @staticmethod
    def generate() -> CurveKeys:
        import zmq

        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return CurveKeys(server_public, server_secret, client_public, client_secret)

    def for_client(self) -> CurveKeys:
        return replace(self, server_secret=b"")

    def make_server(self, socket: Any) -> None:
        socket.curve_secretkey = self.server_secret
        socket.curve_publickey = self.server_public
        socket.curve_server = True

    def make_client(self, socket: Any) -> None:
        socket.curve_secretkey = self.client_secret
        socket.curve_publickey = self.client_public
        socket.curve_serverkey = self.server_public

    def start_authenticator(self, ctx: Any) -> Any:
        """A ZAP handler on `ctx` that lets in the client key alone (stop() it before the
        context is terminated)."""
        from zmq.auth.thread import ThreadAuthenticator

        keys = self

        class _OneKey:
            def callback(self, domain: str, key: bytes) -> bool:
                return key == keys.client_public

        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve_callback(domain="*", credentials_provider=_OneKey())
        return auth
