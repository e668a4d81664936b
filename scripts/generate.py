"""The main job: answer a few chat prompts with the default model and report throughput.

python scripts/generate.py [--model PATH] [--max-tokens N] [--temperature T]
"""

from __future__ import annotations

import argparse
import time

from tokenmill import LLM, SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for writing readable Python code.",
    "What is 17 times 23?",
    "Name three planets of the solar system.",
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None,
        help="a local folder or GGUF file (default: SmolLM2-135M-Instruct's Q4_1 file, natively)"
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()

    llm = LLM(args.model, max_model_len=2048)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    for prompt, output in zip(PROMPTS, outputs):
        print(f"### {prompt}\n{output.outputs[0].text.strip()}\n")
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    print(
        f"{len(outputs)} requests, {prompt_tokens} prompt tokens, {generated} generated tokens "
        f"in {elapsed:.2f} s: {generated / elapsed:.1f} output tokens/s"
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
