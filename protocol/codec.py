"""The wire codec: msgspec msgpack for Structs, extra ZMQ frames for array payloads.

`encode(obj)` returns a list of frames: the msgpack body first, then one frame per numpy
array or torch tensor larger than `INLINE_LIMIT` bytes, referenced from the body by index
(zero copy: the frame is the array's buffer). Small arrays are inlined. `decode(frames, type)`
reverses it. There is no pickle anywhere: an unknown type is an encoding error, and a body
that is not valid msgpack for the expected type is a `DecodeError` for the caller to log and
drop. Used by the engine-core process and every multiprocess client.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
import numpy as np

T = TypeVar("T")

# Arrays up to this size travel inside the msgpack body; larger ones as their own frame.
INLINE_LIMIT = 256
_EXT_INLINE = 1  # payload: msgpack [dtype, shape, raw bytes]
_EXT_FRAME = 2  # payload: msgpack [dtype, shape, frame index]
_EXT_TORCH = 3  # a torch tensor: payload is an encoded array (inline or frame)

DecodeError = msgspec.DecodeError


class Encoder:
    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._frames: list[Any] = []

    def encode(self, obj: Any) -> list[Any]:
        # The hook appends array frames while the body is encoded; the body goes first.
        self._frames = [b""]
        self._frames[0] = self._encoder.encode(obj)
        frames, self._frames = self._frames, []
        return frames

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            return self._encode_array(obj)
        torch = _torch()
        if torch is not None and isinstance(obj, torch.Tensor):
            array = obj.detach().cpu()
            if array.dtype == torch.bfloat16:  # numpy has no bf16: ship the raw 16-bit words
                dtype, array = "bfloat16", array.view(torch.int16).numpy()
            else:
                dtype, array = str(array.dtype).removeprefix("torch."), array.numpy()
            inner = self._encode_array(array)
            return msgspec.msgpack.Ext(_EXT_TORCH, msgspec.msgpack.encode([dtype, inner]))
        raise TypeError(f"cannot encode {type(obj).__name__} (only msgspec types and arrays)")

    def _encode_array(self, array: np.ndarray) -> msgspec.msgpack.Ext:
        if array.dtype.hasobject:
            raise TypeError("object arrays cannot be sent (they would need pickle)")
        array = np.ascontiguousarray(array)
        if array.nbytes <= INLINE_LIMIT:
            body = [array.dtype.str, list(array.shape), array.tobytes()]
            return msgspec.msgpack.Ext(_EXT_INLINE, msgspec.msgpack.encode(body))
        self._frames.append(memoryview(array).cast("B"))
        body = [array.dtype.str, list(array.shape), len(self._frames) - 1]
        return msgspec.msgpack.Ext(_EXT_FRAME, msgspec.msgpack.encode(body))


class Decoder:
    def __init__(self, type_: type[T] | Any = Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(type_, ext_hook=self._ext_hook)
        self._frames: list[Any] = []

    def decode(self, frames: list[Any]) -> Any:
        if not frames:
            raise DecodeError("empty message")
        self._frames = frames
        try:
            return self._decoder.decode(frames[0])
        except (ValueError, TypeError, IndexError) as e:
            raise DecodeError(str(e)) from e
        finally:
            self._frames = []

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == _EXT_TORCH:
            dtype, inner = msgspec.msgpack.decode(data)
            torch = _torch()
            if torch is None or not isinstance(inner, msgspec.msgpack.Ext):
                raise DecodeError("malformed tensor payload, or torch is not available")
            array = self._ext_hook(inner.code, inner.data)
            # Frames arrive read-only; torch needs a writable buffer.
            tensor = torch.from_numpy(array if array.flags.writeable else array.copy())
            return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor
        if code in (_EXT_INLINE, _EXT_FRAME):
            dtype, shape, payload = msgspec.msgpack.decode(data)
            np_dtype = np.dtype(dtype)
            if np_dtype.hasobject:
                raise DecodeError("object arrays are refused")
            buffer = payload if code == _EXT_INLINE else self._frames[payload]
            return np.frombuffer(buffer, dtype=np_dtype).reshape(shape)
        raise DecodeError(f"unknown extension type {code} (pickled payloads are refused)")


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch
