"""Each section of a notebook against its arithmetic floor.

A section's floor is the time its arithmetic would take at the machine's matrix-product
peak:

    floor_s = gflop / peak_gflop_s,        ratio_to_floor = wall_s / floor_s,

with ``gflop`` the floating-point operations the section dispatched, counted as it ran
(:mod:`arithlib.engine.flops`: matrix products, attention, forward and backward), and
``peak_gflop_s`` the best rate of ``[M, d_model] @ [d_model, d_mlp]`` products measured on
the run's device, dtype and threads at the start of the notebook (:func:`matmul_peak`,
the model's own MLP shape, the best of a few row counts). A ratio of 1 is the machine
doing nothing but the arithmetic, at its best rate; what lies above it is time spent on
element-wise work, small products, Python and waiting.

Results loaded from a store (:class:`arithlib.run.stored.Store`) cost this run neither
time nor arithmetic; the seconds and GFLOP they took when computed are shown beside
(``reused_s``, ``reused_gflop``), so a run resumed over several sessions still shows what
its sections cost.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING

import pandas as pd
import torch

from ..engine import counted_flops, counting

if TYPE_CHECKING:
    from .runs import Run
    from .stored import Store

#: The columns of a notebook's ``NN_timings.csv``.
TIMING_COLUMNS = [
    "section",
    "wall_s",
    "cpu_s",
    "reused_s",
    "gflop",
    "reused_gflop",
    "floor_s",
    "ratio_to_floor",
    "peak_gflop_s",
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(
    m: int, k: int, n: int, *, seconds: float = 0.25, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> float:
    """GFLOP/s of ``F.linear([m, k], [n, k])`` (2 m k n FLOPs a call) on ``device`` in
    ``dtype``, repeated for about ``seconds`` after one warm-up call (on a GPU in rounds of
    10 launches between synchronisations)."""
    dev = torch.device(device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(device=dev, dtype=dtype)
    w = torch.randn(n, k, generator=g).to(device=dev, dtype=dtype)
    per_round = 10 if dev.type == "cuda" else 1
    torch.nn.functional.linear(x, w)
    _sync(dev)
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(per_round):
            torch.nn.functional.linear(x, w)
        _sync(dev)
        reps += per_round
    return 2 * m * k * n * reps / (time.perf_counter() - t0) / 1e9


def matmul_peak(
    k: int,
    n: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    rows: Iterable[int] = (256, 1024, 4096),
    seconds: float = 0.25,
) -> dict:
    """The best :func:`matmul_rate` of a ``[k, n]`` weight over ``rows`` row counts, with
    what it was measured on: ``{"gflop_s", "rows", "shape", "dtype", "device", "threads"}``."""
    rates = {m: matmul_rate(m, k, n, seconds=seconds, dtype=dtype, device=device) for m in rows}
    best = max(rates, key=rates.__getitem__)
    return {
        "gflop_s": round(rates[best], 3),
        "rows": best,
        "shape": [k, n],
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "threads": torch.get_num_threads(),
    }


class Sections:
    """``with sections("2 knockout"): ...`` (or ``sections.lap("2 knockout")`` at the end of
    a section that spans cells) records the section's wall and CPU seconds, the FLOPs it
    dispatched, and what the results it loaded from ``stores`` took when they were
    computed; :meth:`table` is the notebook's ``NN_timings.csv`` (:data:`TIMING_COLUMNS`).
    Counting runs from construction to :meth:`close` (or :meth:`table`)."""

    def __init__(
        self,
        stores: Iterable[Store] = (),
        peak_gflop_s: float | None = None,
        remeasure: Callable[[], float] | None = None,
    ) -> None:
        self.stores = list(stores)
        self.peak_gflop_s = peak_gflop_s
        # the peak measured again when the table is made; the floor takes the higher of the
        # two (a peak is an upper bound: a measurement made while another job held the
        # memory bus reads low, and sections then ran faster than their "peak")
        self._remeasure = remeasure
        self.rows: list[dict] = []
        self.started = time.perf_counter()
        # one counter from here to close(): a section is the difference of two readings
        self._counting: AbstractContextManager | None = counting()
        self._counting.__enter__()
        self._mark = self._reading()

    @classmethod
    def of_run(cls, run: Run, stores: Iterable[Store] = (), *, seconds: float = 0.25) -> Sections:
        """Sections of a notebook run, with the peak measured now on the run's device and
        dtype at its model's MLP shape and again when the table is made, both recorded in
        the run's environment (``matmul_peak`` and ``matmul_peak_end`` in
        ``<notebook>_params.json``); the floor takes the higher."""
        info, model = run.model.info, run.model

        def measure() -> dict:
            return matmul_peak(info.d_model, info.d_mlp, dtype=model.dtype, device=model.device, seconds=seconds)

        def at_end() -> float:
            end = measure()
            run.params.setdefault("environment", {})["matmul_peak_end"] = end
            run.record()
            return end["gflop_s"]

        peak = measure()
        run.params.setdefault("environment", {})["matmul_peak"] = peak
        run.record()
        return cls(stores, peak["gflop_s"], remeasure=at_end)

    def _reading(self) -> dict[str, float]:
        return {
            "wall_s": time.perf_counter(),
            "cpu_s": time.process_time(),
            "reused_s": sum(s.reused_seconds for s in self.stores),
            "gflop": (counted_flops() or 0) / 1e9,
            "reused_gflop": sum(s.reused_gflop for s in self.stores),
        }

    def lap(self, section: str) -> None:
        """Record everything since the last section ended (or the start) as ``section``
        (a notebook's section that spans several cells ends with a cell of its own)."""
        now = self._reading()
        row = self.add(section, **{k: now[k] - self._mark[k] for k in now})
        self._mark = now
        ratio = row["ratio_to_floor"]
        print(
            f"[{section}] {row['wall_s']:.1f} s wall, {row['cpu_s']:.1f} s CPU, {row['gflop']:.1f} GFLOP"
            + (f" ({ratio:.1f}x its floor)" if not math.isnan(ratio) else "")
            + (f" (+ {row['reused_s']:.0f} s of stored results computed earlier)" if row["reused_s"] else "")
        )

    def start(self) -> None:
        """Start the next section here (what ran since the last one ended is left out)."""
        self._mark = self._reading()

    @contextmanager
    def __call__(self, section: str) -> Iterator[None]:
        """The block as ``section`` (what ran since the last section ended is left out)."""
        self.start()
        yield
        self.lap(section)

    def close(self) -> None:
        """Stop counting (:meth:`table` does it too)."""
        if self._counting is not None:
            self._counting.__exit__(None, None, None)
            self._counting = None

    def add(self, section: str, **measured: float) -> dict:
        """Append a row measured elsewhere (its floor and ratio computed here)."""
        row = self._row(section, **measured)
        self.rows.append(row)
        return row

    def _row(
        self,
        section: str,
        *,
        wall_s: float,
        cpu_s: float = math.nan,
        reused_s: float = 0.0,
        gflop: float = 0.0,
        reused_gflop: float = 0.0,
    ) -> dict:
        floor = gflop / self.peak_gflop_s if self.peak_gflop_s and gflop > 0 else math.nan
        return {
            "section": section,
            "wall_s": wall_s,
            "cpu_s": cpu_s,
            "reused_s": reused_s,
            "gflop": gflop,
            "reused_gflop": reused_gflop,
            "floor_s": floor,
            "ratio_to_floor": wall_s / floor if floor > 0 else math.nan,
            "peak_gflop_s": self.peak_gflop_s if self.peak_gflop_s is not None else math.nan,
        }

    def wall(self, section: str) -> float:
        """The wall seconds of ``section`` (the last row of that name)."""
        return next(r["wall_s"] for r in reversed(self.rows) if r["section"] == section)

    def table(self, total_wall_s: float | None = None) -> pd.DataFrame:
        """The rows, then a ``total`` row: ``total_wall_s`` (default: since the sections
        started) against the floor of every section's arithmetic together; counting stops.
        With ``remeasure`` (a run's sections), the peak is measured once more first and
        every floor taken against the higher of the two measurements."""
        self.close()
        if self._remeasure is not None:
            end, self._remeasure = self._remeasure(), None
            if self.peak_gflop_s is None or end > self.peak_gflop_s:
                self.peak_gflop_s = end
                self.rows = [
                    self._row(
                        r["section"], **{k: r[k] for k in ("wall_s", "cpu_s", "reused_s", "gflop", "reused_gflop")}
                    )
                    for r in self.rows
                ]
        body = [r for r in self.rows if r["section"] != "total"]
        total = self._row(
            "total",
            wall_s=total_wall_s if total_wall_s is not None else time.perf_counter() - self.started,
            reused_s=sum(r["reused_s"] for r in body),
            gflop=sum(r["gflop"] for r in body),
            reused_gflop=sum(r["reused_gflop"] for r in body),
        )
        frame = pd.DataFrame([*body, total], columns=TIMING_COLUMNS)
        digits = {"wall_s": 3, "cpu_s": 3, "reused_s": 3, "gflop": 6, "reused_gflop": 6, "floor_s": 6}
        return frame.round({**digits, "ratio_to_floor": 3})
