"""Per-step cost of the process split: encode + send + receive + decode of one engine step's
messages over a ZeroMQ ipc socket pair, as EngineCoreProc and its clients do it.

Measured for a 256-request decode step (EngineCoreOutputs with one new token each, core ->
frontend) and for submitting 256 requests of 512 prompt tokens (frontend -> core).

    python scripts/bench_ipc.py [--requests 256] [--iterations 300]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time

import zmq

from tokenmill.protocol.codec import Decoder, Encoder
from tokenmill.protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    SamplingParams,
)


def echo_round_trip(payload, type_, iterations: int) -> list[float]:
    """Microseconds for encode -> send -> (peer: receive, decode, re-encode, send back) ->
    receive -> decode; half of it is one one-way hop."""
    ctx = zmq.Context()
    folder = tempfile.mkdtemp(prefix="tokenmill-ipc-")
    address = f"ipc://{folder}/bench"
    server = ctx.socket(zmq.PAIR)
    server.bind(address)
    client = ctx.socket(zmq.PAIR)
    client.connect(address)

    def serve() -> None:
        decoder, encoder = Decoder(type_), Encoder()
        for _ in range(iterations):
            frames = server.recv_multipart(copy=False)
            obj = decoder.decode([f.buffer for f in frames])
            server.send_multipart(encoder.encode(obj), copy=False)

    thread = threading.Thread(target=serve)
    thread.start()
    encoder, decoder = Encoder(), Decoder(type_)
    samples = []
    for _ in range(iterations):
        start = time.perf_counter()
        client.send_multipart(encoder.encode(payload), copy=False)
        frames = client.recv_multipart(copy=False)
        decoder.decode([f.buffer for f in frames])
        samples.append((time.perf_counter() - start) * 1e6 / 2)
    thread.join()
    ctx.destroy(linger=0)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--iterations", type=int, default=300)
    args = parser.parse_args()
    n = args.requests
    step = EngineCoreOutputs(
        outputs=[EngineCoreOutput(f"client0000000000/{i}", [1000 + i]) for i in range(n)],
        timestamp=time.monotonic(),
    )
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=256)
    adds = [EngineCoreRequest(str(i), list(range(512)), params, [2], time.time()) for i in range(n)]
    few = max(args.iterations // 10, 10)
    rows = [
        (
            f"decode step: {n} outputs, core -> client",
            echo_round_trip(step, EngineCoreOutputs, args.iterations),
        ),
        (
            f"{n} requests x 512 prompt tokens, client -> core",
            echo_round_trip(adds, list[EngineCoreRequest], few),
        ),
    ]
    header = ("message (one way: encode + send + receive + decode)", "median us", "p90 us")
    print("| {:<52} | {:>9} | {:>8} |".format(*header))
    print(f"|{'-' * 54}|{'-' * 11}|{'-' * 10}|")
    for name, samples in rows:
        samples.sort()
        p90 = samples[int(len(samples) * 0.9)]
        print(f"| {name:<52} | {statistics.median(samples):>9.0f} | {p90:>8.0f} |")


if __name__ == "__main__":
    main()
