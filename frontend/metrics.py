"""Serving metrics in Prometheus form, under vLLM's names with a `tokenmill:` prefix.

`PrometheusStatLogger` is fed by AsyncLLM: every message from the core carries the
scheduler's stats (gauges, and running totals that become counters here, labelled by the
`engine` that sent them, as vLLM labels its data-parallel ranks), and every output
token updates the request's latencies (time to first token, inter-token latency, time per
output token, end-to-end latency, queue time in the core, and the prefill / decode /
inference phases, timed here from the core's queue time: the first step is taken to start
at arrival + queue time). With LoRA on (`set_lora_config`), vLLM's lora_requests_info names
the adapters of the running and waiting requests. It writes into its own
`CollectorRegistry`, so that several engines in one process do not collide.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenmill.protocol.messages import EngineCoreOutputs, SchedulerStats

PREFIX = "tokenmill:"

# Bucket bounds (seconds) as vLLM's, which cover a CPU's slow steps as well as a GPU's.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
_LOOP_LAG_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


_N_BUCKETS = (1, 2, 5, 10, 20)


@dataclass
class _RequestTimes:
    arrival: float  # time.monotonic() when the frontend got the request
    num_prompt_tokens: int
    first_token: float | None = None
    last_token: float = 0.0
    num_tokens: int = 0
    scheduled: float | None = None  # arrival + the core's queue time: its first step


class PrometheusStatLogger:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            metric = Gauge(PREFIX + name, doc, labels, registry=self.registry)
            return metric.labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            metric = Counter(PREFIX + name, doc, labels, registry=self.registry)
            return metric.labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)
            return metric.labels(model_name)

        # The scheduler's figures, per engine core (a data-parallel rank; "0" without DP).
        per_engine = ["model_name", "engine"]

        def engine_gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, per_engine, registry=self.registry)

        def engine_counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, per_engine, registry=self.registry)

        self.running = engine_gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = engine_gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = engine_gauge(
            "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)."
        )
        self.prefix_queries = engine_counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = engine_counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.preemptions = engine_counter("num_preemptions", "Requests preempted by the scheduler.")
        self.spec_drafts = engine_counter(
            "spec_decode_num_drafts", "Request steps that verified a speculative proposal."
        )
        self.spec_draft_tokens = engine_counter("spec_decode_num_draft_tokens", "Tokens proposed.")
        self.spec_accepted = engine_counter(
            "spec_decode_num_accepted_tokens", "Proposed tokens accepted."
        )
        self._spec_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Proposed tokens accepted, by position in the proposal.",
            [*per_engine, "position"],
            registry=self.registry,
        )
        # Data parallelism (set from the client's state at each scrape).
        self.engine_up = engine_gauge("engine_up", "1 while the engine core serves, else 0.")
        self.rank_failures = counter(
            "data_parallel_rank_failures", "Data-parallel ranks lost (core or worker death)."
        )
        self.resubmitted = counter(
            "data_parallel_resubmitted_requests",
            "Requests moved to another rank when theirs was lost.",
        )
        self._dp_counts = (0, 0)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests started.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to the first output token.", _TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between a request's outputs.", _ITL_BUCKETS
        )
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Per request: time after the first token / further tokens.",
            _ITL_BUCKETS,
        )
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to the last token.", _LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "request_queue_time_seconds",
            "Time in the core's waiting queue before the first step.",
            _LATENCY_BUCKETS,
        )
        self.request_success = Counter(
            PREFIX + "request_success",
            "Requests finished, by reason (stop, length, abort, error).",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per finished request.", _TOKEN_BUCKETS
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per finished request.", _TOKEN_BUCKETS
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total",
            "Tokens per engine step seen here (prompt tokens of requests that got their first "
            "token, and generated tokens).",
            _TOKEN_BUCKETS,
        )
        self.params_n = histogram("request_params_n", "The n of each request.", _N_BUCKETS)
        self.params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens of each request.", _TOKEN_BUCKETS
        )
        self.inference_time = histogram(
            "request_inference_time_seconds",
            "Per request: from its first step to its last token.",
            _LATENCY_BUCKETS,
        )
        self.prefill_time = histogram(
            "request_prefill_time_seconds",
            "Per request: from its first step to its first token.",
            _LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "request_decode_time_seconds",
            "Per request: from its first token to its last.",
            _LATENCY_BUCKETS,
        )
        self.loop_lag = histogram(
            "event_loop_lag_seconds",
            "How late the server's event loop woke a 10 ms timer (stalls).",
            _LOOP_LAG_BUCKETS,
        )
        self.loop_lag_max = gauge(
            "event_loop_lag_max_seconds", "The longest event-loop stall since start."
        )
        self._max_lag = 0.0
        self._lora_info: Gauge | None = None  # with LoRA on (set_lora_config)
        self._max_loras = 0
        self._totals: dict[int, SchedulerStats] = {}  # per engine, as last sent
        self._requests: dict[str, _RequestTimes] = {}

    def set_cache_config(self, cache: dict[str, str]) -> None:
        """vLLM's cache_config_info: the KV cache's settings as labels of a gauge at 1."""
        names = sorted(cache)
        info = Gauge(PREFIX + "cache_config_info", "The KV cache's configuration.", names,
                     registry=self.registry)  # fmt: skip
        info.labels(*(str(cache[name]) for name in names)).set(1)

    def set_lora_config(self, max_loras: int) -> None:
        """LoRA is on: vLLM's lora_requests_info follows the adapters in use, as labels
        (comma-separated adapter names) of a gauge set to the time they were seen."""
        self._max_loras = max_loras
        self._lora_info = Gauge(
            PREFIX + "lora_requests_info",
            "Running stats on LoRA requests: the adapters of running and waiting requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=self.registry,
        )

    # ---------------------------------------------------------------- from AsyncLLM
    def on_request(
        self,
        core_ids: list[str],
        num_prompt_tokens: int,
        arrival: float,
        n: int = 1,
        max_tokens: int | None = None,
    ) -> None:
        """A request (its n samples are core_ids) the frontend sends."""
        self.params_n.observe(n)
        if max_tokens is not None:
            self.params_max_tokens.observe(max_tokens)
        for core_id in core_ids:
            self._requests[core_id] = _RequestTimes(arrival, num_prompt_tokens)

    def on_abort(self, core_ids: list[str]) -> None:
        for core_id in core_ids:
            if self._requests.pop(core_id, None) is not None:
                self.request_success.labels(self.model_name, "abort").inc()

    def on_finished(self, core_ids: list[str]) -> None:
        """Requests the frontend ended (a stop string): the core reports no finish."""
        now = time.monotonic()
        for core_id in core_ids:
            times = self._requests.pop(core_id, None)
            if times is not None:
                self._record_finish(times, now, "stop")

    def on_outputs(self, outputs: EngineCoreOutputs) -> None:
        now = time.monotonic()
        if outputs.scheduler_stats is not None:
            self._record_scheduler(outputs.scheduler_stats, outputs.engine_index)
        step_tokens = 0
        for out in outputs.outputs:
            times = self._requests.get(out.request_id)
            if times is None:
                continue
            if out.queue_time is not None:
                self.queue_time.observe(out.queue_time)
                times.scheduled = times.arrival + out.queue_time
            if out.new_token_ids:
                if times.first_token is None:
                    times.first_token = now
                    self.ttft.observe(now - times.arrival)
                    self.prompt_tokens.inc(times.num_prompt_tokens)
                    step_tokens += times.num_prompt_tokens
                    if times.scheduled is not None:
                        self.prefill_time.observe(max(now - times.scheduled, 0.0))
                else:
                    self.itl.observe(now - times.last_token)
                times.last_token = now
                times.num_tokens += len(out.new_token_ids)
                step_tokens += len(out.new_token_ids)
                self.generation_tokens.inc(len(out.new_token_ids))
            if out.finished:
                del self._requests[out.request_id]
                self._record_finish(times, now, str(out.finish_reason))
        if step_tokens:
            self.iteration_tokens.observe(step_tokens)

    def _record_finish(self, times: _RequestTimes, now: float, reason: str) -> None:
        self.request_success.labels(self.model_name, reason).inc()
        if reason in ("error", "abort"):
            return
        self.e2e.observe(now - times.arrival)
        self.request_prompt_tokens.observe(times.num_prompt_tokens)
        self.request_generation_tokens.observe(times.num_tokens)
        if times.first_token is not None and times.num_tokens > 1:
            self.tpot.observe((now - times.first_token) / (times.num_tokens - 1))
        if times.first_token is not None:
            self.decode_time.observe(now - times.first_token)
        if times.scheduled is not None:
            self.inference_time.observe(max(now - times.scheduled, 0.0))

    def on_loop_lag(self, seconds: float) -> None:
        self.loop_lag.observe(seconds)
        if seconds > self._max_lag:
            self._max_lag = seconds
            self.loop_lag_max.set(seconds)

    def set_data_parallel(self, status: dict | None) -> None:
        """Each rank up or down, and the failover counts (the DP client's status)."""
        if status is None:
            return
        for rank in status["ranks"]:
            self.engine_up.labels(self.model_name, str(rank["rank"])).set(rank["state"] == "up")
        failures, resubmitted = status["rank_failures"], status["resubmitted_requests"]
        self.rank_failures.inc(failures - self._dp_counts[0])
        self.resubmitted.inc(resubmitted - self._dp_counts[1])
        self._dp_counts = (failures, resubmitted)

    def _record_scheduler(self, stats: SchedulerStats, engine: int = 0) -> None:
        labels = (self.model_name, str(engine))
        self.running.labels(*labels).set(stats.num_running)
        self.waiting.labels(*labels).set(stats.num_waiting)
        self.kv_usage.labels(*labels).set(stats.kv_cache_usage)
        if self._lora_info is not None:
            self._lora_info.labels(
                str(self._max_loras),
                ",".join(sorted(stats.waiting_lora_adapters)),
                ",".join(sorted(stats.running_lora_adapters)),
            ).set_to_current_time()
        # The core sends running totals; counters take what is new since the last message
        # (a daemon's totals from before this frontend attached count too).
        last = self._totals.get(engine, SchedulerStats())
        for counter, now, before in (
            (
                self.prefix_queries.labels(*labels),
                stats.prefix_cache_queries,
                last.prefix_cache_queries,
            ),
            (self.prefix_hits.labels(*labels), stats.prefix_cache_hits, last.prefix_cache_hits),
            (self.preemptions.labels(*labels), stats.num_preemptions, last.num_preemptions),
            (
                self.spec_drafts.labels(*labels),
                stats.spec_decode_num_drafts,
                last.spec_decode_num_drafts,
            ),
            (
                self.spec_draft_tokens.labels(*labels),
                stats.spec_decode_num_draft_tokens,
                last.spec_decode_num_draft_tokens,
            ),
            (
                self.spec_accepted.labels(*labels),
                stats.spec_decode_num_accepted_tokens,
                last.spec_decode_num_accepted_tokens,
            ),
            *(
                (self._spec_per_pos.labels(*labels, str(pos)), now, before)
                for pos, (now, before) in enumerate(
                    zip(
                        stats.spec_decode_num_accepted_tokens_per_pos,
                        last.spec_decode_num_accepted_tokens_per_pos
                        or [0] * len(stats.spec_decode_num_accepted_tokens_per_pos),
                    )
                )
            ),
        ):
            if now > before:
                counter.inc(now - before)
            elif now < before:  # a restarted daemon counts from zero again
                counter.inc(now)
        self._totals[engine] = stats
