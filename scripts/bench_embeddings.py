"""Embedding throughput: `tokenmill serve --runner pooling` over HTTP against HF's AutoModel
(padded batches, in this process) on the same texts, in alternating rounds.

The texts are `--num-texts` random English words, `--min-len` to `--max-len` tokens each
(uniformly drawn, exact with the model's tokenizer). tokenmill gets them as /v1/embeddings
requests of `--per-request` texts, `--concurrency` requests in flight (as a RAG indexer sends
them). HF embeds them in batches of `--hf-batch-size`, right-padded, in the texts' order
("given") and sorted by length first ("sorted", as sentence-transformers' encode does, which
keeps padding small; `--hf-order` picks one): the last real token's hidden state,
normalized (what the server computes: a decoder converted to an embedder, vLLM's default
pooling). Each round draws new texts (so that no round is served from the prefix cache of
another) and times every engine on them; the table shows every round, their mean and best,
and the ratios of the means. The vectors of the first round are compared (the lowest cosine
per text is printed).

    python scripts/bench_embeddings.py --rounds 3
    python scripts/bench_embeddings.py --model-path PATH --tokenmill-args "--dtype float32"
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import shlex
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import (  # noqa: E402
    httpx,
    port_in_use,
    stop_process_group,
    wait_ready,
    word_prompts,
)
from bench_throughput import cpu_name  # noqa: E402


def make_texts(tokenizer, num: int, low: int, high: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lengths = [rng.randint(low, high) for _ in range(num)]
    return [word_prompts(1, n, seed + i, tokenizer)[0] for i, n in enumerate(lengths)]


# ----------------------------------------------------------------------------------- tokenmill
async def embed_over_http(base_url: str, texts: list[str], per_request: int, concurrency: int):
    """All texts' vectors, in order, sent as requests of `per_request` texts."""
    semaphore = asyncio.Semaphore(concurrency)
    groups = [texts[i : i + per_request] for i in range(0, len(texts), per_request)]
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:

        async def one(group: list[str]) -> list[list[float]]:
            async with semaphore:
                body = {"input": group, "encoding_format": "float"}
                response = await client.post(f"{base_url}/embeddings", json=body)
                response.raise_for_status()
                return [d["embedding"] for d in response.json()["data"]]

        results = await asyncio.gather(*(one(g) for g in groups))
    return np.asarray([v for group in results for v in group], dtype=np.float32)


# ------------------------------------------------------------------------------------------ HF
class HFEmbedder:
    def __init__(self, path: str, dtype: torch.dtype, batch_size: int) -> None:
        from transformers import AutoModel, AutoTokenizer

        self.model = AutoModel.from_pretrained(path, dtype=dtype).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.tokenizer.padding_side = "right"
        self.batch_size = batch_size

    @torch.inference_mode()
    def embed(self, texts: list[str], sort: bool) -> np.ndarray:
        """The texts' vectors, in their order (batched by length when `sort`)."""
        order = list(range(len(texts)))
        if sort:
            order.sort(key=lambda i: len(texts[i]))
        vectors = torch.empty(0)
        for start in range(0, len(texts), self.batch_size):
            rows = order[start : start + self.batch_size]
            batch = self.tokenizer([texts[i] for i in rows], padding=True, return_tensors="pt")
            hidden = self.model(**batch).last_hidden_state
            last = batch["attention_mask"].sum(dim=1) - 1
            pooled = hidden[torch.arange(hidden.shape[0]), last].float()
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
            if not vectors.numel():
                vectors = torch.empty(len(texts), pooled.shape[1])
            vectors[rows] = pooled
        return vectors.numpy()


# ---------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", default=None, help="default: the prepared SmolLM2")
    parser.add_argument("--num-texts", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-request", type=int, default=8, help="texts per HTTP request")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--hf-order", default="both", choices=["sorted", "given", "both"])
    parser.add_argument("--tokenmill-args", default="", help="extra `tokenmill serve` flags")
    parser.add_argument("--port", type=int, default=8124)
    args = parser.parse_args()

    if args.model_path is None:
        from tokenmill.protocol.default_model import DEFAULT_MODEL, resolve_model

        args.model_path = resolve_model(DEFAULT_MODEL)
    hf = HFEmbedder(args.model_path, getattr(torch, args.hf_dtype), args.hf_batch_size)
    rounds = [
        make_texts(hf.tokenizer, args.num_texts, args.min_len, args.max_len, args.seed + 7919 * k)
        for k in range(args.rounds)
    ]
    tokens = [sum(len(hf.tokenizer.encode(t)) for t in texts) for texts in rounds]
    orders = ["given", "sorted"] if args.hf_order == "both" else [args.hf_order]
    warmup = make_texts(hf.tokenizer, 8, args.min_len, args.max_len, args.seed + 10_000)

    host = "127.0.0.1"
    if port_in_use(host, args.port):
        raise SystemExit(f"port {args.port} is in use: pass another --port")
    base_url = f"http://{host}:{args.port}/v1"
    argv = [sys.executable, "-m", "tokenmill.frontend.server", args.model_path, "--runner",
            "pooling", "--host", host, "--port", str(args.port), "--disable-access-log",
            *shlex.split(args.tokenmill_args)]  # fmt: skip
    log = tempfile.NamedTemporaryFile("w", prefix="bench_embeddings_", suffix=".log", delete=False)
    print(f"starting: {shlex.join(argv)} (log: {log.name})")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    times: dict[str, list[float]] = {"tokenmill": [], **{f"hf-{o}": [] for o in orders}}
    try:
        wait_ready(proc, base_url, 600, log.name)
        run = lambda batch: asyncio.run(  # noqa: E731
            embed_over_http(base_url, batch, args.per_request, args.concurrency)
        )
        run(warmup)
        hf.embed(warmup, True)
        ours = theirs = None
        for k, texts in enumerate(rounds):
            start = time.perf_counter()
            vectors = run(texts)
            times["tokenmill"].append(time.perf_counter() - start)
            ours = vectors if ours is None else ours
            for order in orders:
                start = time.perf_counter()
                vectors = hf.embed(texts, order == "sorted")
                times[f"hf-{order}"].append(time.perf_counter() - start)
                theirs = vectors if theirs is None else theirs
            shown = ", ".join(f"{name} {t[-1]:.2f} s" for name, t in times.items())
            print(f"round {k + 1}: {shown}")
    finally:
        stop_process_group(proc)
        log.close()

    cosines = np.sum(ours * theirs, axis=1) / (
        np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1)
    )
    print(f"\n{cpu_name()} ({platform.machine()}, {os.cpu_count()} CPUs); "
          f"{args.num_texts} texts of {args.min_len}-{args.max_len} tokens a round "
          f"({', '.join(map(str, tokens))} tokens); "
          f"tokenmill serve {args.tokenmill_args or '(defaults)'}, {args.per_request} texts a "
          f"request, {args.concurrency} in flight; HF AutoModel {args.hf_dtype}, batches of "
          f"{args.hf_batch_size} (given: the texts' order; sorted: by length)")  # fmt: skip
    print("| engine | rounds (texts/s) | mean texts/s | best | mean tokens/s |")
    print("|---|---|---|---|---|")
    means = {}
    labels = {"tokenmill": "tokenmill (HTTP)",
              **{f"hf-{o}": f"HF {args.hf_dtype}, {o} order" for o in orders}}  # fmt: skip
    for name, label in labels.items():
        rates = [args.num_texts / t for t in times[name]]
        token_rate = float(np.mean([n / t for n, t in zip(tokens, times[name])]))
        means[name] = float(np.mean(rates))
        shown = ", ".join(f"{r:.1f}" for r in rates)
        print(f"| {label} | {shown} | {means[name]:.1f} | {max(rates):.1f} | "
              f"{token_rate:.0f} |")  # fmt: skip
    ratios = ", ".join(f"{means['tokenmill'] / means[f'hf-{o}']:.2f}x over HF {o}" for o in orders)
    print(f"\ntokenmill: {ratios}; lowest cosine between their vectors: {cosines.min():.5f}")


if __name__ == "__main__":
    main()
