"""`engine-core`: an EngineCore process started on its own, serving any number of clients.

    engine-core --model M --address tcp://127.0.0.1:PORT [--auth-token T] [engine args...]
    engine-core --model M --address ipc:///run/me/tokenmill/engine

Clients connect with `LLM(engine_address=...)`. tcp addresses must be loopback unless an auth
token is given (`--auth-token` or TOKENMILL_AUTH_TOKEN); clients without it are refused at the
handshake and never reach the engine. ipc sockets must sit in a private (0700) directory.
Every engine argument of `LLM(...)` is a flag here (`--max-model-len`, `--block-size`, ...).

A headless data-parallel rank is a daemon that joins a frontend started with
`data_parallel_size_local` below `data_parallel_size`:

    engine-core --model M --address tcp://THIS_HOST:PORT --host 0.0.0.0 --auth-token T \\
        --data-parallel-size 2 --data-parallel-rank 1 \\
        --data-parallel-address FRONTEND_HOST --data-parallel-rpc-port RPC_PORT

Once its engine is ready it tells the frontend where it serves (the --address), until the
frontend answers and then every REREGISTER_S again, so that a restarted frontend finds it
too; the frontend then connects to it as to any daemon.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from tokenmill.core.engine_core_proc import BindError, EngineCoreProc, run_engine_core
from tokenmill.protocol import envs
from tokenmill.protocol.config import add_engine_args, engine_args_from
from tokenmill.protocol.messages import PROTOCOL_VERSION, REGISTERED, RankRegistration
from tokenmill.protocol.process import close_sockets
from tokenmill.protocol.sockets import (
    ensure_private_ipc_dir,
    is_loopback,
    split_address,
    with_host,
)

logger = logging.getLogger(__name__)

REGISTER_RETRY_S = 2.0  # until the frontend answers
REREGISTER_S = 10.0  # after it did


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engine-core",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--address", required=True, help="tcp://HOST:PORT or ipc://PATH")
    parser.add_argument(
        "--host", default=None, help="listen on this host instead of the address's (tcp only)"
    )
    parser.add_argument("--auth-token", default=None, help="required from every client")
    parser.add_argument(
        "--data-parallel-rank",
        type=int,
        default=None,
        help="run as this headless data-parallel rank: join the frontend at "
        "--data-parallel-address:--data-parallel-rpc-port",
    )
    add_engine_args(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    token = args.auth_token if args.auth_token is not None else envs.TOKENMILL_AUTH_TOKEN
    advertised = args.address  # what clients (and a frontend) connect to
    if args.host is not None:
        args.address = with_host(args.address, args.host)
    if not is_loopback(args.address) and not token:
        sys.exit(
            f"engine-core: refusing to listen on {args.address} without an auth token "
            "(pass --auth-token or set TOKENMILL_AUTH_TOKEN, or bind 127.0.0.1)"
        )
    input_address, output_address = split_address(args.address)
    ensure_private_ipc_dir(input_address)
    on_ready = None
    if args.data_parallel_rank is not None:
        if not args.data_parallel_rpc_port:
            sys.exit("engine-core: --data-parallel-rank needs --data-parallel-rpc-port")
        if args.data_parallel_size_local is None:
            args.data_parallel_size_local = 1  # this host runs this one rank
        frontend = f"tcp://{args.data_parallel_address}:{args.data_parallel_rpc_port}"
        rank = args.data_parallel_rank

        def on_ready(proc: EngineCoreProc) -> None:
            threading.Thread(
                target=register_with_frontend,
                args=(frontend, rank, advertised, token, proc.fail),
                daemon=True,
                name="dp-register",
            ).start()

    config = engine_args_from(args).create_engine_config()
    if args.data_parallel_rank is not None:
        parallel = dataclasses.replace(
            config.parallel_config, data_parallel_rank=args.data_parallel_rank
        )
        config = dataclasses.replace(config, parallel_config=parallel)
    try:
        run_engine_core(config, input_address, output_address, None, token, on_ready)
    except BindError as e:  # one line, not a traceback: the address is the user's to fix
        sys.exit(f"engine-core: {e}")


def register_with_frontend(
    frontend: str, rank: int, address: str, token: str, fail: Callable[[str], None]
) -> None:
    """Tells the frontend at `frontend` that `rank` serves at `address`, for as long as this
    process lives. A refusal (a wrong token, a rank out of range) ends the engine with
    `fail`: it cannot join, and says why."""
    ctx = zmq.Context()
    socket = ctx.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(frontend)
    message = msgspec.msgpack.encode(RankRegistration(PROTOCOL_VERSION, rank, address, token))
    registered = False
    try:
        while True:
            socket.send(message)
            wait = REREGISTER_S if registered else REGISTER_RETRY_S
            if not socket.poll(int(wait * 1000)):
                if not registered:
                    logger.info("waiting for the frontend at %s to answer", frontend)
                continue
            reply = socket.recv_multipart()
            if reply[0] == REGISTERED:
                if not registered:
                    logger.info("joined the frontend at %s as data-parallel rank %d", frontend,
                                rank)  # fmt: skip
                registered = True
                time.sleep(REREGISTER_S)
                continue
            why = reply[1].decode(errors="replace") if len(reply) > 1 else "no reason given"
            fail(f"the frontend at {frontend} refused data-parallel rank {rank}: {why}")
            return
    finally:
        close_sockets(ctx, [socket])


if __name__ == "__main__":
    main()
