"""Where a data-parallel client's ranks come from: a launcher makes rank i's client.

- `LocalRanks`: an engine-core process per rank on this host, spawned by the rank's client
  (on CUDA each sees its own GPUs through CUDA_VISIBLE_DEVICES). A lost one stays down.
- `HeadlessRanks`: the first `data_parallel_size_local` ranks are local; the others are
  `engine-core --data-parallel-rank R` daemons on other hosts that join through the
  frontend's registration socket (`Registry`, on data_parallel_address:data_parallel_rpc_port,
  authenticated unless loopback) and are then reached like any daemon. A lost one is waited
  for: when its daemon is started again it registers again and rejoins.
- `RayRanks` (frontend/dp_ray.py): every rank an actor placed by Ray, restarted when lost.
Used by frontend/dp_client.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any

import msgspec
import zmq

from tokenmill.protocol.config import EngineConfig
from tokenmill.protocol.messages import PROTOCOL_VERSION, REGISTERED, RankRegistration
from tokenmill.protocol.process import close_sockets
from tokenmill.protocol.sockets import is_loopback_host

logger = logging.getLogger(__name__)

REGISTRATION_WAIT_S = 300.0  # how long a frontend waits at start-up for a headless rank


class RankLauncher:
    """Makes rank clients: `connect(i, client_cls, owner, timeout)` returns rank i's client
    (`client_cls(owner, i, config, engine_address, auth_token, env=...)`), started and past
    its handshake, or raises (TimeoutError after `timeout` s where it waits for the rank)."""

    def connect(self, index: int, client_cls: type, owner: Any, timeout: float) -> Any:
        raise NotImplementedError

    def restarts(self, index: int) -> bool:
        """Whether a lost rank `index` can come back (connect() is then tried again)."""
        return False

    def lost(self, index: int) -> None:
        """Rank `index` was found lost (what the launcher knew of it is stale)."""

    def describe(self, index: int) -> dict[str, Any]:
        """Where rank `index` runs, beyond its address (its Ray node, say)."""
        return {}

    def close(self) -> None:
        """Releases what the launcher holds (never blocks for long)."""


def rank_config(config: EngineConfig, index: int) -> EngineConfig:
    """Rank `index`'s config: the shared one, naming the rank."""
    parallel = dataclasses.replace(config.parallel_config, data_parallel_rank=index)
    return dataclasses.replace(config, parallel_config=parallel)


class LocalRanks(RankLauncher):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    def connect(self, index: int, client_cls: type, owner: Any, timeout: float) -> Any:
        config = rank_config(self.config, index)
        return client_cls(owner, index, config, env=_rank_env(config, index))


class HeadlessRanks(LocalRanks):
    def __init__(self, config: EngineConfig, auth_token: str) -> None:
        super().__init__(config)
        parallel = config.parallel_config
        self.num_local = parallel.num_local_dp_ranks
        self.auth_token = auth_token
        self.registry = Registry(
            parallel.data_parallel_address, parallel.data_parallel_rpc_port, auth_token,
            parallel.data_parallel_size,
        )  # fmt: skip
        self.connected: dict[int, float] = {}  # rank -> when its registration was used

    def connect(self, index: int, client_cls: type, owner: Any, timeout: float) -> Any:
        if index < self.num_local:
            return super().connect(index, client_cls, owner, timeout)
        # A registration newer than the one last used: a rank that was lost has to say
        # again that it serves.
        address, when = self.registry.wait_for(index, self.connected.get(index, -1.0), timeout)
        self.connected[index] = when
        client = client_cls(owner, index, None, address, self.auth_token)
        theirs, ours = client.ready.config.model_config, self.config.model_config
        if _model_signature(theirs) != _model_signature(ours):
            client.shutdown()
            raise RuntimeError(
                f"the engine-core at {address} serves another model ({theirs.architecture}, "
                f"{theirs.num_hidden_layers} layers, vocab {theirs.vocab_size}) than this "
                f"frontend ({ours.architecture}, {ours.num_hidden_layers} layers, vocab "
                f"{ours.vocab_size})"
            )
        return client

    def restarts(self, index: int) -> bool:
        return index >= self.num_local

    def lost(self, index: int) -> None:
        # Its registrations so far name a daemon that is gone: wait for a new one.
        self.connected[index] = time.monotonic()

    def close(self) -> None:
        self.registry.close()


def _model_signature(model: Any) -> tuple:
    return (model.architecture, model.vocab_size, model.hidden_size, model.num_hidden_layers)


class Registry:
    """The frontend's registration socket: a ROUTER on tcp://host:port where headless ranks
    say where they serve. Its thread answers each one (REGISTERED, or refused with the
    reason: a wrong auth token, a rank out of range) and keeps the latest address of every
    rank with the time it came. A non-loopback host needs an auth token."""

    def __init__(self, host: str, port: int, auth_token: str, size: int) -> None:
        if not is_loopback_host(host) and not auth_token:
            raise ValueError(
                f"data_parallel_address={host!r} is not loopback: headless ranks must present "
                "an auth token (pass auth_token= or set TOKENMILL_AUTH_TOKEN)"
            )
        self.auth_token = auth_token
        self.size = size
        self.latest: dict[int, tuple[str, float]] = {}
        self.changed = threading.Condition()
        self.stop = threading.Event()
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        bracketed = f"[{host}]" if ":" in host else host
        self.address = f"tcp://{bracketed}:{port}"
        try:
            self.socket.bind(self.address)
        except zmq.ZMQError as e:
            close_sockets(self.ctx, [self.socket])
            raise RuntimeError(f"cannot listen for headless ranks on {self.address}: {e}") from e
        self.thread = threading.Thread(target=self._serve, daemon=True, name="dp-registry")
        self.thread.start()
        logger.info("waiting for headless data-parallel ranks on %s", self.address)

    def _serve(self) -> None:
        decoder = msgspec.msgpack.Decoder(RankRegistration)
        try:
            while not self.stop.is_set():
                if not self.socket.poll(200):
                    continue
                identity, body = self.socket.recv_multipart()
                try:
                    registration = decoder.decode(body)
                except msgspec.DecodeError:
                    self.socket.send_multipart([identity, b"F", b"not a rank registration"])
                    continue
                refusal = self._refusal(registration)
                if refusal is not None:
                    logger.warning("refused a headless rank's registration: %s", refusal)
                    self.socket.send_multipart([identity, b"F", refusal.encode()])
                    continue
                self.socket.send_multipart([identity, REGISTERED])
                with self.changed:
                    known = self.latest.get(registration.rank)
                    if known is None or known[0] != registration.address:
                        logger.info("data-parallel rank %d registered at %s",
                                    registration.rank, registration.address)  # fmt: skip
                    self.latest[registration.rank] = (registration.address, time.monotonic())
                    self.changed.notify_all()
        finally:
            close_sockets(self.ctx, [self.socket])

    def _refusal(self, registration: RankRegistration) -> str | None:
        if registration.protocol_version != PROTOCOL_VERSION:
            return (f"protocol version {registration.protocol_version}, this frontend speaks "
                    f"{PROTOCOL_VERSION}")  # fmt: skip
        if registration.auth_token != self.auth_token:
            return "wrong auth token"
        if not 0 <= registration.rank < self.size:
            return f"rank {registration.rank} is not below data_parallel_size={self.size}"
        return None

    def wait_for(self, rank: int, newer_than: float, timeout: float) -> tuple[str, float]:
        """(address, time) of rank's registration received after `newer_than`."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                known = self.latest.get(rank)
                if known is not None and known[1] > newer_than:
                    return known
                left = deadline - time.monotonic()
                if left <= 0 or self.stop.is_set():
                    raise TimeoutError(
                        f"data-parallel rank {rank} did not register at {self.address} "
                        f"within {timeout:.0f} s"
                    )
                self.changed.wait(min(left, 1.0))

    def close(self) -> None:
        self.stop.set()
        with self.changed:
            self.changed.notify_all()
        self.thread.join(2.0)


def _rank_env(config: EngineConfig, local_index: int) -> dict[str, str] | None:
    """On CUDA, the rank's share of the GPUs this process sees (its TP group's); elsewhere
    the parent's environment."""
    if config.device_config.device != "cuda":
        return None
    tp = config.parallel_config.tensor_parallel_size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(d) for d in range((local_index + 1) * tp)]
    mine = devices[local_index * tp : (local_index + 1) * tp]
    if len(mine) < tp:
        raise ValueError(
            f"data-parallel rank {local_index} needs GPUs {local_index * tp}..."
            f"{(local_index + 1) * tp - 1} of CUDA_VISIBLE_DEVICES={visible!r}"
        )
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(mine)}


def launcher_for(config: EngineConfig, auth_token: str = "") -> RankLauncher:
    parallel = config.parallel_config
    if parallel.data_parallel_backend == "ray":
        from tokenmill.frontend.dp_ray import RayRanks

        return RayRanks(config, auth_token)
    if parallel.num_local_dp_ranks < parallel.data_parallel_size:
        return HeadlessRanks(config, auth_token)
    return LocalRanks(config)
