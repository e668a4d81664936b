"""One tensor-parallel rank as a Ray actor (the Ray executor's worker, core/executor/ray.py).

The actor is placed by Ray (one placement-group bundle per rank) and says where it landed
(`node`); the executor then orders the ranks (its own node's first) and calls `serve`, which
runs the same worker loop as a worker process (worker/worker_proc.py) over the executor's
TCP sockets, as an authenticated CURVE client: calls in, replies out, until the executor
says shut down. Everything crosses as bytes and plain values (the config as JSON), never as
the project's objects.
"""

from __future__ import annotations

import logging
import os
import socket

import msgspec

from tokenmill.protocol.config import EngineConfig
from tokenmill.protocol.sockets import CurveKeys

logger = logging.getLogger(__name__)


class RayWorker:
    def node(self) -> tuple[str, str, int]:
        """(node id, node IP, pid) of the process Ray placed this rank in."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def free_port(self) -> int:
        """A port free on this node (rank 0's: where the rendezvous listens)."""
        import ray

        with socket.socket() as s:
            s.bind((ray.util.get_node_ip_address(), 0))
            return s.getsockname()[1]

    def serve(
        self,
        config_json: bytes,
        rank: int,
        local_rank: int,
        local_world_size: int,
        init_method: str,
        call_address: str,
        reply_address: str,
        curve: tuple[bytes, bytes, bytes],
    ) -> bool:
        """Joins the group, loads this rank's shard, reports ready (or why not) and serves
        calls until shut down; False if it could not start. `curve`: the executor's public
        key and this worker's client key pair."""
        from tokenmill.worker.worker import Worker
        from tokenmill.worker.worker_proc import WorkerProc

        logging.basicConfig(
            level=logging.INFO, format=f"%(asctime)s worker-{rank} %(levelname)s %(message)s"
        )
        config = msgspec.json.decode(config_json, type=EngineConfig)
        worker = Worker(config, rank, local_rank, local_world_size, init_method)
        keys = CurveKeys(curve[0], b"", curve[1], curve[2])
        proc = WorkerProc(worker, call_address, reply_address, keys)
        started = proc.start()
        try:
            if started:
                proc.serve()
        finally:
            proc.close()
            worker.close()
        return started
