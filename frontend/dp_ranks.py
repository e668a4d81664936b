"""Where a data-parallel client's ranks come from: each launcher makes rank i's client.

`LocalRanks`: an engine-core process per rank on this host, spawned by the rank's client
(on CUDA each sees its own GPUs through CUDA_VISIBLE_DEVICES). Used by frontend/dp_client.py.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from tokenmill.protocol.config import EngineConfig


class RankLauncher:
    """Makes rank clients: `connect(i, client_cls, owner)` returns rank i's client, started
    and past its handshake. `restarts`: whether a lost rank may be connected again."""

    restarts = False

    def connect(self, index: int, client_cls: type, owner: Any) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        """Releases what the launcher holds (never blocks for long)."""


def rank_config(config: EngineConfig, index: int) -> EngineConfig:
    """Rank `index`'s config: the shared one, naming the rank."""
    parallel = dataclasses.replace(config.parallel_config, data_parallel_rank=index)
    return dataclasses.replace(config, parallel_config=parallel)


class LocalRanks(RankLauncher):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    def connect(self, index: int, client_cls: type, owner: Any) -> Any:
        config = rank_config(self.config, index)
        return client_cls(owner, index, config, env=_rank_env(config, index))


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


def launcher_for(config: EngineConfig) -> RankLauncher:
    return LocalRanks(config)
