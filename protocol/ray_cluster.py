"""Reaching a Ray cluster (Ray is an optional extra: `pip install tokenmill[ray]`).

Used by the Ray executor (core/executor/ray.py) and the Ray data-parallel ranks
(frontend/dp_ray.py), in whichever process places actors.
"""

from __future__ import annotations

import logging
import os
from typing import Any


def import_ray() -> Any:
    # Ray's own handler would print a stack trace on the SIGTERM that stops an engine core
    # (read when ray is first imported).
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    try:
        import ray
    except ImportError:
        raise ImportError(
            "distributed_executor_backend='ray' (and data_parallel_backend='ray') need Ray: "
            "pip install 'tokenmill[ray]'"
        ) from None
    return ray


def init_ray() -> Any:
    """Ray, connected: to the cluster it finds (RAY_ADDRESS, or one started on this machine
    with `ray start`), else to a local one it starts."""
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(
            address=os.environ.get("RAY_ADDRESS"),
            include_dashboard=False,
            log_to_driver=True,
            logging_level=logging.WARNING,
        )
    return ray
