"""Data-parallel ranks placed by Ray (`data_parallel_backend="ray"`).

Each rank is a `RankHost` actor (SPREAD across the cluster's nodes, reserving
TOKENMILL_RAY_WORKER_CPUS x tensor_parallel_size CPUs, and a GPU per TP rank on CUDA) that
starts an engine-core process on its node, listening on the node's IP behind an auth token
(this frontend's, or one made for these ranks), and says where; the frontend then reaches it
as it reaches any daemon. The core watches the actor's process and exits with it, so a killed
actor or a lost node takes its core along. A lost rank is started again: a new actor, which
Ray places wherever there is room, and its core rejoins the routing. Used by
frontend/dp_ranks.py (launcher_for).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
from typing import Any

import msgspec

from tokenmill.frontend.dp_ranks import RankLauncher, rank_config
from tokenmill.protocol import envs
from tokenmill.protocol.config import EngineConfig
from tokenmill.protocol.process import start_module, stop_processes
from tokenmill.protocol.ray_cluster import init_ray

logger = logging.getLogger(__name__)

_PLACEMENT_WAIT_S = 60.0  # for an actor to be placed and its core to listen


class RankHost:
    """A Ray actor that runs one data-parallel rank's engine core on its node."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def start(self, config_json: bytes, auth_token: str) -> tuple[str, str, str]:
        """Starts the engine core on this node (its config as JSON); returns (its engine
        address, this node's id, its IP). The core is ready to answer a hello once its model
        is loaded; the frontend's handshake waits for that."""
        import ray

        ip = ray.util.get_node_ip_address()
        port = _free_port_pair(ip)
        address = f"tcp://{ip}:{port}"
        config = msgspec.json.decode(config_json, type=EngineConfig)
        env = {**os.environ, "TOKENMILL_AUTH_TOKEN": auth_token}
        args = [
            f"--input-address={address}",
            f"--output-address=tcp://{ip}:{port + 1}",
            f"--parent-pid={os.getpid()}",  # the core exits with this actor
        ]
        self.proc = start_module("tokenmill.core.engine_core_proc", args, config, env)
        return address, ray.get_runtime_context().get_node_id(), ip

    def stop(self) -> None:
        if self.proc is not None:
            stop_processes([self.proc], timeout=5.0)


class RayRanks(RankLauncher):
    def __init__(self, config: EngineConfig, auth_token: str) -> None:
        self.ray = init_ray()
        self.config = config
        # The cores listen on their nodes' IPs: never without a token.
        self.auth_token = auth_token or secrets.token_hex(16)
        tp = config.parallel_config.tensor_parallel_size
        self.resources: dict[str, Any] = {"num_cpus": envs.TOKENMILL_RAY_WORKER_CPUS * tp}
        if config.device_config.device == "cuda":
            self.resources["num_gpus"] = tp
        self.actor_class = self.ray.remote(RankHost)
        self.hosts: dict[int, Any] = {}
        self.nodes: dict[int, tuple[str, str]] = {}

    def connect(self, index: int, client_cls: type, owner: Any, timeout: float) -> Any:
        ray = self.ray
        host = self.actor_class.options(scheduling_strategy="SPREAD", **self.resources).remote()
        config_json = msgspec.json.encode(rank_config(self.config, index))
        started = host.start.remote(config_json, self.auth_token)
        ready, _ = ray.wait([started], timeout=max(timeout, _PLACEMENT_WAIT_S))
        if not ready:
            ray.kill(host, no_restart=True)
            raise TimeoutError(
                f"Ray found no room for data-parallel rank {index} ({self.resources}) within "
                f"{max(timeout, _PLACEMENT_WAIT_S):.0f} s"
            )
        try:
            address, node_id, ip = ray.get(started, timeout=0)  # (ready above)
            client = client_cls(owner, index, None, address, self.auth_token)
        except Exception:
            ray.kill(host, no_restart=True)
            raise
        self.hosts[index] = host
        self.nodes[index] = (node_id, ip)
        logger.info("data-parallel rank %d runs on Ray node %s (%s)", index, ip, node_id[:12])
        return client

    def restarts(self, index: int) -> bool:
        return True

    def describe(self, index: int) -> dict[str, Any]:
        if index not in self.nodes:
            return {}
        node_id, ip = self.nodes[index]
        return {"node_id": node_id, "node_ip": ip}

    def lost(self, index: int) -> None:
        host = self.hosts.pop(index, None)
        if host is not None:
            try:
                self.ray.kill(host, no_restart=True)
            except Exception:  # its node is gone already
                pass

    def close(self) -> None:
        hosts, self.hosts = list(self.hosts.values()), {}
        stops = [host.stop.remote() for host in hosts]
        if stops:
            self.ray.wait(stops, num_returns=len(stops), timeout=6.0)
        for host in hosts:
            try:
                self.ray.kill(host, no_restart=True)
            except Exception:
                pass


def _free_port_pair(host: str) -> int:
    """A port p with p and p + 1 free on `host` (an engine core's input and output)."""
    for _ in range(100):
        with socket.socket() as first:
            first.bind((host, 0))
            port = first.getsockname()[1]
            with socket.socket() as second:
                try:
                    second.bind((host, port + 1))
                except OSError:
                    continue
                return port
    raise RuntimeError(f"no two consecutive free ports on {host}")
