"""The markdown section a benchmark appends to ``benchmarks/RESULTS.md``: a heading with
the time and machine, the command that produced it, then its table."""

from __future__ import annotations

import platform
import shlex
import sys
from datetime import UTC, datetime
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def command(argv: list[str] | None = None) -> str:
    """The command line that is running (``argv``: its arguments, default the
    process's own), as a user would type it."""
    args = sys.argv[1:] if argv is None else argv
    return "python " + " ".join(shlex.quote(a) for a in [f"benchmarks/{Path(sys.argv[0]).name}", *args])


def section(
    title: str, table: list[str], *, where: str | None = None, argv: list[str] | None = None, note: str | None = None
) -> str:
    """``## title (time, where)`` (``where`` defaults to the machine type), the
    command, an optional note, and the table's lines."""
    stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    head = [f"## {title} ({stamp}, {where or platform.machine()})", "", f"`{command(argv)}`", ""]
    return "\n".join(head + ([note, ""] if note else []) + [*table, ""])


def append(text: str) -> None:
    """Append a section to RESULTS.md."""
    with open(RESULTS, "a", encoding="utf-8") as fh:
        fh.write("\n" + text)
