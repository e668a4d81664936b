"""Per-step cost of the process split: encode + send + receive + decode of one engine step's
messages over ZeroMQ ipc sockets, as EngineCoreProc, its clients and the MultiprocExecutor do
it.

Measured for a 256-request decode step (EngineCoreOutputs with one new token each, core ->
frontend), for submitting 256 requests of 512 prompt tokens (frontend -> core), and for the
executor's broadcast of one step's SchedulerOutput to `--ranks` worker processes (a decode
step of 256 running requests, and a step admitting 256 new ones): encoded once, pushed to
every rank, decoded there, until every rank has acknowledged it.

    python scripts/bench_ipc.py [--requests 256] [--iterations 300] [--ranks 2]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
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
from tokenmill.protocol.scheduler_output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
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
    shutil.rmtree(folder, ignore_errors=True)
    return samples


def broadcast(payload: SchedulerOutput, ranks: int, iterations: int) -> list[float]:
    """Microseconds from encoding one SchedulerOutput to every rank's acknowledgement that it
    decoded it; the ranks are separate processes, as workers are."""
    folder = tempfile.mkdtemp(prefix="tokenmill-bcast-")
    ctx = zmq.Context()
    pushes = []
    for rank in range(ranks):
        push = ctx.socket(zmq.PUSH)
        push.bind(f"ipc://{folder}/calls-{rank}")
        pushes.append(push)
    acks = ctx.socket(zmq.PULL)
    acks.bind(f"ipc://{folder}/acks")
    receivers = [
        subprocess.Popen([sys.executable, __file__, "--receiver", folder, str(rank)])
        for rank in range(ranks)
    ]
    encoder = Encoder()
    samples = []
    try:
        for i in range(iterations + 5):  # the first rounds wait for the receivers to start
            start = time.perf_counter()
            frames = encoder.encode(payload)
            for push in pushes:
                push.send_multipart(frames, copy=False)
            for _ in range(ranks):
                acks.recv()
            if i >= 5:
                samples.append((time.perf_counter() - start) * 1e6)
    finally:
        for push in pushes:
            push.send(b"")  # an empty message tells a receiver to stop
        for proc in receivers:
            proc.wait(10)
        ctx.destroy(linger=0)
        shutil.rmtree(folder, ignore_errors=True)
    return samples


def receive(folder: str, rank: int) -> None:
    ctx = zmq.Context()
    calls = ctx.socket(zmq.PULL)
    calls.connect(f"ipc://{folder}/calls-{rank}")
    acks = ctx.socket(zmq.PUSH)
    acks.connect(f"ipc://{folder}/acks")
    decoder = Decoder(SchedulerOutput)
    while True:
        frames = calls.recv_multipart(copy=False)
        if not frames[0].bytes:
            break
        decoder.decode([f.buffer for f in frames])
        acks.send(b"ok")
    ctx.destroy(linger=1000)


def scheduler_outputs(n: int) -> tuple[SchedulerOutput, SchedulerOutput]:
    """A decode step of n running requests (one token each, a new block for one in 16), and a
    step admitting n new requests of 512 prompt tokens."""
    ids = [f"client0000000000/{i}" for i in range(n)]
    decode = SchedulerOutput(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=ids,
            new_block_ids=[[1000 + i] if i % 16 == 0 else [] for i in range(n)],
            num_computed_tokens=[300 + i for i in range(n)],
        ),
        num_scheduled_tokens={req_id: 1 for req_id in ids},
        total_num_scheduled_tokens=n,
    )
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=256)
    new = [
        NewRequestData(req_id, list(range(512)), params, [2], list(range(i * 32, i * 32 + 32)), 0)
        for i, req_id in enumerate(ids)
    ]
    admit = SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={req_id: 512 for req_id in ids},
        total_num_scheduled_tokens=512 * n,
    )
    return decode, admit


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--ranks", type=int, default=2, help="worker processes to broadcast to")
    parser.add_argument("--receiver", nargs=2, metavar=("DIR", "RANK"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receiver:
        receive(args.receiver[0], int(args.receiver[1]))
        return
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
    decode, admit = scheduler_outputs(n)
    rows += [
        (
            f"SchedulerOutput, {n} decodes -> {args.ranks} ranks",
            broadcast(decode, args.ranks, args.iterations),
        ),
        (
            f"SchedulerOutput, {n} new x 512 tokens -> {args.ranks} ranks",
            broadcast(admit, args.ranks, few),
        ),
    ]
    header = ("message (encode + send + receive + decode)", "median us", "p90 us")
    print("| {:<52} | {:>9} | {:>8} |".format(*header))
    print(f"|{'-' * 54}|{'-' * 11}|{'-' * 10}|")
    for name, samples in rows:
        samples.sort()
        p90 = samples[int(len(samples) * 0.9)]
        print(f"| {name:<52} | {statistics.median(samples):>9.0f} | {p90:>8.0f} |")


if __name__ == "__main__":
    main()
