"""Per-step cost of the process split: encode + send + receive + decode of one engine step's
messages over ZeroMQ ipc sockets, as EngineCoreProc, its clients and the MultiprocExecutor do
it.

Measured for a 256-request decode step (EngineCoreOutputs with one new token each, core ->
frontend), for submitting 256 requests of 512 prompt tokens (frontend -> core), and for the
executor's broadcast of one step's SchedulerOutput to `--ranks` worker processes (a decode
step of 256 running requests, and a step admitting 256 new ones): encoded once, pushed to
every rank, decoded there, until every rank has acknowledged it. The broadcast is measured
over each of `--transports`: `ipc` (the multiprocess executor's), `tcp-curve` (the Ray
executor's: TCP on this host's IP, CURVE-authenticated and encrypted) and `ray` (Ray's own
channel, for comparison: an actor call per rank carrying the encoded frames, needs ray).

    python scripts/bench_ipc.py [--requests 256] [--iterations 300] [--ranks 2]
    python scripts/bench_ipc.py --transports ipc tcp-curve ray
"""

from __future__ import annotations

import argparse
import shutil
import socket
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
from tokenmill.protocol.sockets import CurveKeys


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


def broadcast(
    payload: SchedulerOutput, ranks: int, iterations: int, transport: str = "ipc"
) -> list[float]:
    """Microseconds from encoding one SchedulerOutput to every rank's acknowledgement that it
    decoded it; the ranks are separate processes, as workers are."""
    if transport == "ray":
        return ray_broadcast(payload, ranks, iterations)
    folder = tempfile.mkdtemp(prefix="tokenmill-bcast-")
    ctx = zmq.Context()
    keys = auth = None
    if transport == "tcp-curve":
        keys = CurveKeys.generate()
        auth = keys.start_authenticator(ctx)
        host = f"tcp://{_host_ip()}"
    pushes, addresses = [], []
    for rank in range(ranks + 1):  # the calls to each rank, then the acknowledgements
        sock = ctx.socket(zmq.PUSH if rank < ranks else zmq.PULL)
        if keys is not None:
            keys.make_server(sock)
            addresses.append(f"{host}:{sock.bind_to_random_port(host)}")
        else:
            addresses.append(f"ipc://{folder}/{rank}")
            sock.bind(addresses[-1])
        pushes.append(sock)
    acks = pushes.pop()
    client = keys.for_client() if keys is not None else None
    secrets = "" if client is None else " ".join(
        k.decode() for k in (client.server_public, client.client_public, client.client_secret)
    )  # fmt: skip
    receivers = []
    for rank in range(ranks):
        proc = subprocess.Popen(
            [sys.executable, __file__, "--receiver", addresses[rank], addresses[-1]],
            stdin=subprocess.PIPE,
        )
        proc.stdin.write(secrets.encode())  # keys on stdin, never on the command line
        proc.stdin.close()
        receivers.append(proc)
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
        if auth is not None:
            auth.stop()
        ctx.destroy(linger=0)
        shutil.rmtree(folder, ignore_errors=True)
    return samples


def receive(call_address: str, ack_address: str) -> None:
    ctx = zmq.Context()
    calls = ctx.socket(zmq.PULL)
    acks = ctx.socket(zmq.PUSH)
    secrets = sys.stdin.read().split()
    if secrets:
        keys = CurveKeys(secrets[0].encode(), b"", secrets[1].encode(), secrets[2].encode())
        keys.make_client(calls)
        keys.make_client(acks)
    calls.connect(call_address)
    acks.connect(ack_address)
    decoder = Decoder(SchedulerOutput)
    while True:
        frames = calls.recv_multipart(copy=False)
        if not frames[0].bytes:
            break
        decoder.decode([f.buffer for f in frames])
        acks.send(b"ok")
    ctx.destroy(linger=1000)


class _Decoding:
    """A Ray actor that decodes a SchedulerOutput from the encoded frames it is sent."""

    def __init__(self) -> None:
        self.decoder = Decoder(SchedulerOutput)

    def decode(self, frames: list[bytes]) -> bool:
        self.decoder.decode(frames)
        return True


def ray_broadcast(payload: SchedulerOutput, ranks: int, iterations: int) -> list[float]:
    """The same broadcast over Ray's own channel: one actor call per rank (on this machine's
    local Ray instance) carrying the frames, waited for together."""
    from tokenmill.protocol.ray_cluster import init_ray

    ray = init_ray()
    actors = [ray.remote(num_cpus=0)(_Decoding).remote() for _ in range(ranks)]
    encoder = Encoder()
    samples = []
    for i in range(iterations + 5):
        start = time.perf_counter()
        frames = [bytes(f) for f in encoder.encode(payload)]
        ray.get([actor.decode.remote(frames) for actor in actors])
        if i >= 5:
            samples.append((time.perf_counter() - start) * 1e6)
    for actor in actors:
        ray.kill(actor)
    return samples


def _host_ip() -> str:
    """This host's address toward the network (not loopback), as a Ray node's would be."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the route
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


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
    parser.add_argument("--transports", nargs="+", default=["ipc", "tcp-curve"],
                        choices=["ipc", "tcp-curve", "ray"])  # fmt: skip
    parser.add_argument("--receiver", nargs=2, metavar=("CALLS", "ACKS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receiver:
        receive(*args.receiver)
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
    for transport in args.transports:
        rows += [
            (
                f"SchedulerOutput, {n} decodes -> {args.ranks} ranks, {transport}",
                broadcast(decode, args.ranks, args.iterations, transport),
            ),
            (
                f"SchedulerOutput, {n} new x 512 tokens -> {args.ranks} ranks, {transport}",
                broadcast(admit, args.ranks, few, transport),
            ),
        ]
    header = ("message (encode + send + receive + decode)", "median us", "p90 us")
    print("| {:<66} | {:>9} | {:>8} |".format(*header))
    print(f"|{'-' * 68}|{'-' * 11}|{'-' * 10}|")
    for name, samples in rows:
        samples.sort()
        p90 = samples[int(len(samples) * 0.9)]
        print(f"| {name:<66} | {statistics.median(samples):>9.0f} | {p90:>8.0f} |")


if __name__ == "__main__":
    main()
