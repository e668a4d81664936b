"""The `engine-core` daemon: several clients at once, each getting its own outputs; every
client failing promptly when the daemon is killed; authentication on tcp; and a fuzzed input
socket that leaves the daemon serving correct results. Daemons are always killed at the end."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import msgspec
import psutil
import pytest
import zmq
from helpers import PROMPTLY_S, free_port_pair, raw_core_client, running_daemon

from tokenmill import LLM, EngineDeadError, SamplingParams
from tokenmill.protocol.codec import Encoder
from tokenmill.protocol.messages import (
    PROTOCOL_VERSION,
    EngineCoreRequest,
    FinishReason,
    Hello,
    RequestType,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PROMPTS = [{"prompt_token_ids": list(range(7, 7 + n))} for n in (2, 11, 35, 90)]


def reference(model_path) -> list[list[int]]:
    llm = LLM(str(model_path), multiprocess=False, skip_tokenizer_init=True, dtype="float32",
              kv_cache_memory_bytes=32 << 20)  # fmt: skip
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()


def test_two_clients_get_their_own_outputs(tiny_model) -> None:
    path = tiny_model("llama-gqa")
    expected = reference(path)
    with running_daemon(path) as (_, address):
        clients = [LLM(engine_address=address) for _ in range(2)]
        try:
            results: dict[int, list[list[int]]] = {}

            def run(i: int) -> None:
                prompts = PROMPTS if i == 0 else PROMPTS[::-1]
                outs = clients[i].generate(prompts, GREEDY, use_tqdm=False)
                results[i] = [o.outputs[0].token_ids for o in outs]

            threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert results[0] == expected and results[1] == expected[::-1]
        finally:
            for client in clients:
                client.shutdown()


def test_two_clients_number_their_lora_adapters_alike(tiny_model, tmp_path) -> None:
    """Each frontend of one daemon calls its own adapter 1 (as each server numbers them):
    both are served, each client lists and removes only its own, and each gets what an
    in-process engine gives with that adapter."""
    import json
    from pathlib import Path

    from tokenmill import LoRARequest

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from bench_throughput import write_adapter

    path = tiny_model("llama-gqa")
    config = json.loads((path / "config.json").read_text())
    adapters = [LoRARequest(f"a{i}", 1, write_adapter(tmp_path / f"a{i}", config, 8, seed=i,
                                                      b_scale=0.5)) for i in range(2)]  # fmt: skip
    lora_args = dict(enable_lora=True, max_lora_rank=8, max_loras=2)
    local = LLM(str(path), multiprocess=False, skip_tokenizer_init=True, dtype="float32",
                kv_cache_memory_bytes=32 << 20, **lora_args)  # fmt: skip
    try:
        expected = [[o.outputs[0].token_ids for o in local.generate(
            PROMPTS, GREEDY, use_tqdm=False, lora_request=LoRARequest(a.lora_name, i + 1,
                                                                      a.lora_path))]
            for i, a in enumerate(adapters)]  # fmt: skip
    finally:
        local.shutdown()
    assert expected[0] != expected[1]
    flags = ["--enable-lora", "true", "--max-lora-rank", "8", "--max-loras", "2"]
    with running_daemon(path, *flags) as (_, address):
        clients = [LLM(engine_address=address) for _ in range(2)]
        try:
            for client, adapter in zip(clients, adapters):
                assert client.add_lora(adapter) is True
                assert client.list_loras() == {1}
            for i in (1, 0):
                outs = clients[i].generate(PROMPTS, GREEDY, use_tqdm=False,
                                           lora_request=adapters[i])  # fmt: skip
                assert [o.outputs[0].token_ids for o in outs] == expected[i]
            assert clients[0].remove_lora(1) is True and clients[0].list_loras() == set()
            assert clients[1].list_loras() == {1}
            outs = clients[1].generate(PROMPTS[:1], GREEDY, use_tqdm=False,
                                       lora_request=adapters[1])  # fmt: skip
            assert outs[0].outputs[0].token_ids == expected[1][0]
        finally:
            for client in clients:
                client.shutdown()


def test_killed_daemon_fails_every_client(tiny_model) -> None:
    with running_daemon(tiny_model("llama-gqa")) as (proc, address):
        clients = [LLM(engine_address=address) for _ in range(2)]
        errors: list[BaseException] = []
        long_run = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)

        def run(client: LLM) -> None:
            try:
                client.generate([{"prompt_token_ids": [9] * 30}] * 16, long_run, use_tqdm=False)
            except BaseException as e:  # collected for the assertion below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        # Killed once both clients' requests are out (900 steps each are still to come),
        # whatever the machine's speed: a fixed wait let a fast run finish first.
        deadline = time.monotonic() + PROMPTLY_S
        while not all(c.llm_engine.has_unfinished_requests() for c in clients):
            assert time.monotonic() < deadline, "the clients' requests never went out"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(PROMPTLY_S)
        assert time.monotonic() - killed < PROMPTLY_S
        assert len(errors) == 2 and all(isinstance(e, EngineDeadError) for e in errors)
        with pytest.raises(EngineDeadError):
            clients[0].generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        for client in clients:
            client.shutdown()


def test_tcp_clients_must_present_the_token(tiny_model) -> None:
    with running_daemon(tiny_model("llama-gqa"), "--auth-token", "s3cret") as (_, address):
        with pytest.raises(RuntimeError, match="authentication failed"):
            LLM(engine_address=address)
        with pytest.raises(RuntimeError, match="authentication failed"):
            LLM(engine_address=address, auth_token="wrong")
        llm = LLM(engine_address=address, auth_token="s3cret")
        try:
            assert len(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)) == 1
        finally:
            llm.shutdown()


def test_daemon_refuses_a_public_address_without_a_token(tiny_model) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tokenmill.core.daemon", "--model", str(tiny_model("llama-gqa")),
         "--address", "tcp://127.0.0.1:5999", "--host", "0.0.0.0"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "TOKENMILL_AUTH_TOKEN": ""},
    )  # fmt: skip
    assert result.returncode != 0 and "without an auth token" in result.stderr


def test_fuzzed_frames_leave_the_daemon_serving(tiny_model) -> None:
    path = tiny_model("llama-gqa")
    expected = reference(path)
    rng = random.Random(0)
    encoder = Encoder()
    valid_add = encoder.encode([msgspec.structs.replace(_valid_request(), request_id="ok")])[0]
    with running_daemon(path) as (_, address):
        ctx = zmq.Context()
        try:
            strangers = ctx.socket(zmq.DEALER)  # never says hello
            insider = ctx.socket(zmq.DEALER)  # says hello, then sends garbage
            for s in (strangers, insider):
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.SNDHWM, 100_000)
                s.connect(address)
            insider.send_multipart([RequestType.HELLO, *encoder.encode(Hello(PROTOCOL_VERSION))])
            kinds = [RequestType.ADD, RequestType.ABORT, RequestType.UTILITY, RequestType.HELLO,
                     b"Z", b""]  # fmt: skip
            for i in range(3000):
                sender = strangers if i % 2 else insider
                body = rng.randbytes(rng.randint(0, 64))
                if i % 5 == 0:  # truncated valid request
                    body = valid_add[: rng.randint(0, len(valid_add) - 1)]
                frames = [rng.choice(kinds), body]
                if i % 7 == 0:
                    frames = frames[:1]
                sender.send_multipart(frames)
            insider.send_multipart([RequestType.ABORT, *encoder.encode(["no-such-request"])])
            time.sleep(1.0)
        finally:
            ctx.destroy(linger=0)
        llm = LLM(engine_address=address)
        try:
            outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == expected
        finally:
            llm.shutdown()


def _valid_request():
    return EngineCoreRequest("x", [1, 2, 3], GREEDY, [2], 0.0)


def test_reconnecting_client_survives_a_daemon_restart(tiny_model) -> None:
    path = tiny_model("llama-gqa")
    params = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(20 + i, 60 + i))} for i in range(16)]
    offline = LLM(str(path), multiprocess=False, skip_tokenizer_init=True, dtype="float32",
                  kv_cache_memory_bytes=32 << 20)  # fmt: skip
    try:
        expected = [
            o.outputs[0].token_ids for o in offline.generate(prompts, params, use_tqdm=False)
        ]
    finally:
        offline.shutdown()
    with running_daemon(path) as (first, address):
        llm = LLM(engine_address=address, reconnect=True)
        result: dict[str, object] = {}

        def run() -> None:
            try:
                result["outputs"] = llm.generate(prompts, params, use_tqdm=False)
            except BaseException as e:  # reported below
                result["error"] = e

        thread = threading.Thread(target=run)
        thread.start()
        # Killed once generation is under way (16 x 900 tokens take far longer).
        deadline = time.monotonic() + 30
        while llm.get_stats()["num_running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(first.pid, signal.SIGKILL)
        assert thread.is_alive(), "generation ended before the daemon was killed"
        first.wait(10)
        command = [
            sys.executable, "-m", "tokenmill.core.daemon", "--model", str(path),
            "--address", address, "--skip-tokenizer-init", "true",
            "--kv-cache-memory-bytes", str(32 << 20), "--dtype", "float32",
        ]  # fmt: skip
        second = subprocess.Popen(command)
        try:
            thread.join(600)  # the rest of 16 x 900 tokens, however slow the machine
            assert "error" not in result, result.get("error")
            outputs = result["outputs"]
            assert [o.outputs[0].token_ids for o in outputs] == expected
            assert all(o.outputs[0].finish_reason == "length" for o in outputs)
        finally:
            llm.shutdown()
            second.kill()
            second.wait(10)


def test_idle_daemon_does_not_spin(tiny_model) -> None:
    with running_daemon(tiny_model("llama-gqa")) as (proc, address):
        llm = LLM(engine_address=address)  # a connected client, then silence
        try:
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
            daemon = psutil.Process(proc.pid)
            time.sleep(0.5)
            before = daemon.cpu_times()
            time.sleep(10.0)
            after = daemon.cpu_times()
        finally:
            llm.shutdown()
    used = (after.user + after.system) - (before.user + before.system)
    assert used / 10.0 < 0.01, f"idle daemon used {100 * used / 10.0:.2f}% of a core"


def test_core_rejects_bad_requests_that_skip_the_frontend(tiny_model) -> None:
    """A client that bypasses the frontend's checks gets an error for the bad request only."""
    with running_daemon(tiny_model("llama-gqa")) as (_, address):
        with raw_core_client(address) as client:
            requests = [
                EngineCoreRequest("oov", [1, 10**7], GREEDY, [2], 0.0),
                EngineCoreRequest("long", [1] * 5000, GREEDY, [2], 0.0),
                EngineCoreRequest("fine", [1, 2, 3], GREEDY, [2], 0.0),
            ]
            client.send(RequestType.ADD, requests)
            client.collect(lambda c: len(c.finished_ids()) == 3)
            outputs = client.outputs
    last = {req_id: outs[-1] for req_id, outs in outputs.items()}
    assert last["oov"].finish_reason == FinishReason.ERROR
    assert "outside" in last["oov"].error
    assert last["long"].finish_reason == FinishReason.ERROR
    assert "max_model_len" in last["long"].error
    assert last["fine"].finish_reason == FinishReason.LENGTH


def test_a_reused_live_request_id_leaves_the_live_request_alone(tiny_model) -> None:
    long_run = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    with running_daemon(tiny_model("llama-gqa")) as (_, address):
        with raw_core_client(address) as client:
            client.send(RequestType.ADD, [EngineCoreRequest("a", [5] * 10, long_run, [2], 0.0)])
            client.send(RequestType.ADD, [EngineCoreRequest("a", [7, 8], GREEDY, [2], 0.0)])
            client.send(RequestType.ADD, [EngineCoreRequest("b", [7, 8], GREEDY, [2], 0.0)])
            # Heartbeats while it waits: however slow the machine, the daemon keeps it.
            client.collect(lambda c: len(c.finished_ids()) == 2, timeout=600.0)
            outputs = client.outputs
    tokens = [t for out in outputs["a"] for t in out.new_token_ids]
    assert len(tokens) == 300 and outputs["a"][-1].finish_reason == FinishReason.LENGTH
    assert not any(out.error for out in outputs["a"])
    assert outputs["b"][-1].finish_reason == FinishReason.LENGTH


def test_a_busy_port_is_one_line_and_a_nonzero_exit(tiny_model) -> None:
    port = free_port_pair()
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        model = str(tiny_model("llama-gqa"))
        address = f"tcp://127.0.0.1:{port}"
        command = [sys.executable, "-m", "tokenmill.core.daemon", "--model", model,
                   "--address", address]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    finally:
        holder.close()
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("engine-core: cannot listen on tcp://127.0.0.1:")
    assert "in use" in last and f"pid {os.getpid()}" in last
