#!/usr/bin/env python
"""Where a notebook's time goes: shares of py-spy samples by innermost frame.

Record a running notebook's kernel with py-spy (``pip install py-spy``; sampling from
outside the process, which it barely slows) and summarise the raw output:

    py-spy record --pid <kernel pid> --rate 5 --nonblocking --format raw -o 01.txt
    python benchmarks/profile_shares.py 01.txt [02.txt ...]

For each file: the share of samples whose innermost frame is ``Linear.forward`` (the
matrix products of the model's weights), the top innermost frames, and the top
innermost ``arithlib`` frames (which library step spends the time).
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

_LOCATION = re.compile(r" \(.*?:\d+\)")


def shares(path: Path, top: int = 8) -> dict:
    """Sample counts of a py-spy raw file (``stack count`` per line): total, by innermost
    function (location stripped) and by innermost arithlib frame."""
    leaf, ours, total = Counter(), Counter(), 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        stack, n = line.rsplit(" ", 1)
        frames, n = stack.split(";"), int(n)
        total += n
        leaf[_LOCATION.sub("", frames[-1])] += n
        mine = [f for f in frames if "arithlib/" in f]
        ours[mine[-1] if mine else "(outside arithlib)"] += n
    return {"total": total, "leaf": leaf.most_common(top), "arithlib": ours.most_common(top)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=8)
    a = ap.parse_args(argv)
    print("| profile | samples | Linear.forward | top arithlib frames |\n|---|---|---|---|")
    for f in a.files:
        s = shares(f, a.top)
        lin = dict(s["leaf"]).get("Linear.forward", 0) / max(1, s["total"])
        frames = "; ".join(f"{_LOCATION.sub('', k)} {v / s['total']:.0%}" for k, v in s["arithlib"][:3])
        print(f"| {f.stem} | {s['total']} | {lin:.0%} | {frames} |")


if __name__ == "__main__":
    main()
