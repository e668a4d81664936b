"""ExternalLauncherExecutor: this process is one rank of a job that torchrun started.

Under `torchrun --nproc-per-node N script.py` every rank builds its own LLM with
`distributed_executor_backend="external_launcher"` and runs its own EngineCore in-process with
one local worker, joined to torchrun's group (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT). The ranks see the same requests in the same order and their
schedulers are deterministic, so they schedule identically; every rank samples the same
tokens, so every rank returns the same outputs.
"""

from __future__ import annotations

import os
from typing import Any

from tokenmill.core.executor.uniproc import UniProcExecutor


class ExternalLauncherExecutor(UniProcExecutor):
    def _make_worker(self) -> Any:
        from tokenmill.worker.worker import Worker

        env = _torchrun_env()
        tp = self.config.parallel_config.tensor_parallel_size
        if env["WORLD_SIZE"] != tp:
            raise ValueError(
                f"tensor_parallel_size={tp} must equal torchrun's WORLD_SIZE "
                f"({env['WORLD_SIZE']}) with distributed_executor_backend='external_launcher'"
            )
        worker = Worker(
            self.config,
            rank=env["RANK"],
            local_rank=env["LOCAL_RANK"],
            local_world_size=env["LOCAL_WORLD_SIZE"],
            distributed_init_method="env://",
        )
        worker.init_device()
        worker.load_model()
        return worker

    def shutdown(self) -> None:
        from tokenmill.worker.parallel_state import destroy_distributed

        super().shutdown()
        destroy_distributed()

    def determine_available_memory(self) -> int:
        # Each rank's engine sizes its own cache: they must agree on the smallest.
        import torch
        import torch.distributed as dist

        def smallest() -> int:  # on the worker's thread, like every call to it
            local = torch.tensor([self.worker.determine_available_memory()],
                                 device=self.worker.device)  # fmt: skip
            dist.all_reduce(local, op=dist.ReduceOp.MIN)
            return int(local.item())

        return self._run(smallest).result()


def _torchrun_env() -> dict[str, int]:
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    missing = [name for name in names + ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"distributed_executor_backend='external_launcher' runs under torchrun, which sets "
            f"{', '.join(missing)}; none is set here (launch with `torchrun --nproc-per-node N`)"
        )
    env = {name: int(os.environ[name]) for name in names}
    env["LOCAL_WORLD_SIZE"] = int(os.environ.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))
    return env
