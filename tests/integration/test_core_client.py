"""The multiprocess client against a fake engine core that completes the handshake and then
misbehaves: a utility call that gets no answer fails at its deadline, and one whose core dies
while it waits fails with EngineDeadError. Also: a bad `priority` list is refused up front."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest
import zmq
from helpers import AT_ONCE_S, PROMPTLY_S, free_port_pair

from tokenmill import LLM, EngineDeadError
from tokenmill.frontend.core_client import SyncMPClient
from tokenmill.protocol.codec import Encoder
from tokenmill.protocol.config import EngineArgs
from tokenmill.protocol.messages import PROTOCOL_VERSION, OutputType, Ready, RequestType


@contextmanager
def fake_core(model_path, die_on_utility: bool):
    """Answers hellos with READY; on a utility call either stays silent or closes its
    sockets, as a core that dies would."""
    config = EngineArgs(model=str(model_path), skip_tokenizer_init=True).create_engine_config()
    port = free_port_pair()
    ctx = zmq.Context()
    inputs, outputs = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    outputs.setsockopt(zmq.ROUTER_MANDATORY, 1)
    inputs.bind(f"tcp://127.0.0.1:{port}")
    outputs.bind(f"tcp://127.0.0.1:{port + 1}")
    stop = threading.Event()
    got_utility = threading.Event()

    def serve() -> None:
        encoder = Encoder()
        while not stop.is_set():
            if not inputs.poll(50):
                continue
            identity, kind, *_ = inputs.recv_multipart()
            if kind == RequestType.HELLO:
                ready = encoder.encode(Ready(PROTOCOL_VERSION, config, 10))
                for _ in range(100):  # the client's output socket may still be connecting
                    try:
                        outputs.send_multipart([identity, OutputType.READY, *ready])
                        break
                    except zmq.ZMQError:
                        time.sleep(0.01)
            elif kind == RequestType.UTILITY:
                got_utility.set()
                if die_on_utility:
                    break
        inputs.close(linger=0)
        outputs.close(linger=0)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}", got_utility
    finally:
        stop.set()
        thread.join(5)
        ctx.term()


def test_a_utility_call_without_answer_fails_at_its_deadline(tiny_model) -> None:
    with fake_core(tiny_model("llama-gqa"), die_on_utility=False) as (address, _):
        client = SyncMPClient(None, address)
        try:
            started = time.monotonic()
            with pytest.raises(TimeoutError, match="get_stats got no answer"):
                client.call_utility("get_stats", timeout=1.0)
            assert 1.0 <= time.monotonic() - started < 1.0 + AT_ONCE_S
        finally:
            client.shutdown()


def test_a_core_that_dies_during_a_utility_call_fails_it(tiny_model) -> None:
    with fake_core(tiny_model("llama-gqa"), die_on_utility=True) as (address, got_utility):
        client = SyncMPClient(None, address)
        try:
            started = time.monotonic()
            with pytest.raises(EngineDeadError):
                client.call_utility("get_stats", timeout=30.0)
            assert got_utility.is_set() and time.monotonic() - started < PROMPTLY_S
            with pytest.raises(EngineDeadError):  # and every later call, at once
                client.call_utility("get_stats")
        finally:
            client.shutdown()


def test_priority_list_of_the_wrong_length_is_refused(tiny_model) -> None:
    llm = LLM(str(tiny_model("llama-gqa")), multiprocess=False, skip_tokenizer_init=True,
              kv_cache_memory_bytes=8 << 20)  # fmt: skip
    try:
        prompts = [{"prompt_token_ids": [3, 4]}] * 3
        with pytest.raises(ValueError, match="priority has 2 entries for 3 prompts"):
            llm.generate(prompts, priority=[0, 1], use_tqdm=False)
    finally:
        llm.shutdown()
