"""Linear probes of the residual stream at the answer position, layer by layer: is an
operand, the result or its last digit linearly readable (the probing side of Nikankin et
al. 2025, beside Zhang et al. 2024's MLP analysis, Sec. 5.2)?

* :func:`probe_labels`: the targets of each prompt (:data:`PROBE_TARGETS`) and its
  operand-pair group;
* :func:`grouped_split`: a train/test split with each operand pair on one side only;
* :func:`linear_probes`: per-layer scikit-learn probes, each scored on the held-out rows
  against the same probe trained on shuffled labels; :func:`best_layers` picks each
  target's best layer.

The activations are those of :func:`arithlib.zhang.answer_cache.cache_answer_position`
(or the logit lens's stack, :func:`arithlib.zhang.lens.lens_stack`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..core.prompt_sets import PromptSet

#: Probe targets: record field -> (kind, description). "regression" is scored by
#: held-out R^2, "classification" by held-out accuracy.
PROBE_TARGETS: dict[str, tuple[str, str]] = {
    "a": ("regression", "operand A (value)"),
    "b": ("regression", "operand B (value)"),
    "result": ("regression", "result C (value)"),
    "result_last_digit": ("classification", "last digit of C"),
    "a_last_digit": ("classification", "last digit of A"),
    "b_last_digit": ("classification", "last digit of B"),
}


def probe_labels(
    prompts: PromptSet, targets: Sequence[str] = ("a", "b", "result", "result_last_digit")
) -> pd.DataFrame:
    """One row per prompt with the label of each probe target (:data:`PROBE_TARGETS`)
    and a ``group`` column (operator and operand pair) for the grouped split."""
    bad = [t for t in targets if t not in PROBE_TARGETS]
    if bad:
        raise ValueError(f"unknown probe target(s) {bad}; choose from {list(PROBE_TARGETS)}")
    cols = {"a": [], "b": [], "result": [], "result_last_digit": [], "a_last_digit": [], "b_last_digit": []}
    for r in prompts.records:
        cols["a"].append(r.a)
        cols["b"].append(r.b)
        cols["result"].append(r.answer)
        cols["result_last_digit"].append(abs(r.answer) % 10)
        cols["a_last_digit"].append(abs(r.a) % 10)
        cols["b_last_digit"].append(abs(r.b) % 10)
    frame = pd.DataFrame({t: cols[t] for t in targets})
    frame["group"] = [f"{r.op}|{r.a}|{r.b}" for r in prompts.records]
    return frame


def grouped_split(groups: Sequence, test_frac: float = 0.25, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Train and test row indices with every group wholly on one side (scikit-learn's
    GroupShuffleSplit): a prompt's operand pair never appears in both, so a probe
    cannot pass by remembering pairs seen in another template."""
    from sklearn.model_selection import GroupShuffleSplit

    if not 0 < test_frac < 1:
        raise ValueError("test_frac must be in (0, 1)")
    groups = np.asarray(groups)
    if len(np.unique(groups)) < 2:
        raise ValueError("a grouped split needs at least two distinct groups")
    split = GroupShuffleSplit(n_splits=1, test_size=test_frac, random_state=seed)
    train, test = next(split.split(np.zeros(len(groups)), groups=groups))
    return train, test


def _fit_score(kind: str, x_tr: np.ndarray, y_tr: np.ndarray, x_te: np.ndarray, y_te: np.ndarray) -> float:
    """Held-out R^2 (ridge, alpha chosen by efficient leave-one-out CV on the training
    rows) or accuracy (multinomial logistic regression), on standardised features."""
    from sklearn.linear_model import LogisticRegression, RidgeCV
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if kind == "regression":
        model = make_pipeline(StandardScaler(), RidgeCV(alphas=np.logspace(-1, 5, 13)))
    else:
        if len(np.unique(y_tr)) < 2:
            return float(np.mean(y_te == y_tr[0]))
        model = make_pipeline(StandardScaler(), LogisticRegression(C=0.1, max_iter=300))
    model.fit(x_tr, y_tr)
    return float(model.score(x_te, y_te))


def linear_probes(
    acts: torch.Tensor,
    labels: pd.DataFrame,
    targets: Sequence[str] | None = None,
    test_frac: float = 0.25,
    seed: int = 0,
    layers: Sequence[int] | None = None,
    layer_labels: Sequence[int] | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """Per-layer linear probes on answer-position activations ``acts`` [N, L, d].

    For each target of ``labels`` (:func:`probe_labels`) and each layer: a probe
    trained on the training rows of a split grouped by operand pair
    (:func:`grouped_split`) is scored on the held-out rows (R^2 for values, accuracy
    for digits); the same probe trained on randomly permuted training labels gives
    the ``baseline``. Uses scikit-learn (RidgeCV; LogisticRegression with C=0.1):
    TransformerLens's ``tools.analysis.sparse_probing`` fits k-sparse *binary*
    probes, while these targets are multi-class digits and real values.

    ``layers`` picks indices of the second axis of ``acts`` (default all);
    ``layer_labels[i]`` names index i in the output (default i; e.g. -1 for the embedding
    of :func:`arithlib.zhang.lens.lens_stack`). Returns columns
    ``target, kind, metric, layer, score, baseline, n_train, n_test``.
    """
    from sklearn.exceptions import ConvergenceWarning
    from threadpoolctl import threadpool_limits

    if acts.ndim != 3 or acts.shape[0] != len(labels):
        raise ValueError(f"acts must be [N, L, d] with N = len(labels) = {len(labels)}; got {tuple(acts.shape)}")
    targets = [t for t in labels.columns if t in PROBE_TARGETS] if targets is None else list(targets)
    if not targets:
        raise ValueError("no probe target columns in labels")
    train, test = grouped_split(labels["group"].to_numpy(), test_frac, seed)
    rng = np.random.default_rng(seed)
    x = acts.float().numpy()
    layers = list(range(acts.shape[1])) if layers is None else list(layers)
    if layer_labels is not None and len(layer_labels) != acts.shape[1]:
        raise ValueError(f"layer_labels has {len(layer_labels)} entries for {acts.shape[1]} layers")
    names = list(range(acts.shape[1])) if layer_labels is None else list(layer_labels)
    rows = []
    jobs = [(t, layer) for t in targets for layer in layers]
    # one BLAS thread: these fits are small, and multi-threaded BLAS on a shared CPU
    # is ten times slower than one thread (measured on 2 busy cores)
    with warnings.catch_warnings(), threadpool_limits(1):
        warnings.simplefilter("ignore", ConvergenceWarning)
        for target, layer in tqdm(jobs, desc="probes", disable=not progress, leave=False):
            kind = PROBE_TARGETS[target][0]
            y = labels[target].to_numpy()
            xl = x[:, layer]
            score = _fit_score(kind, xl[train], y[train], xl[test], y[test])
            shuffled = rng.permutation(y[train])
            base = _fit_score(kind, xl[train], shuffled, xl[test], y[test])
            rows.append(
                {
                    "target": target,
                    "kind": kind,
                    "metric": "R2" if kind == "regression" else "accuracy",
                    "layer": names[layer],
                    "score": score,
                    "baseline": base,
                    "n_train": len(train),
                    "n_test": len(test),
                }
            )
    return pd.DataFrame(rows)


def best_layers(probes: pd.DataFrame) -> pd.DataFrame:
    """Per target, the layer with the highest held-out score, its score and baseline."""
    idx = probes.groupby("target")["score"].idxmax()
    return probes.loc[idx, ["target", "metric", "layer", "score", "baseline", "n_train", "n_test"]].reset_index(
        drop=True
    )
