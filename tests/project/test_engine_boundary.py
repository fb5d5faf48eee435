"""The engine is the only code that touches the internals of transformers and
TransformerLens: key/value caches, causal masks, rotary embeddings, decoder
blocks called on their own, forward arguments such as ``logits_to_keep``, and the HF
model's or the bridge's private attributes; nor does any build, copy, crop or keep a
key/value cache through the engine's cache-level helpers. Every method runs its passes through
``arithlib.engine``; this test fails when a module outside it reaches past the engine.

The modules that own a model rather than run a method on one are listed: ``core/models.py``
(loading, with the adapter's cache fixes), ``core/devices.py`` (the placement a load
checks, with the adapter's device names), ``core/toy.py`` (the toy model's own training
loop) and ``core/toy_eval.py`` (its evaluation, on the HF model as trained)."""

from __future__ import annotations

import re
from pathlib import Path

import arithlib

ROOT = Path(arithlib.__file__).parent

#: Model owners: they build or train a model, so they call it directly.
OWNERS = {"core/models.py", "core/devices.py", "core/toy.py", "core/toy_eval.py"}

INTERNALS = [
    r"logits_to_keep",
    r"past_key_values",
    r"\bDynamicCache\b",
    r"\buse_cache\s*=\s*(True|False|past|copies)",
    r"rotary_emb",
    r"causal_mask",
    r"\brun_block\b",
    r"\bcache_kwargs\b",
    r"\boutput_cache\b",
    r"\bnew_cache\b",
    r"\.base_model\b",
    r"get_decoder\(",
    r"\boriginal_model\b",
    r"_original_component",
    r"register_forward_(pre_)?hook",
    r"hf_compat",
    r"engine\.adapter",
    r"from \.adapter",
    r"\.layers\[",
]

#: Key/value caches are the engine's: no method builds, copies, crops or keeps one (the
#: engine's runs hand back logits, hidden states and recorded runs instead).
CACHES = [
    r"\bkeep_cache\b",
    r"\b(cache_layers|filled_cache_layers|empty_cache|prefix_cache|repeat_cache|repeat_rows_)\b",
    r"\b(select_cache_rows|truncate_cache|decoder_pass|run_blocks|run_decoder)\b",
    r"engine\.(passes|prefix|answer|recorded)\b",
]


def _code(path: Path) -> str:
    """The module's source without docstrings and comments (they may name internals)."""
    import ast
    import io
    import tokenize

    text = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(getattr(body[0], "value", None), ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            docstrings.add(body[0].lineno)
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            continue
        if tok.type == tokenize.STRING and tok.start[0] in docstrings:
            continue
        out.append(tok.string)
    return " ".join(out)


def offenders() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "engine" or str(rel) in OWNERS:
            continue
        code = _code(path)
        hits = [p for p in INTERNALS + CACHES if re.search(p, code)]
        if hits:
            found[str(rel)] = hits
    return found


def test_no_module_outside_the_engine_touches_library_internals():
    assert offenders() == {}, f"modules reaching past arithlib.engine (move the pass into the engine): {offenders()}"


def test_the_check_sees_an_offender(tmp_path):
    """The scan is not vacuous: a module that builds a cache by hand is reported."""
    bad = tmp_path / "arithlib"
    (bad / "engine").mkdir(parents=True)
    (bad / "method.py").write_text(
        '"""uses logits_to_keep in a docstring only"""\n'
        "def f(hf, x):\n    return hf(x, use_cache=True, logits_to_keep=1)\n"
    )
    (bad / "kv.py").write_text(
        "from .engine import forward\ndef h(model, x):\n    return forward(model, x, keep_cache=True).cache\n"
    )
    (bad / "clean.py").write_text(
        '"""names past_key_values in a docstring"""\n# and rotary_emb in a comment\n'
        "def g(model, x):\n    return model(x)\n"
    )
    globals()["ROOT"], old = bad, ROOT
    try:
        assert set(offenders()) == {"method.py", "kv.py"}
    finally:
        globals()["ROOT"] = old
