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


_UNPRINTABLE = frozenset(("Cc", "Cf", "Cs", "Zl", "Zp"))  # controls, format (bidi overrides), surrogates, separators


def printable_text(text: str) -> str:
    """``text`` safe to write to a terminal: newlines and tabs kept, every other control or format character
    (ESC, BEL, CR, backspace, C1 controls, bidi overrides, line separators) written as its Python escape
    (``\\x1b``, ``\\r``, ``\\u202e``), so that generated text cannot move the cursor, recolour or clear the
    terminal. Example: ``"a\\x1b[2Jb\\n"`` -> ``"a\\\\x1b[2Jb\\n"``."""
    import unicodedata

    def esc(c: str) -> str:
        if c in "\n\t" or unicodedata.category(c) not in _UNPRINTABLE:
            return c
        return repr(c)[1:-1]

    return "".join(esc(c) for c in text)
