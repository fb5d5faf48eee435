"""The markdown section a benchmark appends to ``benchmarks/RESULTS.md``: a heading with
the time and machine, the command that produced it, then its table."""

from __future__ import annotations

import platform
import shlex
import sys
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def command() -> str:
    """The command line that is running, as a user would type it."""
    return "python " + " ".join(shlex.quote(a) for a in [f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])


def section(title: str, table: list[str]) -> str:
    """``## title (time, machine)``, the command, and the table's lines."""
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join([f"## {title} ({stamp}, {platform.machine()})", "", f"`{command()}`", "", *table, ""])


def append(text: str) -> None:
    """Append a section to RESULTS.md."""
    with open(RESULTS, "a", encoding="utf-8") as fh:
        fh.write("\n" + text)
