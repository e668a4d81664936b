"""Data-parallel routing: load-only (vLLM's) against prefix-aware, on a shared-prefix workload
that one rank's prefix cache cannot hold.

The workload is many system prompts x many users: `--systems` system prompts of
`--system-tokens` tokens each (distinct random text), each followed by `--users` different
user turns of `--user-tokens` tokens, answered with `--max-tokens` tokens; the requests come
in a shuffled order, `--concurrency` in flight at a time (a new one starts as one ends). Every
rank's KV cache is sized (`num_gpu_blocks_override`) to hold about `--cache-share` of all the
system prompts, so a rank that sees every prefix keeps evicting them, while ranks that each
see their own share can keep theirs.

Each routing is an AsyncLLM with `data_parallel_size` ranks (engine-core processes), all
started once and warmed up; `--rounds N` alternates them, each round from a cold prefix
cache. Reported per routing (best round by wall time): the prefix-cache hit rate over the
round's prompt tokens, TTFT mean and p90, output tok/s, request throughput and the share of
prompt tokens each rank got. Routings are "load" and "prefix:M" (prefix-aware within a load
margin of M; "prefix:inf" ignores load).

    python scripts/bench_data_parallel.py
    python scripts/bench_data_parallel.py --routings load prefix:8 prefix:32 prefix:inf --rounds 2
    python scripts/bench_data_parallel.py --systems 1 --users 128   # one hot prefix
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_throughput import cpu_name  # noqa: E402

WORDS = (
    "account order refund policy customer shipping invoice warranty product support manager "
    "region service contract payment delivery return status priority ticket escalate verify "
    "identity address schedule discount premium standard express"
).split()


def make_requests(args, tokenizer) -> list[tuple[int, list[int]]]:
    """(system index, prompt token ids) for every system x user pair, shuffled."""
    rng = random.Random(0)

    def text(n_tokens: int, lead: str) -> list[int]:
        ids = tokenizer.encode(lead, add_special_tokens=False)
        while len(ids) < n_tokens:
            ids += tokenizer.encode(" " + " ".join(rng.choices(WORDS, k=32)),
                                    add_special_tokens=False)  # fmt: skip
        return ids[:n_tokens]

    systems = [text(args.system_tokens, f"You are the assistant of company {s}. Rules:")
               for s in range(args.systems)]  # fmt: skip
    requests = [
        (s, systems[s] + text(args.user_tokens, f"\nUser {u} asks:"))
        for s in range(args.systems)
        for u in range(args.users)
    ]
    rng.shuffle(requests)
    return requests


async def run_round(engine, requests, args, tag: str) -> dict:
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    limit = asyncio.Semaphore(args.concurrency)
    ttfts: list[float] = []
    tokens = 0

    async def one(i: int, prompt: list[int]) -> None:
        nonlocal tokens
        async with limit:
            start = time.perf_counter()
            first = None
            count = 0
            async for out in engine.generate({"prompt_token_ids": prompt}, params, f"{tag}-{i}"):
                count = len(out.outputs[0].token_ids)
                if first is None and count:
                    first = time.perf_counter()
            tokens += count
            ttfts.append((first or time.perf_counter()) - start)

    assert await engine.reset_prefix_cache()
    before = await engine.get_stats()
    start = time.perf_counter()
    await asyncio.gather(*(one(i, prompt) for i, (_, prompt) in enumerate(requests)))
    wall = time.perf_counter() - start
    after = await engine.get_stats()
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    shares = [
        b["stats"]["prefix_cache_queries"] - a["stats"]["prefix_cache_queries"]
        for a, b in zip(before["data_parallel"]["ranks"], after["data_parallel"]["ranks"])
    ]
    ttfts.sort()
    return {
        "wall": wall,
        "hit_rate": hits / queries if queries else 0.0,
        "ttft_mean": statistics.mean(ttfts),
        "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
        "tok_s": tokens / wall,
        "req_s": len(requests) / wall,
        "shares": [s / max(sum(shares), 1) for s in shares],
    }


def engine_args(args, routing: str, blocks: int) -> dict:
    kind, _, margin = routing.partition(":")
    extra = {"data_parallel_routing": kind}
    if kind == "prefix":
        extra["data_parallel_prefix_margin"] = 10**9 if margin == "inf" else int(margin or 32)
    return dict(
        skip_tokenizer_init=True,
        data_parallel_size=args.data_parallel_size,
        num_gpu_blocks_override=blocks,
        max_model_len=args.system_tokens + args.user_tokens + args.max_tokens + 16,
        max_num_seqs=args.concurrency,
        **({"dtype": args.dtype} if args.dtype else {}),
        **extra,
    )


async def main_async(args) -> None:
    import torch
    import transformers
    from transformers import AutoTokenizer

    from tokenmill import AsyncLLM
    from tokenmill.protocol.default_model import resolve_model

    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    requests = make_requests(args, tokenizer)
    block = 16
    prefix_blocks = args.systems * (args.system_tokens // block)
    # Room for the running requests' own blocks (their system prompt's are shared), beyond
    # the share of system prompts the cache holds.
    own = -(-(args.user_tokens + args.max_tokens) // block) + 1
    blocks = int(args.cache_share * prefix_blocks) + own * (
        args.concurrency // args.data_parallel_size + 2
    )
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{platform.machine()} {cpu_name()}, {os.cpu_count()} CPUs")  # fmt: skip
    print(f"{len(requests)} requests: {args.systems} system prompts x {args.users} users, "
          f"{args.system_tokens} + {args.user_tokens} prompt tokens, {args.max_tokens} output "
          f"tokens, concurrency {args.concurrency}; DP={args.data_parallel_size}, {blocks} KV "
          f"blocks per rank (all system prompts: {prefix_blocks})")  # fmt: skip
    engines = {}
    try:
        for routing in args.routings:
            engine = AsyncLLM(path, **engine_args(args, routing, blocks))
            await run_round(engine, requests[: args.concurrency], args, f"warm-{routing}")
            engines[routing] = engine
        results: dict[str, list[dict]] = {r: [] for r in args.routings}
        for r in range(args.rounds):
            for routing, engine in engines.items():
                cell = await run_round(engine, requests, args, f"{routing}-{r}")
                results[routing].append(cell)
                print(f"  round {r + 1} {routing}: {cell['wall']:.1f} s, hit rate "
                      f"{cell['hit_rate']:.1%}, TTFT {cell['ttft_mean'] * 1e3:.0f} ms",
                      flush=True)  # fmt: skip
    finally:
        for engine in engines.values():
            engine.shutdown()
    print()
    print(f"best of {args.rounds} round(s) by wall time")
    print("| routing | prefix hit rate | TTFT mean ms | TTFT p90 ms | output tok/s | req/s | "
          "prompt tokens per rank |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for routing, cells in results.items():
        best = min(cells, key=lambda c: c["wall"])
        shares = " / ".join(f"{s:.0%}" for s in best["shares"])
        print(f"| {routing} | {best['hit_rate']:.1%} | {best['ttft_mean'] * 1e3:.0f} | "
              f"{best['ttft_p90'] * 1e3:.0f} | {best['tok_s']:.1f} | {best['req_s']:.2f} | "
              f"{shares} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="SmolLM2-135M-Instruct",
                        help="default: SmolLM2-135M-Instruct's HF folder")
    parser.add_argument("--data-parallel-size", type=int, default=2)
    parser.add_argument("--routings", nargs="+", default=["load", "prefix:32"])
    parser.add_argument("--systems", type=int, default=16)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--user-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--cache-share", type=float, default=0.6,
                        help="of all system prompts, what one rank's KV cache holds")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--dtype", default=None, help="default: the engine's")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
