"""`engine-core`: an EngineCore process started on its own, serving any number of clients.

    engine-core --model M --address tcp://127.0.0.1:PORT [--auth-token T] [engine args...]
    engine-core --model M --address ipc:///run/me/tokenmill/engine

Clients connect with `LLM(engine_address=...)`. tcp addresses must be loopback unless an auth
token is given (`--auth-token` or TOKENMILL_AUTH_TOKEN); clients without it are refused at the
handshake and never reach the engine. ipc sockets must sit in a private (0700) directory.
Every engine argument of `LLM(...)` is a flag here (`--max-model-len`, `--block-size`, ...).
"""

from __future__ import annotations

import argparse
import logging
import sys

from tokenmill.core.engine_core_proc import BindError, run_engine_core
from tokenmill.protocol import envs
from tokenmill.protocol.config import add_engine_args, engine_args_from
from tokenmill.protocol.sockets import (
    ensure_private_ipc_dir,
    is_loopback,
    split_address,
    with_host,
)

logger = logging.getLogger(__name__)


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
    add_engine_args(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    token = args.auth_token if args.auth_token is not None else envs.TOKENMILL_AUTH_TOKEN
    if args.host is not None:
        args.address = with_host(args.address, args.host)
    if not is_loopback(args.address) and not token:
        sys.exit(
            f"engine-core: refusing to listen on {args.address} without an auth token "
            "(pass --auth-token or set TOKENMILL_AUTH_TOKEN, or bind 127.0.0.1)"
        )
    input_address, output_address = split_address(args.address)
    ensure_private_ipc_dir(input_address)
    config = engine_args_from(args).create_engine_config()
    try:
        run_engine_core(config, input_address, output_address, None, token)
    except BindError as e:  # one line, not a traceback: the address is the user's to fix
        sys.exit(f"engine-core: {e}")


if __name__ == "__main__":
    main()
