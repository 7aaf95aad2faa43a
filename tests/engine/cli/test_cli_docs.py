"""docs/cli.md documents every option of ``demo`` and ``train``, with the default and the
choices their ``--help`` states: the page and the parser cannot drift apart."""

from __future__ import annotations

import argparse
import re

import pytest

from engine.cli.main import build_parser
from tests.test_layering import ROOT

PAGE = ROOT / "docs" / "cli.md"
#: How a help text states a default the parser does not hold (the config file's layering).
STATED_DEFAULT = re.compile(r"\(default ([^()]*)\)")


def command_parser(command: str) -> argparse.ArgumentParser:
    commands = next(
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    parser: argparse.ArgumentParser = commands.choices[command]
    return parser


def options(command: str) -> dict[str, argparse.Action]:
    """Each option of ``command`` by its long flag (``--help`` aside)."""
    return {
        action.option_strings[-1]: action
        for action in command_parser(command)._actions
        if action.option_strings and not isinstance(action, argparse._HelpAction)
    }


def stated_default(action: argparse.Action) -> str:
    """The default ``--help`` states: the parser's own, else the help's ``(default X)``; ""
    for none."""
    if action.default not in (None, False):
        return str(action.default)
    stated = STATED_DEFAULT.findall(action.help or "")
    return str(stated[-1]) if stated else ""


def documented(command: str) -> dict[str, tuple[str, str]]:
    """The rows of the page's ``### `COMMAND` options`` table: flag -> (default, whole row)."""
    section = PAGE.read_text().split(f"### `{command}` options\n", 1)[1].split("\n#", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        flag = re.match(r"`(--[\w-]+)", cells[0])
        if flag:
            rows[flag.group(1)] = (cells[1].replace("`", ""), line)
    return rows


@pytest.mark.parametrize("command", ["demo", "train"])
def test_every_option_is_on_the_page_and_every_row_is_an_option(command: str) -> None:
    assert sorted(documented(command)) == sorted(options(command))


@pytest.mark.parametrize("command", ["demo", "train"])
def test_the_page_states_the_default_and_the_choices_the_help_states(command: str) -> None:
    rows = documented(command)
    for flag, action in options(command).items():
        default, row = rows[flag]
        assert default == stated_default(action), f"{command} {flag}: page {default!r}"
        for choice in action.choices or ():
            assert f"`{choice}`" in row, f"{command} {flag}: choice {choice!r} not on the page"
