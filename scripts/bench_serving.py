"""Serving benchmark: streams a workload over HTTP to any OpenAI-compatible server.

Every request goes to /v1/completions (or /v1/chat/completions with `--endpoint chat`) with
`stream=true` and `stream_options={"include_usage": true}`. The client (asyncio + httpx, raw SSE
lines) timestamps every chunk that carries text and reports, in one markdown table:
  TTFT  time to the first chunk with text
  TPOT  per request (end - first chunk) / (output tokens - 1): the decode time per token
  ITL   gaps between consecutive text chunks (a chunk may carry several tokens)
  E2E   time from sending a request to the end of its stream
Output tokens come from the final `usage` chunk; a server that sends none has its text chunks
counted instead (the table says so). TTFT, TPOT and ITL are in ms, E2E in s.

`--endpoint chat --tools required` is a tool-calling workload: every request brings two
function tools and tool_choice "required" (its answer constrained to calls; `auto` hands it to
the server's tool parser); the streamed tool-call deltas count as the answer's chunks. Embedding
throughput against HF has its own script, scripts/bench_embeddings.py.

Workload: `--dataset random` (the default) makes `--num-prompts` prompts of `--input-len` random
English words, seeded by `--seed`; with `--tokenizer PATH` only words that are one token each
are drawn, so every prompt is exactly `--input-len` tokens long (the chat template, with
`--endpoint chat`, adds its own). `--dataset FILE` reads prompts from a JSON list or a JSONL
file, each item a string or {"prompt": ...}. Requests arrive all at once (`--request-rate inf`,
the default) or as a Poisson process of R requests per second, at most `--max-concurrency` in
flight. `--warmup` requests (with a prompt of their own, so that no prefix cache is warmed for
the timed ones) go first and are not counted.

    # a server that already runs
    python scripts/bench_serving.py --base-url http://127.0.0.1:8000/v1 --num-prompts 32
    # start tokenmill's server, then HF's `transformers serve --continuous-batching`, one
    # after the other on the same port, and print both in one table
    python scripts/bench_serving.py --launch-tokenmill --launch-hf --num-prompts 16 \
        --save-json /tmp/serving.jsonl
    # print saved results (one row per run)
    python scripts/bench_serving.py --compare /tmp/serving.jsonl

`--launch CMD` starts any server command ({python}, {model_path}, {host} and {port} are filled
in), waits until its /v1/models answers (`--ready-timeout`), runs the benchmark and stops the
server's whole process group again, also on Ctrl-C, SIGTERM or an error. The presets serve
`--model-path` (default: the prepared SmolLM2-135M-Instruct folder) with HF_HUB_OFFLINE=1:
  tokenmill  {python} -m tokenmill.frontend.server {model_path} --host {host} --port {port}
  hf         {python} -m transformers.cli.transformers serve {model_path} --continuous-batching
             --host {host} --port {port}, plus `--hf-args` (on a machine without CUDA they
             default to `--device cpu --cb-num-blocks 128`: 128 blocks of 256 tokens, 1.5 GB
             in fp32 for SmolLM2, instead of 60% of the machine's RAM)
HF's server answers only to the model name it was started with (the path, as given) and
rejects unknown fields such as `ignore_eos` (HTTP 422), so do not pass `--ignore-eos` with it.
Its continuous batching also keeps the sampling settings of the first request it served (the
warm-up's) for every later one. Without `--model` the first id of /v1/models is sent.

After each run, a server whose /metrics (Prometheus text, at the base URL without /v1) has
metrics named *event_loop* gets those samples printed (histogram buckets left out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

try:
    import httpx
except ImportError:  # this virtualenv ships the fork `httpx2` (the openai client's), same API
    import httpx2 as httpx

# Common English words; most are one token (with their leading space) in BPE vocabularies.
WORDS = """
the of and to in is was for on with as by at from that this it be are an or have not but had
his her they you she he we all were which their one there been has more will would about if
out up so what when who can said time new some could them other than then now only its may
first also after two like our over such into year years most made way well many before work
back just where through long much good people state world day three right old great house
high small large city part life under place water while must last school might name home
never again left end since both each number show very need big white story group book open
line light word power music money night market family ocean river point girl boy land food
green blue red black tree road field car sun moon star rain snow wind fire stone paper glass
door room table chair window floor wall garden street bridge train ship plane horse bird fish
dog cat apple bread milk salt sugar tea coffee morning evening summer winter spring autumn
""".split()

TOKENMILL_CMD = "{python} -m tokenmill.frontend.server {model_path} --host {host} --port {port}"
HF_CMD = (
    "{python} -m transformers.cli.transformers serve {model_path} --continuous-batching "
    "--host {host} --port {port}"
)
# HF's continuous batching sizes its KV cache at 60% of the machine's RAM on the CPU.
HF_CPU_ARGS = "--device cpu --cb-num-blocks 128"


# ----------------------------------------------------------------------------------------------
# Workload


def word_prompts(num: int, length: int, seed: int, tokenizer=None) -> list[str]:
    """`num` prompts of `length` random words; exactly `length` tokens each with a tokenizer."""
    words = WORDS
    if tokenizer is not None:
        # A word that is one token with its leading space (and without it, for the first word
        # of a prompt) adds exactly one token: BPE pre-tokenizers split at the spaces.
        def one_token(text: str) -> bool:
            return len(tokenizer.encode(text, add_special_tokens=False)) == 1

        words = [w for w in dict.fromkeys(WORDS) if one_token(" " + w) and one_token(w)]
        if len(words) < 20:
            raise SystemExit(f"only {len(words)} one-token words in this tokenizer's vocabulary")
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(length)) for _ in range(num)]


def file_prompts(path: str, num: int) -> list[str]:
    """The first `num` prompts of a JSON list or a JSONL file (strings or {"prompt": ...})."""
    with open(path) as f:
        text = f.read()
    try:
        items = json.loads(text)
        if not isinstance(items, list):
            items = [items]
    except json.JSONDecodeError:  # one JSON value per line
        items = [json.loads(line) for line in text.splitlines() if line.strip()]
    prompts = [item if isinstance(item, str) else item["prompt"] for item in items]
    if len(prompts) < num:
        print(f"note: {path} holds {len(prompts)} prompts, fewer than --num-prompts {num}")
    return prompts[:num]


def load_tokenizer(path: str | None):
    if path is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# The tools of `--tools` (an agent's two lookups): the answer calls them, in OpenAI's format.
BENCH_TOOLS = [
    {"type": "function", "function": {"name": "search", "description": "Search the web",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                    "max_results": {"type": "integer"}}, "required": ["query"]}}},
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
]  # fmt: skip


# ----------------------------------------------------------------------------------------------
# One streamed request


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    sent: float = 0.0  # perf_counter() when the request went out
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried text
    end: float = 0.0  # the end of the stream
    output_tokens: int = 0
    prompt_tokens: int | None = None
    has_usage: bool = False

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.sent


def make_payload(args: argparse.Namespace, model: str, prompt: str, max_tokens: int) -> dict:
    payload: dict = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": prompt}]
        if args.tools != "off":
            payload["tools"] = BENCH_TOOLS
            payload["tool_choice"] = args.tools
    else:
        payload["prompt"] = prompt
    if args.ignore_eos:  # not an OpenAI field: only sent when asked for
        payload["ignore_eos"] = True
    return payload


def chunk_text(chunk: dict) -> str:
    """The text a completions or chat-completions stream chunk carries ("" for none): a
    chat delta's content, or its tool calls' names and argument fragments."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "text" in choice:
        return choice["text"] or ""
    delta = choice.get("delta") or {}
    functions = [call.get("function") or {} for call in delta.get("tool_calls") or []]
    calls = "".join((f.get("name") or "") + (f.get("arguments") or "") for f in functions)
    return (delta.get("content") or "") + calls


async def send_request(client: httpx.AsyncClient, url: str, payload: dict) -> RequestResult:
    result = RequestResult(sent=time.perf_counter())
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                result.end = time.perf_counter()
                return result
            async for line in response.aiter_lines():
                now = time.perf_counter()
                # SSE: one "data: {...}" line per event, blank lines in between. The stream
                # ends with "data: [DONE]", or (HF's server) just closes after its last chunk.
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    result.error = f"stream error: {str(chunk['error'])[:300]}"
                    break
                if chunk_text(chunk):
                    result.chunk_times.append(now)
                usage = chunk.get("usage")
                if usage:
                    result.has_usage = True
                    result.output_tokens = usage.get("completion_tokens") or 0
                    result.prompt_tokens = usage.get("prompt_tokens")
    except Exception as e:  # a refused connection, a timeout, a broken stream: one failure
        result.error = f"{type(e).__name__}: {e}"[:300]
    result.end = time.perf_counter()
    if not result.error:
        result.ok = True
        if not result.has_usage:
            result.output_tokens = len(result.chunk_times)
    return result


# ----------------------------------------------------------------------------------------------
# The benchmark


def percentiles(values: list[float], scale: float) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    v = np.asarray(values) * scale
    return {
        "mean": float(v.mean()),
        "p50": float(np.percentile(v, 50)),
        "p99": float(np.percentile(v, 99)),
    }


def summarize(results: list[RequestResult], duration: float, prompt_lens: list[int]) -> dict:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    # Prompt tokens as the server counted them (the chat template included), else our count.
    prompt_tokens = sum(
        r.prompt_tokens if r.prompt_tokens is not None else n
        for r, n in zip(results, prompt_lens)
        if r.ok
    )
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [
        (r.e2e - r.ttft) / (r.output_tokens - 1)
        for r in ok
        if r.ttft is not None and r.output_tokens > 1
    ]
    itls = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    chunks = sum(len(r.chunk_times) for r in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens,
        "output_throughput": output_tokens / duration,
        "total_throughput": (output_tokens + prompt_tokens) / duration,
        "ttft_ms": percentiles(ttfts, 1e3),
        "tpot_ms": percentiles(tpots, 1e3),
        "itl_ms": percentiles(itls, 1e3),
        "e2e_s": percentiles([r.e2e for r in ok], 1.0),
        "text_chunks": chunks,
        "usage_missing": any(not r.has_usage for r in ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


async def run_benchmark(
    args: argparse.Namespace, base_url: str, model: str | None, prompts: list[str]
) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    # No client-side queue (one connection per request in flight), no proxy for a local server.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        headers=headers,
        timeout=httpx.Timeout(args.request_timeout),
        limits=limits,
        trust_env=False,
    ) as client:
        if model is None:
            model = await first_model(client, base_url)
        path = "/chat/completions" if args.endpoint == "chat" else "/completions"
        url = base_url + path
        print(f"benchmarking {url} (model {model!r})")

        # Warm-up: prompts of their own (no prefix cache hits for the timed ones), one by one.
        warm_prompts = word_prompts(args.warmup, args.input_len, args.seed + 1)
        for prompt in warm_prompts:
            r = await send_request(client, url, make_payload(args, model, prompt, args.warmup_len))
            if not r.ok:
                raise RuntimeError(f"warm-up request failed: {r.error}")

        # Arrival times: all at once, or a Poisson process (exponential gaps, seeded).
        rng = random.Random(args.seed)
        offsets, t = [], 0.0
        for _ in prompts:
            offsets.append(t)
            if math.isfinite(args.request_rate):
                t += rng.expovariate(args.request_rate)
        limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def one(prompt: str) -> RequestResult:
            payload = make_payload(args, model, prompt, args.output_len)
            if limit is None:
                return await send_request(client, url, payload)
            async with limit:
                return await send_request(client, url, payload)

        start = time.perf_counter()
        tasks = []
        for prompt, offset in zip(prompts, offsets):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(prompt)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start

        metrics_lines = await event_loop_metrics(client, base_url)
    return {"model": model, "results": results, "duration": duration, "metrics": metrics_lines}


async def first_model(client: httpx.AsyncClient, base_url: str) -> str:
    response = await client.get(base_url + "/models")
    response.raise_for_status()
    data = response.json()["data"]
    if not data:
        raise RuntimeError(f"{base_url}/models lists no model; pass --model")
    return data[0]["id"]


async def event_loop_metrics(client: httpx.AsyncClient, base_url: str) -> list[str]:
    """The sample lines of /metrics whose metric name contains `event_loop` (else none)."""
    root = base_url[: -len("/v1")] if base_url.endswith("/v1") else base_url
    try:
        response = await client.get(root + "/metrics", timeout=5.0)
        if response.status_code != 200:
            return []
        lines = response.text.splitlines()
    except Exception:
        return []
    # Histogram buckets and *_created timestamps are left out: count, sum and gauges remain.
    names = [(line.split()[0].split("{")[0], line) for line in lines if line and line[0] != "#"]
    return [
        line
        for name, line in names
        if "event_loop" in name and not name.endswith(("_bucket", "_created"))
    ]


def benchmark_once(
    args: argparse.Namespace,
    label: str,
    base_url: str,
    model: str | None,
    prompts: list[str],
    prompt_lens: list[int],
) -> dict:
    """Runs the workload against one server and returns the record saved by --save-json."""
    run = asyncio.run(run_benchmark(args, base_url, model, prompts))
    record = {
        "label": label,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "base_url": base_url,
        "model": run["model"],
        "endpoint": "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions",
        "tools": args.tools,
        "config": {
            "dataset": args.dataset,
            "num_prompts": len(prompts),
            "input_len": args.input_len if args.dataset == "random" else None,
            "output_len": args.output_len,
            "temperature": args.temperature,
            "ignore_eos": args.ignore_eos,
            "request_rate": args.request_rate if math.isfinite(args.request_rate) else None,
            "max_concurrency": args.max_concurrency,
            "seed": args.seed,
        },
        **summarize(run["results"], run["duration"], prompt_lens),
    }
    if run["metrics"]:
        print(f"\n{label}: event-loop metrics from /metrics")
        for line in run["metrics"]:
            print(f"  {line}")
    return record


# ----------------------------------------------------------------------------------------------
# Launching servers


def port_in_use(host: str, port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


def stop_process_group(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM to the server's whole process group, SIGKILL to whatever is left after `grace`."""
    # A second Ctrl-C or SIGTERM must not cut this short and leave the server running.
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        _stop_group(proc, grace)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop_group(proc: subprocess.Popen, grace: float) -> None:
    pgid = proc.pid  # the server leads a session of its own (start_new_session)
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        proc.poll()
        try:
            os.killpg(pgid, 0)  # does any process of the group remain?
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        print(f"warning: server process {proc.pid} did not exit", file=sys.stderr)


def wait_ready(proc: subprocess.Popen, base_url: str, timeout: float, log_path: str) -> None:
    """Polls /v1/models until it answers 200; fails if the server exits or takes too long."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with code {proc.returncode} before it was ready; "
                    f"last lines of {log_path}:\n{tail(log_path)}"
                )
            try:
                if client.get(base_url + "/models").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout:.0f}s; see {log_path}:\n{tail(log_path)}")


def tail(path: str, lines: int = 20) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def launch_and_benchmark(
    args: argparse.Namespace,
    label: str,
    command: str,
    prompts: list[str],
    prompt_lens: list[int],
) -> dict | None:
    """Starts `command`, benchmarks it once it answers, and always stops it again."""
    host, port = "127.0.0.1", args.port
    if port_in_use(host, port):
        raise SystemExit(f"port {port} is in use: stop that server or pass another --port")
    argv = [
        part.format(python=sys.executable, model_path=args.model_path, host=host, port=port)
        for part in shlex.split(command)
    ]
    base_url = f"http://{host}:{port}/v1"
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    log = tempfile.NamedTemporaryFile(
        "w", prefix=f"bench_serving_{label}_", suffix=".log", delete=False
    )
    print(f"\n[{label}] starting: {shlex.join(argv)}\n[{label}] server log: {log.name}")
    # A session of its own: the server and all its children form one process group to stop.
    proc = subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )
    try:
        t0 = time.perf_counter()
        wait_ready(proc, base_url, args.ready_timeout, log.name)
        print(f"[{label}] ready after {time.perf_counter() - t0:.1f}s")
        return benchmark_once(args, label, base_url, args.model, prompts, prompt_lens)
    except (RuntimeError, httpx.HTTPError) as e:  # this server failed: go on with the next one
        print(f"[{label}] failed: {e}", file=sys.stderr)
        return None
    finally:
        stop_process_group(proc)
        log.close()
        print(f"[{label}] stopped")


# ----------------------------------------------------------------------------------------------
# Output


def fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(records: list[dict]) -> None:
    header = ["server", "ok", "failed", "time (s)", "req/s", "out tok/s", "total tok/s"]
    for name in ("TTFT", "TPOT", "ITL", "E2E"):
        header += [f"{name} mean", f"{name} p50", f"{name} p99"]
    rows = []
    for r in records:
        row = [
            r["label"],
            str(r["completed"]),
            str(r["failed"]),
            fmt(r["duration_s"], 2),
            fmt(r["request_throughput"], 2),
            fmt(r["output_throughput"]),
            fmt(r["total_throughput"]),
        ]
        for key, digits in (("ttft_ms", 1), ("tpot_ms", 2), ("itl_ms", 2), ("e2e_s", 2)):
            row += [fmt(r[key][stat], digits) for stat in ("mean", "p50", "p99")]
        rows.append(row)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        print("| " + " | ".join(cells) + " |")
    print("TTFT, TPOT, ITL in ms; E2E in s; tokens/s from the servers' usage counts")
    for r in records:
        c = r["config"]
        rate = c["request_rate"] or "inf"  # None: all at once
        source = c["dataset"] if c["input_len"] is None else f"random, input {c['input_len']}"
        print(
            f"{r['label']}: {c['num_prompts']} prompts ({source}), "
            f"max_tokens {c['output_len']}, {r['output_tokens']} output tokens in "
            f"{r['text_chunks']} text chunks, rate {rate}, "
            f"concurrency {c['max_concurrency'] or '-'}, {r['endpoint']}"
            f"{', tools ' + r['tools'] if r.get('tools', 'off') != 'off' else ''}, {r['date']}"
        )
        if r["usage_missing"]:
            print(f"{r['label']}: no usage chunk from the server: output tokens = text chunks")
        for error in r["errors"]:
            print(f"{r['label']} error: {error}")


def load_records(paths: list[str]) -> list[dict]:
    records = []
    for path in paths:
        with open(path) as f:
            records += [json.loads(line) for line in f if line.strip()]
    return records


# ----------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    server.add_argument("--model", default=None, help="model name to send (default: /v1/models)")
    server.add_argument("--api-key", default=None)
    server.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    server.add_argument("--label", default=None, help="the table row's name (default: base URL)")

    work = parser.add_argument_group("workload")
    work.add_argument("--dataset", default="random", help="'random' or a JSON / JSONL file")
    work.add_argument("--tokenizer", default=None, help="exact --input-len with this tokenizer")
    work.add_argument("--num-prompts", type=int, default=64)
    work.add_argument("--input-len", type=int, default=128, help="words (tokens with --tokenizer)")
    work.add_argument("--output-len", type=int, default=64, help="max_tokens of every request")
    work.add_argument("--temperature", type=float, default=0.0)
    work.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true")
    work.add_argument(
        "--tools",
        choices=["off", "required", "auto", "none"],
        default="off",
        help="chat only: send two function tools with this tool_choice (a tool-calling "
        "workload; 'required' constrains every answer to calls, 'auto' needs the server's "
        "tool parser)",
    )
    work.add_argument("--seed", type=int, default=0)
    work.add_argument("--request-rate", type=float, default=math.inf, help="requests/s or inf")
    work.add_argument("--max-concurrency", type=int, default=None)
    work.add_argument("--warmup", type=int, default=1, help="uncounted requests sent first")
    work.add_argument("--request-timeout", type=float, default=600.0, help="seconds per read")

    launch = parser.add_argument_group("launching servers")
    launch.add_argument("--launch-tokenmill", action="store_true", help="start tokenmill's server")
    launch.add_argument("--launch-hf", action="store_true", help="start `transformers serve`")
    launch.add_argument("--launch", action="append", default=[], metavar="CMD")
    launch.add_argument("--model-path", default=None, help="served model (default: SmolLM2)")
    launch.add_argument("--port", type=int, default=8123)
    launch.add_argument("--ready-timeout", type=float, default=600.0)
    launch.add_argument("--tokenmill-args", default="", help="extra arguments for tokenmill")
    launch.add_argument("--hf-args", default=None, help=f"default on CPU: {HF_CPU_ARGS!r}")

    out = parser.add_argument_group("results")
    out.add_argument("--save-json", default=None, metavar="FILE", help="append results (JSONL)")
    out.add_argument("--compare", nargs="+", default=None, metavar="FILE", help="print and exit")
    args = parser.parse_args()

    if args.compare:
        print_table(load_records(args.compare))
        return
    args.warmup_len = min(args.output_len, 16)

    # SIGTERM ends the run like Ctrl-C does, so that launched servers are stopped.
    def terminate(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)

    servers = []  # (label, command) of the servers to launch, in this order
    if args.launch_tokenmill or args.launch_hf or args.launch:
        if args.model_path is None:
            from tokenmill.protocol.default_model import DEFAULT_MODEL, resolve_model

            args.model_path = resolve_model(DEFAULT_MODEL)  # the HF folder
        if args.tokenizer is None and args.dataset == "random":
            args.tokenizer = args.model_path  # exact prompt lengths for the served model
        if args.launch_tokenmill:
            servers.append(("tokenmill", f"{TOKENMILL_CMD} {args.tokenmill_args}"))
        if args.launch_hf:
            if args.hf_args is None:
                import torch

                args.hf_args = "" if torch.cuda.is_available() else HF_CPU_ARGS
            servers.append(("hf-transformers", f"{HF_CMD} {args.hf_args}"))
        for i, command in enumerate(args.launch):
            label = args.label or "server"
            servers.append((label if len(args.launch) == 1 else f"{label}-{i + 1}", command))

    tokenizer = load_tokenizer(args.tokenizer)
    if args.dataset == "random":
        prompts = word_prompts(args.num_prompts, args.input_len, args.seed, tokenizer)
    else:
        prompts = file_prompts(args.dataset, args.num_prompts)
    if not prompts:
        parser.error("no prompts to send")
    if tokenizer is not None:
        prompt_lens = [len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts]
    else:
        prompt_lens = [len(p.split()) for p in prompts]  # a rough count, used without usage
    print(
        f"{len(prompts)} prompts, {sum(prompt_lens) / len(prompts):.1f} "
        f"{'tokens' if tokenizer else 'words'} on average, max_tokens {args.output_len}"
    )

    records = []
    try:
        if servers:
            for label, command in servers:
                record = launch_and_benchmark(args, label, command, prompts, prompt_lens)
                if record is not None:
                    records.append(record)
        else:
            label = args.label or args.base_url
            base_url = args.base_url.rstrip("/")
            records.append(benchmark_once(args, label, base_url, args.model, prompts, prompt_lens))
    except (RuntimeError, httpx.HTTPError) as e:  # the server without --launch failed
        print(f"failed: {e}", file=sys.stderr)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    finally:
        if records and args.save_json:
            with open(args.save_json, "a") as f:
                for record in records:
                    f.write(json.dumps(record) + "\n")
    if records:
        print()
        print_table(records)
    if len(records) < max(1, len(servers)):
        sys.exit(1)


if __name__ == "__main__":
    main()
