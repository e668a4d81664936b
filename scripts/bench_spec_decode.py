"""Speculative decoding benchmark: output tok/s and time per output token, speculation off
vs n-gram vs a draft model, at several concurrencies, on two workloads (greedy, SmolLM2 on
the CPU by default).

Workloads:
  grounded  the answer repeats or edits a long prompt: Python functions whose variables are
            to be renamed, passages whose spelling is to be corrected (chat prompts, up to
            --max-tokens tokens, EOS ends them)
  W1-cpu    bench_throughput.py's random-token workload (the answer shares nothing with the
            prompt; every request ignores EOS and stops at its own length), its first
            2 x concurrency requests (at least 8)

Each engine is an AsyncLLM (its engine core in a process of its own), started once and
warmed up; all of them stay up and `--rounds N` alternates them (off, ngram, draft, off,
...) on every (workload, concurrency) cell, reporting each engine's best round. At
concurrency c, c requests are in flight at a time (a new one starts as one ends); tok/s is
output tokens / wall time of the cell, TPOT each request's (last token - first token) /
(tokens - 1), averaged, and acceptance the cell's accepted / proposed tokens.

    python scripts/bench_spec_decode.py
    python scripts/bench_spec_decode.py --concurrency 1 4 16 --rounds 2
    python scripts/bench_spec_decode.py --methods off ngram --workloads grounded
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_throughput import make_workload  # noqa: E402

FUNCTIONS = [
    '''def moving_average(values, window):
    """The mean of every run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    averages = [total / window]
    for index in range(window, len(values)):
        total += values[index] - values[index - window]
        averages.append(total / window)
    return averages''',
    '''def merge_intervals(intervals):
    """Merges overlapping [start, end] intervals."""
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = []
    for start, end in ordered:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged''',
]
RENAMES = [("values", "samples"), ("total", "running_sum"), ("ordered", "by_start"),
           ("merged", "result")]  # fmt: skip
PASSAGES = [
    "The committee met on Tuesday to review the budget. After a long discussion the members "
    "agreed to postpone the decision until the auditors had finished their report, and the "
    "chair asked every department to send its figures by the end of the month. The next "
    "meeting will take place in the library, where the new projector has been installed.",
    "Our train left the station just after dawn and followed the river for most of the "
    "morning. By noon we had reached the mountains, where the air was cold and the villages "
    "were small and quiet. We stopped for lunch in a town with a famous bakery, and everyone "
    "agreed that the bread was the best they had ever tasted.",
]
TYPOS = [("committee", "comittee"), ("discussion", "discusion"), ("department", "departmnet"),
         ("station", "staton"), ("mountains", "mountians"), ("everyone", "everyon")]  # fmt: skip


def grounded_prompts(tokenizer) -> list[list[int]]:
    asks = []
    for code in FUNCTIONS:
        # ("Reply with only the new code": asked to "write out the whole function", SmolLM2
        # explains the code instead, an answer that does not repeat the prompt.)
        old, new = next((o, n) for o, n in RENAMES if o in code)
        asks.append(f"Rename the variable `{old}` to `{new}` in this code. Reply with only "
                    f"the new code.\n\n```python\n{code}\n```")  # fmt: skip
    for passage in PASSAGES:
        for right, wrong in TYPOS:
            passage = passage.replace(right, wrong)
        asks.append(f"Correct the spelling mistakes in this text and write it out again:\n\n"
                    f"{passage}")  # fmt: skip
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": a}], add_generation_prompt=True, tokenize=False
        )
        for a in asks
    ]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def requests_for(args, workload: str, concurrency: int, grounded: list[list[int]], vocab: int):
    """(prompt token ids, max_tokens, ignore_eos) per request of one cell."""
    count = max(8, 2 * concurrency)
    if workload == "grounded":
        return [(grounded[i % len(grounded)], args.max_tokens, False) for i in range(count)]
    w1 = make_workload("W1-cpu", vocab)
    return [(w1.prompts[i], w1.output_lens[i], True) for i in range(min(count, len(w1.prompts)))]


async def run_cell(engine, requests, concurrency: int, tag: str) -> dict:
    from tokenmill import SamplingParams

    limit = asyncio.Semaphore(concurrency)
    tpots: list[float] = []
    tokens = 0

    async def one(i: int, prompt: list[int], max_tokens: int, ignore_eos: bool) -> None:
        nonlocal tokens
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        async with limit:
            first = last = None
            count = 0
            async for out in engine.generate({"prompt_token_ids": prompt}, params, f"{tag}-{i}"):
                now = time.perf_counter()
                count = len(out.outputs[0].token_ids)
                if first is None and count:
                    first = now
                last = now
            tokens += count
            if first is not None and count > 1:
                tpots.append((last - first) / (count - 1))

    await engine.reset_prefix_cache()
    before = await engine.get_stats()
    start = time.perf_counter()
    await asyncio.gather(*(one(i, *r) for i, r in enumerate(requests)))
    wall = time.perf_counter() - start
    after = await engine.get_stats()
    proposed = after.get("spec_decode_num_draft_tokens", 0) - before.get(
        "spec_decode_num_draft_tokens", 0
    )
    accepted = after.get("spec_decode_num_accepted_tokens", 0) - before.get(
        "spec_decode_num_accepted_tokens", 0
    )
    return {
        "tok_s": tokens / wall,
        "tpot_ms": 1000 * sum(tpots) / max(len(tpots), 1),
        "acceptance": accepted / proposed if proposed else None,
        "tokens": tokens,
    }


def speculative_config(args, method: str):
    if method == "off":
        return None
    auto = args.auto_disable == "on"
    if method == "ngram":
        return {
            "method": "ngram",
            "num_speculative_tokens": args.k,
            "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max,
            "auto_disable": auto,
        }
    return {"method": "draft_model", "model": args.draft,
            "num_speculative_tokens": args.draft_k, "auto_disable": auto}  # fmt: skip


async def main_async(args) -> None:
    from transformers import AutoTokenizer

    from tokenmill import AsyncLLM, SamplingParams
    from tokenmill.protocol.default_model import resolve_model

    path = resolve_model(args.model)
    if args.load_format == "dummy":  # a config folder: no tokenizer, W1-cpu only
        from transformers import AutoConfig

        args.workloads = [w for w in args.workloads if w != "grounded"]
        vocab = AutoConfig.from_pretrained(path).vocab_size
        grounded = [make_workload("W1-cpu", vocab).prompts[0]]
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
        grounded = grounded_prompts(tokenizer)
        vocab = len(tokenizer)
    engines = {}
    for method in args.methods:
        engine = AsyncLLM(
            path,
            skip_tokenizer_init=True,
            max_model_len=args.max_model_len,
            max_num_seqs=max(args.concurrency),
            speculative_config=speculative_config(args, method),
            load_format=args.load_format,
            dtype=args.dtype,
        )
        warm = SamplingParams(temperature=0, max_tokens=8)
        async for _ in engine.generate({"prompt_token_ids": grounded[0]}, warm, f"warm-{method}"):
            pass
        engines[method] = engine
    results: dict[tuple, list[dict]] = {}
    try:
        for workload in args.workloads:
            for c in args.concurrency:
                requests = requests_for(args, workload, c, grounded, vocab)
                for r in range(args.rounds):
                    for method, engine in engines.items():
                        cell = await run_cell(engine, requests, c, f"{workload}-{c}-{r}-{method}")
                        results.setdefault((workload, c, method), []).append(cell)
                        line = f"{cell['tok_s']:.1f} tok/s, TPOT {cell['tpot_ms']:.1f} ms"
                        print(f"  {workload} c={c} round {r + 1} {method}: {line}", flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    print_table(args, results)


def print_table(args, results) -> None:
    print()
    print(f"n-gram: k = {args.k}, lookup {args.lookup_min}-{args.lookup_max}; draft: "
          f"{args.draft}, k = {args.draft_k}; governor {args.auto_disable}; dtype {args.dtype}; "
          f"best of {args.rounds} round(s) by tok/s")  # fmt: skip
    header = "| workload | concurrency | method | output tok/s | vs off | TPOT ms | acceptance |"
    print(header)
    print("|" + "---|" * 7)
    for workload in args.workloads:
        for c in args.concurrency:
            base = max(results[(workload, c, "off")], key=lambda x: x["tok_s"]) if (
                workload, c, "off") in results else None  # fmt: skip
            for method in args.methods:
                best = max(results[(workload, c, method)], key=lambda x: x["tok_s"])
                ratio = f"{best['tok_s'] / base['tok_s']:.2f}x" if base else "-"
                acc = "-" if best["acceptance"] is None else f"{best['acceptance']:.1%}"
                print(f"| {workload} | {c} | {method} | {best['tok_s']:.1f} | {ratio} | "
                      f"{best['tpot_ms']:.1f} | {acc} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct",
                        help="default: SmolLM2-135M-Instruct's HF folder")
    parser.add_argument("--draft", default="SmolLM2-135M-Instruct-draft")
    parser.add_argument("--methods", nargs="+", default=["off", "ngram", "draft"],
                        choices=["off", "ngram", "draft"])  # fmt: skip
    parser.add_argument("--workloads", nargs="+", default=["grounded", "W1-cpu"],
                        choices=["grounded", "W1-cpu"])  # fmt: skip
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=1)
    # k = 5 for n-gram proposals: on the grounded workload at concurrency 1, 2.29x against
    # 1.95x at k = 3 (a proposal costs nothing to make, and a longer one to verify little
    # more); a draft model's proposal costs a draft step per token.
    parser.add_argument("--k", type=int, default=5, help="n-gram num_speculative_tokens")
    parser.add_argument("--draft-k", type=int, default=3, help="draft num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=160, help="grounded answers")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                        help="dummy: random weights (a config folder; W1-cpu only)")  # fmt: skip
    parser.add_argument("--dtype", default="auto",
                        help="the engines' dtype (auto: bf16 where the CPU has bf16)")  # fmt: skip
    parser.add_argument("--auto-disable", choices=["on", "off"], default="on",
                        help="speculative_config.auto_disable: the governor")  # fmt: skip
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
