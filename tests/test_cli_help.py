"""Every option and positional argument of every ``meshplan`` subcommand, and of the ranks' entry
(``python -m meshplan.runtime.loop.train``, what ``meshplan run --print-command`` shows), has help text."""

from __future__ import annotations

import argparse

from meshplan.cli import COMMANDS, build_parser


def undocumented(parser: argparse.ArgumentParser, path: str = "meshplan") -> list[str]:
    """``"meshplan run --steps"`` for each argument (in ``parser`` and its subparsers) without help."""
    missing: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                missing += undocumented(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction) and not (action.help or "").strip():
            missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    return missing


def test_every_cli_argument_has_help() -> None:
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subs.choices) == set(COMMANDS), "a command failed to build its parser"
    assert undocumented(parser) == []


def test_the_walk_finds_an_argument_without_help() -> None:
    parser = argparse.ArgumentParser(prog="meshplan")
    sub = parser.add_subparsers().add_parser("x")
    sub.add_argument("--documented", help="says what it does")
    sub.add_argument("--bare")
    sub.add_argument_group("group").add_argument("--grouped", help="")
    assert undocumented(parser) == ["meshplan x --bare", "meshplan x --grouped"]


def test_every_rank_entry_argument_has_help() -> None:
    from meshplan.runtime.loop.train import build_parser as rank_parser

    assert undocumented(rank_parser(), "meshplan.runtime.loop.train") == []
