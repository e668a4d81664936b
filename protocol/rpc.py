"""The executor <-> worker wire: how `collective_rpc` calls travel to worker processes.

The executor pushes each call to every rank (one PUSH socket per rank, so a call sent before a
worker has connected waits for it instead of being dropped), and all ranks push their replies
to one PULL socket: sending and receiving never share a socket, so one thread may send the
next call while another waits for replies. A call is a header frame (`RpcCall`) followed by
the codec's frames of the argument tuple; a reply is a header (`RpcReply`) followed by the
frames of the result, or of the error text.
Only the methods in the Worker's RPC table (`Worker.rpc_methods`) can be called, and both
sides decode arguments and results by their type hints, so a
SchedulerOutput arrives as a SchedulerOutput and numpy arrays as raw frames; nothing is ever
pickled. Used by core/executor/multiproc.py and worker/worker_proc.py.
"""

from __future__ import annotations

import functools
import inspect
import typing
from concurrent.futures import Future
from typing import Any, Optional

import msgspec

# The call id of the one message a worker sends unasked: ready (or not) after start-up.
STARTUP_CALL_ID = -1
# Not a Worker method: tells a worker process to exit; nobody replies.
SHUTDOWN = "shutdown"


class RpcCall(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    call_id: int
    method: str
    num_args: int = 0  # positional arguments first in the payload, then the keyword ones
    kwarg_names: list[str] = []
    # None: every rank replies; r: only rank r does (any rank that fails replies anyway).
    reply_rank: Optional[int] = None


class RpcReply(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    call_id: int
    rank: int
    ok: bool = True  # False: the payload is the error's text
    # A failed call's error, when it is the caller's (a ValueError: an argument the worker
    # refused): the executor raises it as that type, as a call in the core's process would.
    error_type: str = ""


def rpc_method(cls: type, method: str) -> Any:
    """`cls.method`, if cls's RPC table (its `rpc_methods`) lists it: only those are
    callable from another process, and their type hints are what travels."""
    table = getattr(cls, "rpc_methods", frozenset())
    if method not in table:
        raise AttributeError(
            f"{cls.__name__} has no RPC method {method!r} (its RPC table: {sorted(table)})"
        )
    return getattr(cls, method)


@functools.cache
def argument_type(cls: type, method: str, num_args: int, kwarg_names: tuple[str, ...]) -> Any:
    """The tuple type of one call's payload, from `cls.method`'s annotations."""
    fn = rpc_method(cls, method)
    hints = typing.get_type_hints(fn)
    params = [p for p in inspect.signature(fn).parameters if p != "self"]
    if num_args > len(params) or any(name not in params for name in kwarg_names):
        raise TypeError(
            f"{cls.__name__}.{method}{inspect.signature(fn)} does not take {num_args} "
            f"positional arguments and keywords {list(kwarg_names)}"
        )
    names = params[:num_args] + list(kwarg_names)
    types = tuple(hints.get(name, Any) for name in names)
    return tuple[types] if types else tuple[()]  # type: ignore[valid-type]


@functools.cache
def return_type(cls: type, method: str) -> Any:
    """What a call's reply holds: the method's return type (of a Future, what it resolves
    to: the worker replies once it completes)."""
    hint = typing.get_type_hints(rpc_method(cls, method)).get("return", Any)
    if typing.get_origin(hint) is Future:
        (hint,) = typing.get_args(hint)
    return hint
