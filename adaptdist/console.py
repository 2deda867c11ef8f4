"""The rich console the commands print reports on."""

from __future__ import annotations

from typing import Any

REPORT_WIDTH = 140
"""Columns when the output is not a terminal (a pipe or a file): rich's 80 would cut the tables."""


def report_console(stderr: bool = False) -> Any:
    """A ``rich.console.Console`` for reports: emoji off (``m.py:factory:`` must not become one), and
    :data:`REPORT_WIDTH` columns when not writing to a terminal."""
    from rich.console import Console

    console = Console(stderr=stderr, emoji=False)
    if not console.is_terminal:
        console = Console(stderr=stderr, emoji=False, width=REPORT_WIDTH)
    return console
