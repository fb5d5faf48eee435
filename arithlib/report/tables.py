"""Reading a figures folder: its tables (CSV, row-level ones gzipped) and params, and the verdict names."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd

from ..core.stats import INCONCLUSIVE, NOT_APPLICABLE, NOT_REPRODUCED, PARTLY, REPRODUCED, UNDECIDABLE
from ..run.outputs import find_table, read_table, table_file

NOT_RUN = "not run"
#: A finding measured at smoke-test sizes (a notebook's ``quick`` mode, or fine-tuning at
#: scale "quick"): its numbers are shown, but the rule is not applied to them.
NOT_JUDGED = "not judged"
#: A finding whose computation raised (a bug or a malformed table), kept apart from "not run".
ERROR = "error"
VERDICTS = (REPRODUCED, PARTLY, NOT_REPRODUCED, INCONCLUSIVE, UNDECIDABLE, NOT_APPLICABLE, NOT_RUN, NOT_JUDGED, ERROR)
#: Verdicts counted in a summary only where some finding has them.
_RARE_VERDICTS = (UNDECIDABLE, NOT_APPLICABLE, NOT_JUDGED, ERROR)

NOTEBOOKS: dict[str, str] = {
    "00": "Model accuracy",
    "01": "Key heads and MLPs (Zhang; Yu's head sweep; Nikankin's circuit)",
    "02": "MLP probing (Zhang Sec. 5.2)",
    "03": "Neuron heuristics (Nikankin)",
    "04": "Comparative neuron analysis (Yu Sec. 4)",
    "05": "LoRA mechanism (Yu Sec. 5)",
    "06": "Pruning (Yu Sec. 6.1)",
    "07": "Gender-bias editing (Yu Sec. 6.2)",
    "08": "Precise SFT of the key heads (Zhang Sec. 4.3, 5.3)",
    "09": "Number representations (Zhou; Kantamneni & Tegmark; Nikankin's neurons)",
}


# --------------------------------------------------------------------------- reading a figures folder


class NotRun(Exception):
    """A finding cannot be computed from this folder (the reason is the message)."""


class NotApplicable(Exception):
    """A premise the finding builds on failed on this model (the message names it and gives
    the numbers that show it): the verdict is *not applicable*, not *not reproduced*."""


class MissingTable(NotRun):
    """A table the finding needs is not in the folder."""


class Tables:
    """Read-only access to one figures folder: its CSV tables and the model info that
    every notebook's ``*_params.json`` carries."""

    def __init__(self, fig_dir: str | os.PathLike):
        self.dir = Path(fig_dir)
        self._cache: dict[str, pd.DataFrame] = {}
        self._params: dict[str, dict] | None = None

    def has(self, name: str) -> bool:
        return find_table(self.dir, name) is not None

    def csv(self, name: str) -> pd.DataFrame:
        """Table ``name`` (``<dir>/<name>.csv`` or ``.csv.gz``: :func:`arithlib.run.outputs.read_table`);
        raises :class:`MissingTable` when absent."""
        if name not in self._cache:
            if not self.has(name):
                raise MissingTable(f"{table_file(name)} missing")
            try:
                self._cache[name] = read_table(self.dir, name, keep_default_na=True)
            except pd.errors.EmptyDataError:
                self._cache[name] = pd.DataFrame()
        return self._cache[name].copy()

    def params(self) -> dict[str, dict]:
        """Notebook number -> its ``NN_*_params.json`` (empty when none); read once."""
        if self._params is None:
            self._params = {}
            for path in sorted(self.dir.glob("[0-9][0-9]_*_params.json")):
                try:
                    self._params[path.name[:2]] = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue
        return self._params

    def info(self) -> dict:
        """The model info (n_layers, n_heads, d_mlp, ...) of the first params file."""
        for p in self.params().values():
            if isinstance(p.get("model_info"), dict):
                return p["model_info"]
        return {}

    def model(self) -> str:
        for p in self.params().values():
            if p.get("model"):
                return str(p["model"])
        return self.dir.name

    def n_layers(self, fallback: pd.Series | None = None) -> int:
        """Number of layers from the params, else 1 + the largest layer in ``fallback``."""
        n = self.info().get("n_layers")
        if n:
            return int(n)
        if fallback is not None and len(fallback):
            return int(pd.to_numeric(fallback).max()) + 1
        raise NotRun("number of layers unknown (no params json)")
