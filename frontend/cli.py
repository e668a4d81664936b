"""The `tokenmill` command: `tokenmill serve [MODEL] [options]` starts the OpenAI-compatible
server (see `tokenmill serve --help`)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    import tokenmill
    from tokenmill.frontend.server.app import __doc__ as serve_doc
    from tokenmill.frontend.server.app import add_serve_args, serve

    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tokenmill {tokenmill.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser(
        "serve",
        help="start the OpenAI-compatible HTTP server",
        description=serve_doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_args(serve_parser)
    args = parser.parse_args(argv)
    sys.exit(serve(args))


if __name__ == "__main__":
    main()
