"""Data parallelism behind one frontend: several engine cores (DP ranks), one client.

Each rank is a whole engine (an EngineCore and its tensor-parallel workers) reached through a
multiprocess client of its own. `DPClient` (blocking, for LLM) and `AsyncDPClient` (asyncio,
for AsyncLLM and the server) share `_DataParallel`, which
- routes each request (frontend/dp_router.py: by load, and to the rank already holding the
  prompt's prefix within a margin) and merges the ranks' outputs;
- keeps a ledger of the requests in flight (rank, request, tokens produced so far). When a
  rank is lost (its core or one of its workers dies, its connection drops) the rank is marked
  down and its unfinished requests go to the live ranks, each resuming after the tokens it
  already produced (`resumed_token_ids`), so a caller's output continues with no gap and no
  repeat; only when no rank is left does every call fail with EngineDeadError. Where the
  ranks' launcher can (Ray), a lost rank is started again and rejoins the routing;
- answers utilities for every rank: get_stats adds the ranks up and lists each under
  "data_parallel", check_health holds while any rank is up, reset_prefix_cache runs on all.
Ranks come from frontend/dp_ranks.py: processes started here, headless `engine-core` daemons
that join, or Ray actors.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tokenmill.frontend.async_core_client import (
    AsyncEngineCoreClient,
    AsyncMPClient,
    take_output_async,
)
from tokenmill.frontend.core_client import (
    UTILITY_TIMEOUT_S,
    EngineCoreClient,
    EngineDeadError,
    SyncMPClient,
    continuation,
    take_output,
)
from tokenmill.frontend.dp_ranks import REGISTRATION_WAIT_S, RankLauncher, launcher_for
from tokenmill.frontend.dp_router import RankLoad, Router
from tokenmill.protocol.config import EngineConfig
from tokenmill.protocol.messages import EngineCoreOutputs, EngineCoreRequest, Ready

logger = logging.getLogger(__name__)

_STATS_LOG_INTERVAL_S = 10.0  # the all-ranks stats line, at most this often
_PARKED = -1  # the rank of a request waiting for a rank to come back
# With every rank down, requests wait this long for one to come back (where ranks restart)
# before the client gives up and is dead.
NO_RANK_TIMEOUT_S = 120.0
_RESTART_POLL_S = 2.0  # a restart's attempts wait this long each (then look at the clock)


@dataclass
class _InFlight:
    request: EngineCoreRequest  # as the caller sent it
    rank: int
    produced: list[int] = field(default_factory=list)  # tokens output so far, on any rank
    # The router's hashes of its tokens' full blocks, extended as they grow.
    hashes: list[bytes] = field(default_factory=list)

    @property
    def salt(self) -> bytes:
        lora = self.request.lora_request
        return b"" if lora is None else lora.cache_salt


@dataclass
class _Rank:
    index: int
    load: RankLoad
    client: Any = None  # the rank's multiprocess client while it is up
    up: bool = False
    cause: str | None = None  # why it went down
    ready: Ready | None = None


class _DataParallel:
    """What both data-parallel clients share: ranks, routing, the ledger and failover.
    Subclasses provide the rank clients and the merged output queue (`_put`)."""

    def __init__(
        self, config: EngineConfig, launcher: RankLauncher | None = None, auth_token: str = ""
    ) -> None:
        parallel = config.parallel_config
        self.size = parallel.data_parallel_size
        self.lock = threading.RLock()  # ranks' output threads, callers and failover
        self.router = Router(
            parallel.data_parallel_routing,
            parallel.data_parallel_prefix_margin,
            config.cache_config.block_size,
        )
        self.ranks = [_Rank(i, RankLoad(i, 1)) for i in range(self.size)]
        self.in_flight: dict[str, _InFlight] = {}
        self.dead: str | None = None
        self.closing = False
        self.num_rank_failures = 0
        self.num_resubmitted = 0
        self.next_stats_log = 0.0
        self.launcher = launcher or launcher_for(config, auth_token)
        self._start_ranks(config)

    # -------------------------------------------------------------------------- ranks
    def _start_ranks(self, config: EngineConfig) -> None:
        """Starts (or waits for) every rank at once; one that cannot start fails them all."""
        with ThreadPoolExecutor(self.size, thread_name_prefix="dp-start") as pool:
            futures = [
                pool.submit(self._connect_rank, i, REGISTRATION_WAIT_S) for i in range(self.size)
            ]
            errors = [f.exception() for f in futures]
        failed = [(i, e) for i, e in enumerate(errors) if e is not None]
        if failed:
            self.shutdown()
            index, error = failed[0]
            raise RuntimeError(f"data-parallel rank {index} failed to start: {error}") from error
        lens = {r.ready.config.model_config.max_model_len for r in self.ranks if r.ready}
        if len(lens) > 1:
            logger.warning("the data-parallel ranks fitted different max_model_len %s; "
                           "the smallest applies", sorted(lens))  # fmt: skip

    def _connect_rank(self, index: int, timeout: float) -> None:
        """Starts rank `index` (or reaches it) and puts it in the routing."""
        rank = self.ranks[index]
        client = self._make_rank_client(index, timeout)
        with self.lock:
            if self.closing:
                self._retire(client)
                return
            rank.client, rank.ready, rank.cause = client, client.ready, None
            rank.load = RankLoad(index, client.ready.num_blocks)
            rank.up = True
        logger.info("data-parallel rank %d is up (%s)", index, client.address)

    def _make_rank_client(self, index: int, timeout: float) -> Any:
        raise NotImplementedError

    def _live(self) -> list[_Rank]:
        return [r for r in self.ranks if r.up]

    @property
    def ready(self) -> Ready:
        """The handshake of the rank whose max_model_len is smallest (what every rank
        accepts)."""
        readies = [r.ready for r in self.ranks if r.ready is not None]
        return min(readies, key=lambda ready: ready.config.model_config.max_model_len)

    @property
    def engine_config(self) -> EngineConfig:
        return self.ready.config

    # ----------------------------------------------------------------------- requests
    def _route(self, requests: list[EngineCoreRequest]) -> None:
        """Assigns each request to a live rank and sends it there (under the lock)."""
        per_rank: dict[int, list[EngineCoreRequest]] = {}
        live = self._live()
        loads = [r.load for r in live]
        for request in requests:
            entry = self.in_flight.get(request.request_id)
            if entry is None:
                entry = self.in_flight[request.request_id] = _InFlight(request, _PARKED)
            if not loads:  # every rank is down, one is being restarted: it waits for it
                entry.rank = _PARKED
                continue
            # (A resubmission's resumed tokens are part of the prefix it needs.)
            tokens = request.prompt_token_ids + request.resumed_token_ids
            hashes = self.router.block_hashes(tokens, entry.hashes, entry.salt)
            load = self.router.choose(loads, hashes)
            load.record.add(hashes)
            load.unfinished += 1
            entry.rank = load.index
            per_rank.setdefault(load.index, []).append(request)
        for index, batch in per_rank.items():
            try:
                self.ranks[index].client.add_requests(batch)
            except EngineDeadError:
                pass  # its death, about to be handled, moves them on

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._check_alive()
        with self.lock:
            self._route(requests)

    def abort_requests(self, request_ids: list[str]) -> None:
        per_rank: dict[int, list[str]] = {}
        with self.lock:
            for req_id in request_ids:
                entry = self.in_flight.pop(req_id, None)
                if entry is not None and entry.rank != _PARKED:
                    self.ranks[entry.rank].load.unfinished -= 1
                    per_rank.setdefault(entry.rank, []).append(req_id)
            for index, ids in per_rank.items():
                rank = self.ranks[index]
                if rank.up:
                    rank.client.abort_requests(ids)

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)

    # ------------------------------------------------------------------------ outputs
    def _from_rank(self, index: int, item: EngineCoreOutputs | BaseException) -> None:
        """A rank client's delivery: outputs, or the error that ended that rank."""
        with self.lock:
            rank = self.ranks[index]
            if self.closing or not rank.up or rank.client is None:
                return
            if isinstance(item, BaseException):
                self._rank_lost(rank, str(item))
                return
            self._account(rank, item)
        self._put(item)

    def _account(self, rank: _Rank, outputs: EngineCoreOutputs) -> None:
        """The ledger and the router's view after a rank's outputs (under the lock)."""
        outputs.engine_index = rank.index
        if outputs.scheduler_stats is not None:
            rank.load.stats = outputs.scheduler_stats
        for out in outputs.outputs:
            entry = self.in_flight.get(out.request_id)
            if entry is None or entry.rank != rank.index:
                continue
            entry.produced.extend(out.new_token_ids)
            if out.finished:
                del self.in_flight[out.request_id]
                rank.load.unfinished -= 1
                request = entry.request
                # Its output's blocks are in that rank's cache too (a next chat turn's prefix).
                tokens = request.prompt_token_ids + request.resumed_token_ids + entry.produced
                rank.load.record.add(self.router.block_hashes(tokens, entry.hashes, entry.salt))
        now = time.monotonic()
        if now >= self.next_stats_log and outputs.outputs:
            self.next_stats_log = now + _STATS_LOG_INTERVAL_S
            logger.info("data parallel: %s", self._stats_line())

    def _stats_line(self) -> str:
        parts = []
        for rank in self.ranks:
            if rank.up:
                stats = rank.load.stats
                parts.append(f"dp{rank.index} running {stats.num_running} waiting "
                             f"{stats.num_waiting} KV {stats.kv_cache_usage:.0%}")  # fmt: skip
            else:
                parts.append(f"dp{rank.index} down")
        live = self._live()
        running = sum(r.load.stats.num_running for r in live)
        waiting = sum(r.load.stats.num_waiting for r in live)
        return (f"{len(live)}/{self.size} ranks up, running {running}, waiting {waiting}; "
                + "; ".join(parts))  # fmt: skip

    def _rank_lost(self, rank: _Rank, cause: str) -> None:
        """Marks the rank down and moves its unfinished requests to the live ranks (under
        the lock); with none left, the client is dead."""
        rank.up = False
        rank.cause = cause
        client, rank.client = rank.client, None
        self.num_rank_failures += 1
        moved = [e for e in self.in_flight.values() if e.rank == rank.index]
        rank.load.unfinished = 0
        rank.load.record.clear()
        logger.error("data-parallel rank %d is down (%s); %d unfinished requests move to the "
                     "other ranks", rank.index, cause, len(moved))  # fmt: skip
        self._retire(client)
        self.launcher.lost(rank.index)
        restarts = self.launcher.restarts(rank.index)
        if not self._live() and not any(self.launcher.restarts(r.index) for r in self.ranks):
            self._die(f"every data-parallel rank is down (rank {rank.index}: {cause})")
            return
        self.num_resubmitted += len(moved)
        self._route([continuation(e.request, e.produced) for e in moved])  # or parks them
        if restarts:
            threading.Thread(target=self._restart, args=(rank.index,), daemon=True,
                             name=f"dp-restart-{rank.index}").start()  # fmt: skip

    @staticmethod
    def _retire(client: Any) -> None:
        """Shuts a rank's client down without waiting: its asyncio tasks are cancelled here
        (on the loop's thread), the rest (stopping a core, up to seconds) on a thread."""
        stop_receiving = getattr(client, "stop_receiving", None)
        if stop_receiving is not None:
            stop_receiving()
        threading.Thread(target=client.shutdown, daemon=True, name="dp-rank-stop").start()

    def _restart(self, index: int) -> None:
        """Brings a lost rank back (a new Ray actor, a headless daemon registering again)
        and puts it back in the routing; requests parked while no rank was up go to it.
        While no rank at all is up, gives up after NO_RANK_TIMEOUT_S: the client is dead."""
        down_since = time.monotonic()
        while True:
            try:
                self._connect_rank(index, _RESTART_POLL_S)
                break
            except Exception as e:
                with self.lock:
                    if self.closing or self.dead is not None:
                        return
                    if not self._live() and time.monotonic() - down_since > NO_RANK_TIMEOUT_S:
                        self._die(f"every data-parallel rank is down; rank {index} did not "
                                  f"come back within {NO_RANK_TIMEOUT_S:.0f} s: {e}")  # fmt: skip
                        return
                if not isinstance(e, TimeoutError):
                    logger.warning("data-parallel rank %d did not come back yet: %s", index, e)
                    time.sleep(_RESTART_POLL_S)
        with self.lock:
            parked = [e for e in self.in_flight.values() if e.rank == _PARKED]
            self._route([continuation(e.request, e.produced) for e in parked])

    def _die(self, reason: str) -> None:
        self.dead = reason
        self._put(EngineDeadError(reason))

    def _put(self, item: EngineCoreOutputs | BaseException) -> None:
        raise NotImplementedError

    # ---------------------------------------------------------------------- utilities
    def data_parallel_status(self) -> dict[str, Any]:
        """Each rank's state, and the failover counters (for /health and /metrics)."""
        with self.lock:
            return {
                "size": self.size,
                "ranks_up": len(self._live()),
                "rank_failures": self.num_rank_failures,
                "resubmitted_requests": self.num_resubmitted,
                "ranks": [self._describe(r) for r in self.ranks],
            }

    def _describe(self, rank: _Rank) -> dict[str, Any]:
        where = self.launcher.describe(rank.index)  # (a Ray rank's node: where it was lost)
        if not rank.up:
            return {"rank": rank.index, "state": "down", "cause": rank.cause, **where}
        client = rank.client
        where["address"] = client.address
        if client.proc is not None:  # a core process started here
            where["pid"] = client.proc.pid
        return {"rank": rank.index, "state": "up", **where}

    def _combine(self, method: str, results: list[tuple[_Rank, Any]]) -> Any:
        """One answer from every live rank's answer to a utility."""
        answered = [(r, v) for r, v in results if not isinstance(v, BaseException)]
        refused = [v for _, v in results if isinstance(v, ValueError)]
        if refused:  # (an adapter every rank reads alike: all or none refuse it)
            raise refused[0]
        if not answered:
            self._check_alive()
            errors = [v for _, v in results if isinstance(v, BaseException)]
            raise errors[0] if errors else EngineDeadError("no data-parallel rank is up")
        if method == "get_stats":
            return combine_stats([(r.index, v) for r, v in answered], self.data_parallel_status())
        if method == "reset_prefix_cache":
            with self.lock:
                for rank, _ in answered:
                    rank.load.record.clear()
            return all(v for _, v in answered)
        if method == "check_health":
            return True  # some rank is up and healthy (each one's state: data_parallel_status)
        if method in ("add_lora", "remove_lora"):
            return any(v for _, v in answered)
        if method == "list_loras":
            return sorted({lora_id for _, v in answered for lora_id in v})
        return [v for _, v in answered]

    def shutdown(self) -> None:
        with self.lock:
            self.closing = True
            clients = [r.client for r in self.ranks if r.client is not None]
            for rank in self.ranks:
                rank.up, rank.client = False, None
            if self.dead is None:
                self.dead = "the client was shut down"
        for client in clients:  # an asyncio client's tasks end on the loop's thread
            stop_receiving = getattr(client, "stop_receiving", None)
            if stop_receiving is not None:
                stop_receiving()
        threads = [threading.Thread(target=c.shutdown, daemon=True) for c in clients]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10.0)
        self.launcher.close()


class DPClient(_DataParallel, EngineCoreClient):
    """Data parallelism for blocking callers (LLM): every rank's output thread delivers into
    one queue that get_output reads."""

    def __init__(
        self, config: EngineConfig, launcher: RankLauncher | None = None, auth_token: str = ""
    ) -> None:
        self.outputs: queue.Queue[EngineCoreOutputs | BaseException] = queue.Queue()
        super().__init__(config, launcher, auth_token)

    def _make_rank_client(self, index: int, timeout: float) -> SyncMPClient:
        return self.launcher.connect(index, _SyncRankClient, weakref.ref(self), timeout)

    def _put(self, item: EngineCoreOutputs | BaseException) -> None:
        self.outputs.put(item)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | None:
        self._check_alive()
        return take_output(self.outputs, timeout)

    def call_utility(self, method: str, *args: Any, timeout: float = UTILITY_TIMEOUT_S) -> Any:
        self._check_alive()
        results = []
        for rank in self._live():
            try:
                results.append((rank, rank.client.call_utility(method, *args, timeout=timeout)))
            except (EngineDeadError, AttributeError) as e:  # went down meanwhile
                results.append((rank, e))
        return self._combine(method, results)


class AsyncDPClient(_DataParallel, AsyncEngineCoreClient):
    """Data parallelism for an asyncio loop (AsyncLLM): every rank client's receiving task
    runs on the loop and delivers into one asyncio queue."""

    def __init__(
        self, config: EngineConfig, launcher: RankLauncher | None = None, auth_token: str = ""
    ) -> None:
        self.outputs: asyncio.Queue[EngineCoreOutputs | BaseException] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        super().__init__(config, launcher, auth_token)

    def _make_rank_client(self, index: int, timeout: float) -> AsyncMPClient:
        client = self.launcher.connect(index, _AsyncRankClient, weakref.ref(self), timeout)
        loop = self.loop
        if loop is not None and loop.is_running():  # a restarted rank joins the running loop
            loop.call_soon_threadsafe(client._ensure_started)
        return client

    def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self.loop is not loop:
            self.loop = loop
            self.outputs = asyncio.Queue()
            if self.dead is not None:
                self.outputs.put_nowait(EngineDeadError(self.dead))
        for rank in self._live():
            rank.client._ensure_started()

    def _put(self, item: EngineCoreOutputs | BaseException) -> None:
        loop, outputs = self.loop, self.outputs
        if loop is None or outputs is None:
            return  # nothing reads yet; a death is raised by _check_alive
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            outputs.put_nowait(item)
        else:  # a rank lost on another thread (its restart, a shutdown)
            loop.call_soon_threadsafe(outputs.put_nowait, item)

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_started()
        assert self.outputs is not None
        return await take_output_async(self.outputs)

    async def call_utility_async(
        self, method: str, *args: Any, timeout: float = UTILITY_TIMEOUT_S
    ) -> Any:
        self._ensure_started()
        self._check_alive()
        live = self._live()
        answers = await asyncio.gather(
            *(r.client.call_utility_async(method, *args, timeout=timeout) for r in live),
            return_exceptions=True,
        )
        return self._combine(method, list(zip(live, answers)))


class _RankDelivery:
    """Makes a multiprocess client one rank's: it hands what it receives (outputs, or the
    error that ended it) to the data-parallel client instead of its own queue."""

    def __init__(self, owner: weakref.ref, index: int, *args: Any, **kwargs: Any) -> None:
        self.owner, self.index = owner, index
        super().__init__(*args, **kwargs)

    def _deliver(self, item: EngineCoreOutputs | BaseException) -> None:
        owner = self.owner()
        if owner is not None:
            owner._from_rank(self.index, item)


class _SyncRankClient(_RankDelivery, SyncMPClient):
    pass


class _AsyncRankClient(_RankDelivery, AsyncMPClient):
    pass


# Stats every rank reports that add up across ranks.
_SUMMED = (
    "num_running", "num_waiting", "prefix_cache_queries", "prefix_cache_hits",
    "num_preemptions", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens", "num_blocks",
)  # fmt: skip


def combine_stats(per_rank: list[tuple[int, dict]], status: dict[str, Any]) -> dict[str, Any]:
    """The ranks' get_stats added up (counts summed, the KV usage averaged, the smallest
    max_model_len), with each rank's own under data_parallel.ranks[i].stats."""
    first = per_rank[0][1]
    total: dict[str, Any] = {k: v for k, v in first.items() if k not in ("startup_s",)}
    for key in _SUMMED:
        if key in first:
            total[key] = sum(stats.get(key, 0) for _, stats in per_rank)
    total["kv_cache_usage"] = sum(s.get("kv_cache_usage", 0.0) for _, s in per_rank) / len(per_rank)
    total["max_model_len"] = min(s["max_model_len"] for _, s in per_rank)
    positions = [s.get("spec_decode_num_accepted_tokens_per_pos", []) for _, s in per_rank]
    if any(positions):
        width = max(len(p) for p in positions)
        total["spec_decode_num_accepted_tokens_per_pos"] = [
            sum(p[i] for p in positions if i < len(p)) for i in range(width)
        ]
    if "spec_decode_acceptance_rate" in first:
        drafts, proposed = total["spec_decode_num_drafts"], total["spec_decode_num_draft_tokens"]
        accepted = total["spec_decode_num_accepted_tokens"]
        total["spec_decode_acceptance_rate"] = accepted / proposed if proposed else 0.0
        total["spec_decode_mean_acceptance_length"] = 1 + accepted / drafts if drafts else 0.0
    stats_of = dict(per_rank)
    ranks = [
        {**rank, **({"stats": stats_of[rank["rank"]]} if rank["rank"] in stats_of else {})}
        for rank in status["ranks"]
    ]
    total["data_parallel"] = {**status, "ranks": ranks}
    return total
