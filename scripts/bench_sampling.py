"""What logprobs and structured outputs cost: W1-cpu (see bench_throughput.py) three ways in
one engine, alternating per round:

  plain        greedy, every request ignores EOS and stops at its own length
  logprobs=5   the same with logprobs=5 on every request
  json 1/4     the same with a JSON schema (nested object, array, enum) on every fourth
               request, whose max_tokens is raised to 256 so that it can finish the object;
               those stop when their JSON is complete, so the tokens actually produced are
               counted

Each mode's output tokens/s is reported as a ratio of plain's in the same run (best round of
each). Goals: >= 0.9 for logprobs, >= 0.8 for structured outputs.

    python scripts/bench_sampling.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import time

from bench_throughput import make_workload

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "owner": {
            "type": "object",
            "properties": {
                "email": {"type": "string", "maxLength": 32},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
            },
            "required": ["email", "age"],
        },
    },
    "required": ["id", "name", "kind", "tags", "owner"],
}  # fmt: skip


JSON_MAX_TOKENS = 256


def mode_params(mode: str, output_lens: list[int]) -> list:
    from tokenmill import SamplingParams, StructuredOutputsParams

    params = []
    for i, n in enumerate(output_lens):
        extra: dict = {}
        if mode == "logprobs=5":
            extra["logprobs"] = 5
        elif mode == "json 1/4" and i % 4 == 0:
            extra["structured_outputs"] = StructuredOutputsParams(
                json=SCHEMA, disable_any_whitespace=True
            )
            n = JSON_MAX_TOKENS  # room to finish the object; it stops when complete
        params.append(SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **extra))
    return params


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="SmolLM2-135M-Instruct",
                        help="local HF folder (default: SmolLM2's)")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()

    from tokenmill import LLM
    from tokenmill.protocol.default_model import resolve_model

    model = resolve_model(args.model)
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    workload = make_workload("W1-cpu", vocab)
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    modes = ["plain", "logprobs=5", "json 1/4"]
    params = {mode: mode_params(mode, workload.output_lens) for mode in modes}
    llm = LLM(model, max_model_len=2048)
    best: dict[str, tuple[float, int]] = {}
    completed = ""
    rounds: dict[str, list[float]] = {mode: [] for mode in modes}
    try:
        llm.generate(prompts[:2], params["json 1/4"][:2], use_tqdm=False)  # warm up, compile
        for _ in range(args.rounds):
            for mode in modes:
                llm.reset_prefix_cache()
                start = time.perf_counter()
                outputs = llm.generate(prompts, params[mode], use_tqdm=False)
                elapsed = time.perf_counter() - start
                tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                if mode == "json 1/4":
                    # Those that completed parse; the others reached their max_tokens.
                    done = [o for o in outputs[::4] if o.outputs[0].finish_reason == "stop"]
                    for o in done:
                        json.loads(o.outputs[0].text)
                    completed = f"{len(done)} of {len(outputs[::4])}"
                rounds[mode].append(tokens / elapsed)
                if mode not in best or tokens / elapsed > best[mode][1] / best[mode][0]:
                    best[mode] = (elapsed, tokens)
    finally:
        llm.shutdown()
    plain_rate = best["plain"][1] / best["plain"][0]
    print(f"W1-cpu on {model}, best of {args.rounds} alternating rounds")
    print("| {:<12} | {:>8} | {:>13} | {:>12} | {:>8} |".format(
        "mode", "time (s)", "output tokens", "output tok/s", "vs plain"))  # fmt: skip
    print(f"|{'-' * 14}|{'-' * 10}|{'-' * 15}|{'-' * 14}|{'-' * 10}|")
    for mode in modes:
        elapsed, tokens = best[mode]
        rate = tokens / elapsed
        print(
            f"| {mode:<12} | {elapsed:>8.2f} | {tokens:>13} | {rate:>12.1f} "
            f"| {rate / plain_rate:>7.2f}x |"
        )
    for mode in modes:
        print(f"{mode} rounds (tok/s): " + ", ".join(f"{r:.1f}" for r in rounds[mode]))
    print(f"JSON requests that completed their object (the rest hit max_tokens): {completed}")


if __name__ == "__main__":
    main()
