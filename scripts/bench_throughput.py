"""Offline throughput benchmark: tokenmill (and optionally HF transformers) on one workload.

Workloads (random prompt token ids, every request ignores EOS and stops at its own length):
  W1-cpu  64 requests, prompts uniform in [16, 256], outputs uniform in [16, 128], seed 0
  W1      256 requests, prompts and outputs uniform in [100, 1024], seed 0
With `--compare hf`, HF `generate()` runs the same workload in the same process as one
left-padded batch with min_new_tokens = max_new_tokens = the longest output, and only each
request's own output tokens are counted.

Each engine is started (or loaded) once and warmed up with a short request. Before every
timed tokenmill run its prefix cache is reset, and the run fails if any prompt token came
from it. `--rounds N` times every engine N times, alternating (tokenmill, HF, tokenmill, HF,
...), and reports each engine's best time next to every round's time: on a shared machine
whose speed drifts by 10-20% from minute to minute, alternating rounds compare the engines
under the same conditions, and rounds after the first measure both warm (HF's allocator has
its memory, tokenmill's KV blocks have been touched). An in-process engine (`--mode inproc`)
tunes this process's malloc (see `keep_freed_memory` in worker/worker.py), which then also
spares HF page faults; the default `mp` mode leaves this process as it is.

    python scripts/bench_throughput.py --compare hf
    python scripts/bench_throughput.py --compare hf --rounds 2
    python scripts/bench_throughput.py --workload W1 --load-format dummy
    python scripts/bench_throughput.py --model scripts/configs/qwen2.5-0.5b --load-format dummy \
        --tensor-parallel-size 1 2 --rounds 2

`--hf-requests N` gives HF only the first N requests (its rate is then measured on them: HF
alone needs minutes for all of W1 on a GPU). `--step-times` times every tokenmill step's
stages (TOKENMILL_STEP_TIMING=1: the device is synchronized around each forward) and prints
where the last round's time went, per step.

`--async-scheduling off on` runs one engine per setting (alternating, like the rounds; the
default is the engine's own choice for the device). On the CPU compare them in `mp` mode: an
in-process engine with async scheduling runs its forward on a worker thread, and once two
threads of a process have run torch ops libgomp's threads sleep between parallel regions
(more threads than cores), which slows every engine of the process from then on.

`--tensor-parallel-size 1 2` runs one engine per size (alternating, like the rounds); at TP > 1
the ranks are worker processes that split this machine's cores and its KV cache budget.
Dummy weights are drawn per rank, so their tokens differ between sizes (the counts do not:
every request ignores EOS).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from dataclasses import dataclass

WORKLOADS = {
    "W1-cpu": dict(num_requests=64, prompt=(16, 256), output=(16, 128)),
    "W1": dict(num_requests=256, prompt=(100, 1024), output=(100, 1024)),
}


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


def make_workload(name: str, vocab_size: int, seed: int = 0) -> Workload:
    spec = WORKLOADS[name]
    rng = random.Random(seed)
    prompts, output_lens = [], []
    for _ in range(spec["num_requests"]):
        prompt_len = rng.randint(*spec["prompt"])
        prompts.append([rng.randrange(vocab_size) for _ in range(prompt_len)])
        output_lens.append(rng.randint(*spec["output"]))
    return Workload(prompts, output_lens)


def start_tokenmill(
    args: argparse.Namespace, workload: Workload, multiprocess: bool, tp: int, overlap: str
):
    from tokenmill import LLM, SamplingParams

    llm = LLM(
        args.model,
        multiprocess=multiprocess,
        tensor_parallel_size=tp,
        async_scheduling={"on": True, "off": False}.get(overlap),
        load_format=args.load_format,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=args.dtype,
        device=args.device,
        skip_tokenizer_init=True,  # token-id prompts; nothing to detokenize
    )
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": workload.prompts[0][:32]}], warm, use_tqdm=False)
    return llm


STAGES = ("schedule", "prepare", "forward", "logits", "sample", "update", "output", "executor",
          "wait")  # fmt: skip


def run_tokenmill(llm, workload: Workload) -> float:
    from tokenmill import SamplingParams

    # Nothing may come from the prefix cache: not the warm-up prompt, not an earlier round.
    llm.reset_prefix_cache()
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    expected = sum(workload.output_lens)
    if generated != expected:
        raise RuntimeError(f"tokenmill generated {generated} tokens, expected {expected}")
    cached = sum(o.num_cached_tokens for o in outputs)
    if cached:
        raise RuntimeError(f"{cached} prompt tokens came from the prefix cache")
    return elapsed


def load_hf(args: argparse.Namespace, model_path: str, device: str, dtype: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    if args.load_format == "dummy":
        config = AutoConfig.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
    return model.to(device).eval()


def run_hf(model, workload: Workload, device: str) -> tuple[float, int]:
    import torch

    longest = max(len(p) for p in workload.prompts)
    pad = model.config.pad_token_id or 0
    input_ids = torch.full((len(workload.prompts), longest), pad, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, p in enumerate(workload.prompts):  # left padding
        input_ids[i, longest - len(p) :] = torch.tensor(p)
        attention_mask[i, longest - len(p) :] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    max_new = max(workload.output_lens)
    common = dict(do_sample=False, pad_token_id=pad)
    with torch.inference_mode():
        model.generate(input_ids[:1, -32:], max_new_tokens=4, min_new_tokens=4, **common)
        _sync(device)
        start = time.perf_counter()
        model.generate(
            input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            **common,
        )
        _sync(device)
        elapsed = time.perf_counter() - start
    return elapsed, sum(workload.output_lens)


def step_split(before: dict, after: dict) -> tuple[dict[str, float], int]:
    """Seconds per stage and the number of steps between two get_stats() snapshots."""
    old, new = before.get("step_time_s", {}), after.get("step_time_s", {})
    seconds = {stage: new.get(stage, 0.0) - old.get(stage, 0.0) for stage in new}
    return seconds, after.get("num_timed_steps", 0) - before.get("num_timed_steps", 0)


def print_step_split(name: str, seconds: dict[str, float], steps: int, wall: float) -> None:
    if not steps:
        return
    print(f"\n{name}, last round: {steps} steps, {1e3 * wall / steps:.2f} ms per step (wall)")
    print(
        "| {:<10} | {:>9} | {:>11} | {:>7} |".format("stage", "total (s)", "ms per step", "share")
    )
    print(f"|{'-' * 12}|{'-' * 11}|{'-' * 13}|{'-' * 9}|")
    for stage in STAGES:
        if stage in seconds:
            s = seconds[stage]
            print(f"| {stage:<10} | {s:>9.2f} | {1e3 * s / steps:>11.3f} | {s / wall:>6.1%} |")
    rest = wall - sum(seconds.values())
    print(
        f"| {'elsewhere':<10} | {rest:>9.2f} | {1e3 * rest / steps:>11.3f} | {rest / wall:>6.1%} |"
    )


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="local HF folder (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="W1-cpu")
    parser.add_argument("--compare", choices=["hf"], default=None)
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument(
        "--mode",
        choices=["mp", "inproc", "both"],
        default="mp",
        help="engine core in a spawned process (mp, the default), in this one, or both",
    )
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        nargs="+",
        default=[1],
        metavar="N",
        help="one tokenmill engine per size given (worker processes at N > 1)",
    )
    parser.add_argument(
        "--async-scheduling",
        nargs="+",
        choices=["default", "off", "on"],
        default=["default"],
        help="one tokenmill engine per setting given",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="alternating runs per engine; the best is reported"
    )
    parser.add_argument(
        "--hf-requests", type=int, default=None, metavar="N", help="HF runs the first N only"
    )
    parser.add_argument(
        "--step-times", action="store_true", help="print the per-step time split of tokenmill"
    )
    args = parser.parse_args()
    if args.step_times:
        os.environ["TOKENMILL_STEP_TIMING"] = "1"  # read by the engine core and workers
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")

    import torch
    import transformers

    from tokenmill.protocol.config import EngineArgs, resolve_device
    from tokenmill.protocol.default_model import resolve_model

    model_path = resolve_model(args.model)
    vocab = json.load(open(os.path.join(model_path, "config.json")))["vocab_size"]
    workload = make_workload(args.workload, vocab)
    device = resolve_device(args.device)
    # The dtype tokenmill resolves for this device ("auto": fp32 on CPU, bf16 on CUDA) is the
    # one HF runs in too.
    engine = EngineArgs(model=model_path, dtype=args.dtype, device=device)
    dtype = engine.create_engine_config().model_config.dtype
    print(
        f"workload {args.workload}: {len(workload.prompts)} requests, "
        f"{sum(map(len, workload.prompts))} prompt tokens, "
        f"{sum(workload.output_lens)} output tokens"
    )
    print(f"model {model_path} (load_format={args.load_format}, dtype={dtype})")
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"device {device}: {torch.cuda.get_device_name() if device == 'cuda' else cpu_name()}, "
        f"{torch.get_num_threads()} threads"
    )

    modes = ["inproc", "mp"] if args.mode == "both" else [args.mode]
    sizes = args.tensor_parallel_size
    overlaps = args.async_scheduling
    engines_spec = [(mode, tp, a) for mode in modes for tp in sizes for a in overlaps]
    names = [
        "tokenmill ("
        + ", ".join(
            [mode]
            + ([f"tp={tp}"] if len(sizes) > 1 or tp > 1 else [])
            + ([f"async {a}"] if len(overlaps) > 1 else [])
        )
        + ")"
        for mode, tp, a in engines_spec
    ]
    hf_model = None
    hf_workload = workload
    if args.hf_requests is not None:
        n = args.hf_requests
        hf_workload = Workload(workload.prompts[:n], workload.output_lens[:n])
    if args.compare == "hf":
        names.append("hf transformers")
        hf_model = load_hf(args, model_path, device, dtype)
    times: dict[str, list[float]] = {name: [] for name in names}
    tokens = {name: sum(workload.output_lens) for name in names}
    tokens["hf transformers"] = sum(hf_workload.output_lens)
    engines = [start_tokenmill(args, workload, mode == "mp", tp, a) for mode, tp, a in engines_spec]
    splits: dict[str, tuple[dict[str, float], int]] = {}
    for _ in range(args.rounds):
        for llm, name in zip(engines, names):
            before = llm.get_stats()
            times[name].append(run_tokenmill(llm, workload))
            if args.step_times:
                splits[name] = step_split(before, llm.get_stats())
        if hf_model is not None:
            times["hf transformers"].append(run_hf(hf_model, hf_workload, device)[0])
    for llm in engines:
        llm.shutdown()

    best = {name: min(ts) for name, ts in times.items()}
    base = tokens["hf transformers"] / best["hf transformers"] if args.compare else None
    print()
    if args.rounds > 1:
        print(f"best of {args.rounds} alternating rounds per engine")
    header = ("engine", "time (s)", "output tokens", "output tok/s", "vs HF")
    print("| {:<26} | {:>9} | {:>13} | {:>12} | {:>6} |".format(*header))
    print(f"|{'-' * 28}|{'-' * 11}|{'-' * 15}|{'-' * 14}|{'-' * 8}|")
    for name in names:
        rate = tokens[name] / best[name]
        ratio = f"{rate / base:.2f}x" if base else "-"
        print(
            f"| {name:<26} | {best[name]:>9.2f} | {tokens[name]:>13} | {rate:>12.1f} | {ratio:>6} |"
        )
    if args.hf_requests is not None and args.compare:
        print(f"(HF ran the first {len(hf_workload.prompts)} requests only)")
    for name, (seconds, steps) in splits.items():
        print_step_split(name, seconds, steps, times[name][-1])
    if args.rounds > 1:
        for name in names:
            print(f"{name} rounds (s): " + ", ".join(f"{t:.2f}" for t in times[name]))
    if args.mode == "both" and len(sizes) == 1 and len(overlaps) == 1:
        inproc, mp = best[names[0]], best[names[1]]
        print(f"multiprocess / in-process throughput: {inproc / mp:.3f}")


if __name__ == "__main__":
    main()
