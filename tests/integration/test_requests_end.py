"""Every request sent ends: with its outputs, with an error output, or (when the core cannot
even read its id) with a refusal its client turns into an error. Checked from a raw client
that sends ill-typed request messages (a seeded fuzz of 1,000 of them), and from the
frontend's own clients, whose audit ends requests the core never saw."""

from __future__ import annotations

import asyncio
import copy
import math
import random
import time

import msgspec
import pytest
from helpers import raw_core_client, running_daemon

from tokenmill import LLM, SamplingParams
from tokenmill.frontend.async_core_client import AsyncMPClient
from tokenmill.frontend.core_client import SyncMPClient
from tokenmill.protocol.messages import (
    EngineCoreRequest,
    FinishReason,
    RequestType,
    StructuredOutputsParams,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def _request(req_id: str, params: SamplingParams = GREEDY) -> EngineCoreRequest:
    return EngineCoreRequest(req_id, [1, 2, 3], params, [2], 0.0)


def test_an_ill_typed_request_ends_with_an_error_naming_the_field(tiny_model) -> None:
    """One message, three requests: one fine, one with a dict where the regex string belongs
    (its id is readable), one whose id is not a string. The first runs, the second ends with
    an error naming the field, the third is refused to the sender."""
    ill_typed = msgspec.to_builtins(
        _request("bad", SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")))
    )
    ill_typed[2]["structured_outputs"]["regex"] = {"a": 1}
    no_id = msgspec.to_builtins(_request("x"))
    no_id[0] = 12345
    body = msgspec.msgpack.encode([msgspec.to_builtins(_request("fine")), ill_typed, no_id])
    with running_daemon(tiny_model("llama-gqa")) as (_, address):
        with raw_core_client(address) as client:
            client.send_frames([RequestType.ADD, body])
            client.collect(lambda c: len(c.finished_ids()) == 2 and c.refusals)
    last = {req_id: outs[-1] for req_id, outs in client.outputs.items()}
    assert set(last) == {"fine", "bad"}
    assert last["fine"].finish_reason == FinishReason.LENGTH
    assert last["bad"].finish_reason == FinishReason.ERROR
    assert "sampling_params.structured_outputs.regex" in last["bad"].error
    assert "{'a': 1}" in last["bad"].error
    assert len(client.refusals) == 1 and "request_id" in client.refusals[0]


# Values a fuzzed field takes: wrong types, nulls, nesting, extremes.
_ODD_VALUES = [
    None, "", "text", "x" * 2000, -1, 0, 1, 2**63 - 1, -(2**63), 1e308, -1e308, math.inf,
    -math.inf, math.nan, 0.5, True, False, [], {}, [1, "a"], [[[]]], {"a": {"b": [1]}},
    {"regex": {"a": 1}}, b"\x00\xff", [-5, 10**9], {"1": "x"}, {"json": None},
]  # fmt: skip
_SAMPLING_FIELDS = list(SamplingParams.__struct_fields__)


def _fuzzed_message(rng: random.Random, index: int) -> tuple[list, list[str], bool]:
    """A msgpack-ready ADD body of 1-3 mutated requests, the ids a reader can find in it,
    and whether some request in it has no readable id."""
    items, ids, unreadable = [], [], False
    for j in range(rng.randint(1, 3)):
        req_id = f"f{index}.{j}"
        item = msgspec.to_builtins(_request(req_id))
        for _ in range(rng.randint(1, 3)):
            where = rng.random()
            value = copy.deepcopy(rng.choice(_ODD_VALUES))
            if not isinstance(item[2], dict):  # the sampling params were replaced whole
                item[1] = value
            elif where < 0.55:  # a sampling field
                item[2][rng.choice(_SAMPLING_FIELDS)] = value
            elif where < 0.65:  # an unknown sampling field
                item[2][f"unknown_{rng.randint(0, 9)}"] = value
            elif where < 0.75:  # structured outputs, possibly nested oddly
                kind = rng.choice(["regex", "json", "choice", "grammar", "bogus"])
                item[2]["structured_outputs"] = {kind: value}
            elif where < 0.95:  # a top-level field other than the id
                item[rng.randint(1, len(item) - 1)] = value
            else:
                item[0] = value  # the id itself
        if rng.random() < 0.05:
            item = rng.choice([None, 7, "loose", {"request_id": req_id}])  # not even an array
        readable = (isinstance(item, list) and isinstance(item[0], str)) or isinstance(item, dict)
        if readable:
            ids.append(item[0] if isinstance(item, list) else item["request_id"])
        else:
            unreadable = True
        items.append(item)
    return items, ids, unreadable


def test_fuzzed_request_messages_all_end_and_the_core_serves_on(tiny_model) -> None:
    rng = random.Random(20)
    messages = [_fuzzed_message(rng, i) for i in range(1000)]
    expected_ids = {req_id for _, ids, _ in messages for req_id in ids}
    refusals = sum(unreadable for *_, unreadable in messages)
    path = tiny_model("llama-gqa")
    # A short max_model_len bounds what any accepted request can run for.
    with running_daemon(path, "--max-model-len", "64") as (_, address):
        with raw_core_client(address) as client:
            for items, _, _ in messages:
                client.send_frames([RequestType.ADD, msgspec.msgpack.encode(items)])
            client.collect(
                lambda c: c.finished_ids() >= expected_ids and len(c.refusals) >= refusals,
                timeout=300.0,
            )
            missing = expected_ids - client.finished_ids()
            assert not missing, f"{len(missing)} requests never ended, e.g. {sorted(missing)[:5]}"
            assert len(client.refusals) == refusals
            errors = [o[-1] for o in client.outputs.values() if o[-1].error]
            assert errors and all(o.finish_reason == FinishReason.ERROR for o in errors)
            ran = [o[-1] for o in client.outputs.values() if not o[-1].error]
            assert ran, "some fuzzed requests are valid and must run"
        llm = LLM(engine_address=address)
        try:
            out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)[0]
            assert len(out.outputs[0].token_ids) == 4
        finally:
            llm.shutdown()


def _ghost_output(get_output, ghost: str, deadline_s: float):
    """Reads outputs until `ghost` ends; returns its final output."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        outputs = get_output()
        for out in outputs.outputs if outputs else ():
            if out.request_id == ghost and out.finished:
                return out
    raise AssertionError(f"{ghost} never ended")


def test_the_client_ends_requests_the_core_never_saw(tiny_model) -> None:
    """A request whose message the core could not read at all ends with the core's refusal
    as its error; one the core never got ends at the next audit. Other requests go on."""
    with running_daemon(tiny_model("llama-gqa")) as (_, address):
        client = SyncMPClient(None, address)
        try:
            with client.send_lock:  # as add_requests records a request, then sends it
                client.unfinished["unreadable"] = None
                client._send_raw([RequestType.ADD, b"\xc1"])  # not msgpack
            out = _ghost_output(lambda: client.get_output(timeout=1.0), "unreadable", 60.0)
            assert out.finish_reason == FinishReason.ERROR
            assert "unreadable ADD message" in out.error

            client.add_requests([_request("real")])
            with client.send_lock:
                client.unfinished["never-sent"] = None
            outs = {}
            deadline = time.monotonic() + 60.0
            while len(outs) < 2 and time.monotonic() < deadline:
                outputs = client.get_output(timeout=1.0)
                for o in outputs.outputs if outputs else ():
                    if o.finished:
                        outs[o.request_id] = o
            assert outs["real"].finish_reason == FinishReason.LENGTH
            assert outs["never-sent"].finish_reason == FinishReason.ERROR
            assert "holds no such request" in outs["never-sent"].error
            assert not client.unfinished
        finally:
            client.shutdown()


def test_the_async_client_ends_requests_the_core_never_saw(tiny_model) -> None:
    with running_daemon(tiny_model("llama-gqa")) as (_, address):
        client = AsyncMPClient(None, address)

        async def main():
            with client.send_lock:
                client.unfinished["never-sent"] = None
            while True:
                outputs = await asyncio.wait_for(client.get_output_async(), 60.0)
                for out in outputs.outputs:
                    if out.request_id == "never-sent" and out.finished:
                        return out

        try:
            out = asyncio.run(main())
            assert out.finish_reason == FinishReason.ERROR
            assert "holds no such request" in out.error
        finally:
            client.shutdown()


@pytest.mark.parametrize("multiprocess", [False, True])
def test_llm_refuses_an_ill_typed_field_by_name(tiny_model, multiprocess) -> None:
    """What reaches the core from LLM has the message types' own types: an ill-typed field
    is a ValueError naming its path and value, before anything is sent."""
    llm = LLM(str(tiny_model("llama-gqa")), multiprocess=multiprocess, skip_tokenizer_init=True,
              kv_cache_memory_bytes=32 << 20)  # fmt: skip
    try:
        bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex={"a": 1}))
        with pytest.raises(ValueError, match=r"structured_outputs\.regex.*\{'a': 1\}"):
            llm.generate([{"prompt_token_ids": [1, 2]}], bad, use_tqdm=False)
        with pytest.raises(ValueError, match=r"sampling_params\.n: Expected `int`, got `bool`"):
            llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(n=True), use_tqdm=False)
        out = llm.generate([{"prompt_token_ids": [1, 2]}], GREEDY, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 4
    finally:
        llm.shutdown()
