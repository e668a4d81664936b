"""RayExecutor: tensor-parallel workers as Ray actors, on one node or across several.

`distributed_executor_backend="ray"` (Ray is an optional extra, `pip install tokenmill[ray]`,
imported only here). The engine core attaches to the cluster Ray finds (RAY_ADDRESS, or one
started on this machine with `ray start`) or starts a local one, reserves a placement group
of one bundle per rank (TOKENMILL_RAY_WORKER_CPUS CPUs each, and a GPU on CUDA; PACK, so
ranks share nodes where they fit), and starts a worker actor in each (worker/ray_worker.py).
Ranks are numbered so that those on this node come first: rank 0, which hosts the
torch.distributed rendezvous, is on the core's node where any rank is, and the rendezvous
address is rank 0's node's IP and a port free there (gloo on the CPU, nccl on CUDA). Calls
and replies travel as in the multiprocess executor (one msgspec encoding per call, pushed to
every rank), but over TCP on this node's IP, as CURVE:
the executor's sockets accept only the client key its actors were given, and everything is
encrypted. A worker whose actor dies (killed, its node lost) is noticed through its `serve`
call's result, which Ray fails at once: the executor fails naming the rank and its node.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from tokenmill.core.executor.multiproc import MultiprocExecutor
from tokenmill.protocol import envs
from tokenmill.protocol.ray_cluster import init_ray
from tokenmill.protocol.sockets import CurveKeys

logger = logging.getLogger(__name__)

_STOP_GRACE_S = 2.0  # after the shutdown call, before the actors are killed


class RayExecutor(MultiprocExecutor):
    def _bind_sockets(self) -> tuple[list[str], str]:
        self.ray = init_ray()
        self.ip = self.ray.util.get_node_ip_address()
        self.curve = CurveKeys.generate()
        self.auth = self.curve.start_authenticator(self.ctx)
        host = f"tcp://{self.ip}"
        calls = []
        for sock in self.call_sockets:
            self.curve.make_server(sock)
            calls.append(f"{host}:{sock.bind_to_random_port(host)}")
        self.curve.make_server(self.reply_socket)
        reply = f"{host}:{self.reply_socket.bind_to_random_port(host)}"
        self.placement_groups: list = []  # (the finalizer's cleanup releases them)
        self._cleanup = functools.partial(_release, self.ray, self.placement_groups)
        return calls, reply

    def _start_workers(self) -> list:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from tokenmill.worker.ray_worker import RayWorker

        ray = self.ray
        cpus = envs.TOKENMILL_RAY_WORKER_CPUS
        bundle: dict[str, float] = {"CPU": cpus}
        gpus = 1 if self.config.device_config.device == "cuda" else 0
        if gpus:
            bundle["GPU"] = gpus
        group = placement_group([bundle] * self.world_size, strategy="PACK")
        self.placement_groups.append(group)
        ready, _ = ray.wait([group.ready()], timeout=WAIT_FOR_RESOURCES_S)
        if not ready:
            raise RuntimeError(
                f"the Ray cluster has no room for {self.world_size} workers of {bundle} "
                f"within {WAIT_FOR_RESOURCES_S:.0f} s (its resources: "
                f"{ray.available_resources()})"
            )
        actor_class = ray.remote(RayWorker)
        env = {name: os.environ[name] for name in _FORWARDED_ENV if name in os.environ}
        self.actors = actors = [
            actor_class.options(
                num_cpus=cpus,
                num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=i
                ),
                runtime_env={"env_vars": env} if env else None,
            ).remote()
            for i in range(self.world_size)
        ]
        # (Every wait on the cluster has a deadline: a lost node never answers.)
        places = ray.get([actor.node.remote() for actor in actors], timeout=WAIT_FOR_RESOURCES_S)
        here = ray.get_runtime_context().get_node_id()
        # This node's actors first (rank 0 hosts the rendezvous on this node's IP), then by node.
        order = sorted(range(len(actors)), key=lambda i: (places[i][0] != here, places[i][0]))
        self.actors = [actors[i] for i in order]
        self.places = [places[i] for i in order]
        self.stop_actors = functools.partial(_kill_actors, ray, self.actors)
        # Rank 0 hosts the rendezvous: on its node's IP (this node's when a rank is here).
        port = ray.get(self.actors[0].free_port.remote(), timeout=WAIT_FOR_RESOURCES_S)
        init_method = f"tcp://{self.places[0][1]}:{port}"
        config_json = msgspec.json.encode(self.config)
        client = self.curve.for_client()
        keys = (client.server_public, client.client_public, client.client_secret)
        self.serve_refs = []
        for rank, actor in enumerate(self.actors):
            node = self.places[rank][0]
            on_node = [i for i, p in enumerate(self.places) if p[0] == node]
            local_rank = 0 if gpus else on_node.index(rank)  # Ray shows an actor its GPU only
            self.serve_refs.append(
                actor.serve.remote(
                    config_json,
                    rank,
                    local_rank,
                    len(on_node),
                    init_method,
                    self.call_addresses[rank],
                    self.reply_address,
                    keys,
                )  # fmt: skip
            )
        nodes = sorted({p[1] for p in self.places})
        logger.info("%d Ray workers on nodes %s", self.world_size, ", ".join(nodes))
        return self.actors

    def _abandon_start(self) -> None:
        _kill_actors(self.ray, getattr(self, "actors", []))
        self.auth.stop()  # (its sockets close before the context is terminated)
        super()._abandon_start()

    def _worker_stopper(self) -> Callable[[], None]:
        return functools.partial(
            _stop_after_grace, self.ray, self.serve_refs, self.stop_actors, self.auth
        )

    def _exit_waiter(self) -> Callable[[threading.Event], int | None]:
        return functools.partial(_wait_for_actor_exit, self.ray, list(self.serve_refs))

    def _exited(self, rank: int) -> str | None:
        done, _ = self.ray.wait([self.serve_refs[rank]], timeout=0)
        return self._death(rank) if done else None

    def _death(self, rank: int) -> str:
        node_id, ip, pid = self.places[rank]
        try:
            self.ray.get(self.serve_refs[rank], timeout=0)
            how = "exited"
        except Exception as e:  # RayActorError: killed, or its node lost
            how = f"died ({type(e).__name__})"
        return f"worker rank {rank} (Ray actor, pid {pid}, node {ip} {node_id[:12]}) {how}"

    def _stop_all(self) -> None:
        self.stop_actors()


WAIT_FOR_RESOURCES_S = 60.0
# Settings the actors take from the core's environment (Ray starts them from its own).
_FORWARDED_ENV = (
    "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "PYTHONHASHSEED", "HF_HUB_OFFLINE",
    "TRITON_INTERPRET", "TOKENMILL_CPU_KVCACHE_SPACE", "TOKENMILL_CPU_KV_FRACTION",
)  # fmt: skip


def _wait_for_actor_exit(ray: Any, refs: list, stop: threading.Event) -> int | None:
    """The rank whose `serve` call ends first (an actor that died fails its call at once),
    or None once `stop` is set."""
    while not stop.is_set():
        done, _ = ray.wait(refs, num_returns=1, timeout=0.2)
        if done:
            return refs.index(done[0])
    return None


def _kill_actors(ray: Any, actors: list) -> None:
    for actor in actors:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already gone
            pass


def _stop_after_grace(ray: Any, refs: list, stop_actors: Callable[[], None], auth: Any) -> None:
    """Gives the actors _STOP_GRACE_S to end their `serve` after the shutdown call, then
    kills them, and stops the socket authenticator (its sockets must close before the
    context is terminated)."""
    deadline = time.monotonic() + _STOP_GRACE_S
    pending = list(refs)
    while pending and time.monotonic() < deadline:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.1)
    stop_actors()
    auth.stop()


def _release(ray: Any, groups: list) -> None:
    """Releases the placement group."""
    for group in groups:
        try:
            ray.util.remove_placement_group(group)
        except Exception:  # the cluster is gone already
            pass
