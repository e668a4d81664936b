"""Tensor-parallel generation under torchrun: every rank runs this script.

    torchrun --nproc-per-node 3 scripts/torchrun_generate.py
    torchrun --nproc-per-node 2 scripts/torchrun_generate.py --model PATH --skip-tokenizer-init

Each rank builds its own `LLM(..., tensor_parallel_size=WORLD_SIZE,
distributed_executor_backend="external_launcher")`: its engine core runs in this process with
one worker that is this rank of torchrun's group. The ranks get the same prompts in the same
order, schedule identically, sample the same tokens, and each prints the same outputs, one JSON
line per rank ({"rank", "prompts", "outputs", "texts"}), also written to
OUTPUT_DIR/rank-R.json with --output-dir (the ranks' lines share one stdout). With
--skip-tokenizer-init the prompts are token ids drawn from a fixed seed (for models without a
tokenizer).
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

from tokenmill import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three planets of the solar system.",
    "Explain in one sentence why the sky is blue.",
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None,
                        help="default: SmolLM2-135M-Instruct's Q4_1 file, natively")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--skip-tokenizer-init", action="store_true")
    parser.add_argument("--num-prompts", type=int, default=8, help="token prompts only")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    parser.add_argument("--output-dir", type=Path, default=None)
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    llm = LLM(
        args.model,
        tensor_parallel_size=world_size,
        distributed_executor_backend="external_launcher",
        max_model_len=args.max_model_len,
        skip_tokenizer_init=args.skip_tokenizer_init,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        async_scheduling=args.async_scheduling,
        dtype=args.dtype,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    if args.skip_tokenizer_init:
        rng = random.Random(0)
        vocab = llm.llm_engine.config.model_config.vocab_size
        prompts = [
            [rng.randrange(3, vocab) for _ in range(rng.randint(1, 60))]
            for _ in range(args.num_prompts)
        ]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    else:
        conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
        outputs = llm.chat(conversations, params, use_tqdm=False)
        prompts = [o.prompt_token_ids for o in outputs]
    record = {
        "rank": rank,
        "prompts": prompts,
        "outputs": [o.outputs[0].token_ids for o in outputs],
        "texts": [o.outputs[0].text for o in outputs],
    }
    line = json.dumps(record)
    print(line, flush=True)
    if args.output_dir is not None:
        (args.output_dir / f"rank-{rank}.json").write_text(line)
    llm.shutdown()


if __name__ == "__main__":
    main()
