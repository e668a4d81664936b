"""The command lines: every engine flag has help text, booleans take vLLM's spellings
(`--flag`, `--no-flag`) and the older `--flag true|false`, and `tokenmill --version`."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

import tokenmill
from tokenmill.protocol.config import EngineArgs, add_engine_args


@pytest.fixture
def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="test", exit_on_error=False)
    add_engine_args(parser)
    return parser


def test_every_engine_flag_has_help(parser) -> None:
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    assert set(actions) == EngineArgs.field_names()
    assert all(a.help and "default:" in a.help for a in actions.values())


@pytest.mark.parametrize(
    "argv, expected",
    [
        ([], True),
        (["--enable-prefix-caching"], True),
        (["--no-enable-prefix-caching"], False),
        (["--enable-prefix-caching", "false"], False),
        (["--enable-prefix-caching", "1"], True),
    ],
)
def test_boolean_flags_in_every_spelling(parser, argv, expected) -> None:
    assert parser.parse_args(argv).enable_prefix_caching is expected


def test_a_bad_boolean_names_the_flag(parser, capsys) -> None:
    with pytest.raises(SystemExit):
        parser.parse_args(["--enforce-eager", "maybe"])
    assert "--enforce-eager: expected true or false, got 'maybe'" in capsys.readouterr().err


def test_optional_booleans_stay_unset_by_default(parser) -> None:
    assert parser.parse_args([]).async_scheduling is None
    assert parser.parse_args(["--no-async-scheduling"]).async_scheduling is False


def test_tokenmill_version() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "from tokenmill.frontend.cli import main; main()", "--version"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == f"tokenmill {tokenmill.__version__}"
