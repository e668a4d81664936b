"""The wire codec: Structs and arrays round-trip (large arrays as zero-copy frames), and
nothing that would need pickle is ever encoded or decoded."""

from __future__ import annotations

import pickle

import msgspec
import numpy as np
import pytest
import torch

from tokenmill.protocol.codec import INLINE_LIMIT, DecodeError, Decoder, Encoder
from tokenmill.protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SamplingParams,
)
from tokenmill.protocol.rpc import argument_type
from tokenmill.protocol.scheduler_output import CachedRequestData, SchedulerOutput


class Payload(msgspec.Struct, array_like=True):
    name: str
    data: dict


def test_requests_and_outputs_round_trip() -> None:
    request = EngineCoreRequest(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        sampling_params=SamplingParams(temperature=0.5, stop=["x"], seed=3, max_tokens=9),
        eos_token_ids=[2],
        arrival_time=1.5,
        priority=-1,
    )
    frames = Encoder().encode(request)
    assert len(frames) == 1
    assert Decoder(EngineCoreRequest).decode(frames) == request
    outputs = EngineCoreOutputs(
        outputs=[EngineCoreOutput("r1", [5, 6], FinishReason.STOP, "x", 4)], timestamp=2.0
    )
    decoded = Decoder(EngineCoreOutputs).decode(Encoder().encode(outputs))
    assert decoded == outputs and decoded.outputs[0].finish_reason is FinishReason.STOP


def test_arrays_and_tensors_travel_as_frames_without_copies() -> None:
    big = np.arange(1000, dtype=np.float32)
    small = np.arange(3, dtype=np.int64)
    tensor = torch.arange(300, dtype=torch.float32).reshape(30, 10)
    bf16 = torch.ones(500, dtype=torch.bfloat16)
    frames = Encoder().encode(Payload("x", {"big": big, "small": small, "t": tensor, "b": bf16}))
    # Body + one frame per large array; the small one is inlined.
    assert len(frames) == 4 and small.nbytes <= INLINE_LIMIT < big.nbytes
    assert isinstance(frames[1], memoryview)
    assert np.shares_memory(np.frombuffer(frames[1], dtype=np.float32), big)  # zero copy
    out = Decoder(Payload).decode([bytes(f) for f in frames])
    np.testing.assert_array_equal(out.data["big"], big)
    np.testing.assert_array_equal(out.data["small"], small)
    assert torch.equal(out.data["t"], tensor) and out.data["b"].dtype == torch.bfloat16
    assert torch.equal(out.data["b"], bf16)


def test_encoder_refuses_what_only_pickle_could_carry() -> None:
    class Opaque:
        pass

    with pytest.raises(TypeError, match="cannot encode Opaque"):
        Encoder().encode(Payload("x", {"o": Opaque()}))
    with pytest.raises(TypeError, match="object arrays"):
        Encoder().encode(Payload("x", {"o": np.array([Opaque()] * 300, dtype=object)}))


def test_decoder_refuses_pickled_payloads() -> None:
    class Evil:
        def __reduce__(self):
            return (print, ("pickle ran",))

    # A pickle smuggled as an extension type, as a raw body, and as an object-dtype array.
    smuggled = msgspec.msgpack.encode(msgspec.msgpack.Ext(9, pickle.dumps(Evil())))
    with pytest.raises(DecodeError, match="refused"):
        Decoder().decode([smuggled])
    with pytest.raises(DecodeError):
        Decoder(EngineCoreRequest).decode([pickle.dumps(Evil())])
    body = msgspec.msgpack.encode(["|O", [1], b"\x00" * 8])
    object_array = msgspec.msgpack.encode(msgspec.msgpack.Ext(1, body))
    with pytest.raises(DecodeError, match="object arrays are refused"):
        Decoder().decode([object_array])


@pytest.mark.parametrize("junk", [b"", b"\xff\xff", b"\x93\x01", b"\xc1"])
def test_malformed_frames_are_decode_errors(junk: bytes) -> None:
    with pytest.raises(DecodeError):
        Decoder(EngineCoreRequest).decode([junk])


class _Target:
    """Stands in for the Worker: collective_rpc payloads decode by its annotations."""

    rpc_methods = frozenset({"step"})

    def step(self, out: SchedulerOutput, mask: np.ndarray, scale: float = 1.0) -> int:
        return 0

    def rest(self) -> None:  # public, but not in the RPC table
        pass


def test_rpc_arguments_decode_by_the_methods_annotations() -> None:
    out = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(["a"], [[3]], [7]),
        num_scheduled_tokens={"a": 1},
        total_num_scheduled_tokens=1,
        preempted_req_ids=["b"],
    )
    mask = np.arange(375_000, dtype=np.int32)  # a 1.5 MB per-step token bitmask
    frames = Encoder().encode((out, mask, 0.5))
    # The mask is its own frame, the array's own memory, not a copy inside the body.
    assert len(frames) == 2 and frames[1].nbytes == mask.nbytes
    assert np.shares_memory(np.frombuffer(frames[1], dtype=np.int32), mask)
    decoded = Decoder(argument_type(_Target, "step", 2, ("scale",))).decode(frames)
    assert decoded[0] == out and isinstance(decoded[0], SchedulerOutput)
    assert np.array_equal(decoded[1], mask) and decoded[2] == 0.5
    with pytest.raises(TypeError, match="does not take"):
        argument_type(_Target, "step", 4, ())
    with pytest.raises(AttributeError, match="no RPC method '_private'"):
        argument_type(_Target, "_private", 0, ())
    with pytest.raises(AttributeError, match=r"no RPC method 'rest' \(its RPC table: \['step'\]\)"):
        argument_type(_Target, "rest", 0, ())
