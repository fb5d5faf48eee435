"""arithlib.run.stored: a result is computed once per key and loaded after; the key moves
with the model's weights, the prompts (counterfactuals included), tensors, parameters
and the code of the modules named; a half-written file is never read back."""

from __future__ import annotations

import json
import logging
import pickle
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import arithlib.core.datasets as ds
from arithlib.core.prompt_sets import PromptSet
from arithlib.run.sources import code_fingerprint, module_closure
from arithlib.run.stored import Store, key_value
from arithlib.run.stored import dumps as stored_dumps


class Counter:
    def __init__(self):
        self.calls = 0

    def __call__(self, value=1):
        self.calls += 1
        return {"value": value, "tensor": torch.arange(3)}


def test_computed_once_per_key_and_loaded_after(tmp_path):
    store, f = Store(tmp_path), Counter()
    first = store("a section", f, code=["methods.patching"], n=3, means={0: torch.ones(2)})
    again = store("a section", f, code=["methods.patching"], n=3, means={0: torch.ones(2)})
    assert f.calls == 1 and again["value"] == first["value"] and torch.equal(again["tensor"], first["tensor"])
    store("a section", f, code=["methods.patching"], n=4, means={0: torch.ones(2)})  # a parameter
    store("a section", f, code=["methods.patching"], n=3, means={0: torch.full((2,), 2.0)})  # a tensor's values
    store("a section", f, code=["core.evaluate"], n=3, means={0: torch.ones(2)})  # other code
    store("another section", f, code=["methods.patching"], n=3, means={0: torch.ones(2)})
    assert f.calls == 5
    assert len(list(tmp_path.glob("*.pkl"))) == 5 and not list(tmp_path.glob("*.tmp"))


def test_a_view_of_a_larger_tensor_is_stored_as_its_own_elements(tmp_path):
    """Pickle writes a tensor's whole storage: 25 rows of a [25, 4000] tensor stored one
    per entry would hold the whole tensor 25 times. Stored, each row holds its own 4000
    floats, and loads back equal (strides, offsets and shared storages aside)."""
    big = torch.randn(25, 4000)
    rows = {f"row {i}": big[i] for i in range(25)}
    rows["column"] = big[:, 7]  # a strided view
    rows["whole"] = big
    store = Store(tmp_path)
    out = store("views", lambda: rows, code=["run.stored"])
    size = sum(p.stat().st_size for p in tmp_path.rglob("*.pkl"))
    assert size < 3 * big.numel() * 4  # the rows once, the whole once (not 26 times)
    again = Store(tmp_path)("views", lambda: None, code=["run.stored"])
    for name, t in rows.items():
        assert torch.equal(again[name], t) and torch.equal(out[name], t)
    grad = torch.ones(3, requires_grad=True)  # a leaf that needs grad pickles as before
    assert torch.equal(pickle.loads(stored_dumps({"g": grad}))["g"], grad)


def test_without_a_directory_nothing_is_stored():
    store, f = Store(None), Counter()
    store("x", f, code=[], n=1)
    store("x", f, code=[], n=1)
    assert f.calls == 2 and store.path("x", code=[], n=1) is None


def test_a_half_written_file_is_not_a_result(tmp_path):
    store, f = Store(tmp_path), Counter()
    path = store.path("x", code=[], n=1)
    path.with_name(path.name + ".tmp").write_bytes(b"half")  # a run stopped mid-write
    store("x", f, code=[], n=1)
    assert f.calls == 1 and path.is_file()


def _stored_once(tmp_path):
    store, f = Store(tmp_path), Counter()
    store("knockout at end", lambda: f(7), code=[], n=1)
    return store.path("knockout at end", code=[], n=1), f


def _again(tmp_path, caplog) -> tuple[dict, Counter]:
    f = Counter()
    with caplog.at_level(logging.WARNING, logger="arithlib.run.stored"):
        result = Store(tmp_path)("knockout at end", lambda: f(7), code=[], n=1)
    return result, f


def test_a_garbled_stored_result_is_reported_deleted_and_computed_again(tmp_path, caplog):
    """Bytes changed inside a stored section (the pickle still loads, with other numbers)
    are caught by the checksum: one warning naming the file, and the result is computed
    anew instead of loaded."""
    path, _ = _stored_once(tmp_path)
    data = bytearray(path.read_bytes())
    where = data.index(b"K\x07", data.index(b"value"))  # the stored value 7 (pickle's BININT1 7)
    data[where + 1] = 8  # now it unpickles as 8
    path.write_bytes(bytes(data))
    assert pickle.loads(path.read_bytes())["value"] == 8  # still a valid pickle: only the checksum can tell
    result, f = _again(tmp_path, caplog)
    assert f.calls == 1 and result["value"] == 7
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0] and "\n" not in warnings[0]
    assert "checksum" in warnings[0]
    assert Store(tmp_path)("knockout at end", Counter(), code=[], n=1)["value"] == 7  # stored anew, loaded


def test_a_truncated_stored_result_is_reported_deleted_and_computed_again(tmp_path, caplog):
    path, _ = _stored_once(tmp_path)
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    result, f = _again(tmp_path, caplog)
    assert f.calls == 1 and result["value"] == 7
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0]


def test_a_stored_result_that_cannot_be_unpickled_is_computed_again(tmp_path, caplog):
    """Even with a matching checksum (written by other code), a pickle that fails to load
    is discarded with a warning instead of stopping every rerun."""
    path, _ = _stored_once(tmp_path)
    from arithlib.run.stored import write_verified

    write_verified(path, b"not a pickle", seconds=1.0)
    result, f = _again(tmp_path, caplog)
    assert f.calls == 1 and result["value"] == 7
    assert any("cannot be unpickled" in r.getMessage() and str(path) in r.getMessage() for r in caplog.records)


def test_a_stored_result_without_a_checksum_is_computed_again(tmp_path, caplog):
    """A result stored before checksums were recorded (its sidecar holds only seconds) is
    not trusted: one warning, computed again."""
    path, _ = _stored_once(tmp_path)
    path.with_suffix(".json").write_text(json.dumps({"seconds": 1.0}))
    result, f = _again(tmp_path, caplog)
    assert f.calls == 1 and result["value"] == 7
    assert any("no recorded checksum" in r.getMessage() for r in caplog.records)


def test_temporary_files_have_names_of_their_own(tmp_path, monkeypatch):
    """Two writers of the same result never share a temporary file (each is unique,
    beside the result), and none is left behind."""
    from arithlib.run import atomic

    seen = []
    real = atomic.tempfile.mkstemp

    def mkstemp(**kw):
        fd, name = real(**kw)
        seen.append(name)
        return fd, name

    monkeypatch.setattr(atomic.tempfile, "mkstemp", mkstemp)
    path, _ = _stored_once(tmp_path)
    Store(tmp_path).at(path.with_name("other.pkl"), lambda: 1)
    assert len(seen) == len(set(seen)) == 4 and all(Path(n).parent == tmp_path for n in seen)
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*"))


@pytest.fixture(scope="module")
def toy():
    from arithlib.core.models import load_model

    return load_model("toy-arith")


def test_the_key_follows_the_model_weights_and_the_prompts(toy, digit_tokenizer):
    bridge = toy.bridge
    before = key_value(bridge)
    assert before["threads"] == torch.get_num_threads() and before["dtype"] == "torch.float32"
    ps = PromptSet.build(ds.zhang_prompts(["+"], (1, 3), 1, seed=0, fewshot=0), digit_tokenizer)
    other_cf = replace(ps, cf_input_ids=[list(reversed(c)) for c in ps.cf_input_ids])
    assert key_value(ps) != key_value(other_cf)  # same prompts, another X_c
    assert key_value(ps) == key_value(
        PromptSet.build(ds.zhang_prompts(["+"], (1, 3), 1, seed=0, fewshot=0), digit_tokenizer)
    )
    p = next(bridge.parameters())
    with torch.no_grad():
        p.view(-1)[0] += 1.0
    try:
        assert key_value(bridge) != before
    finally:
        with torch.no_grad():
            p.view(-1)[0] -= 1.0


def test_code_fingerprint_covers_the_modules_a_module_imports(tmp_path):
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("from .b import f\n")
    (tmp_path / "b.py").write_text("import arithlib.c\n")
    (tmp_path / "c.py").write_text("X = 1\n")
    (tmp_path / "d.py").write_text("Y = 1\n")
    assert module_closure(["a"], tmp_path) == {"__init__", "a", "b", "c"}
    k = code_fingerprint(["a"], tmp_path)
    (tmp_path / "d.py").write_text("Y = 2\n")  # not imported: same key
    assert code_fingerprint(["a"], tmp_path) == k
    (tmp_path / "c.py").write_text("X = 2\n")  # imported through b: new key
    assert code_fingerprint(["a"], tmp_path) != k


def test_code_fingerprint_covers_subpackages(tmp_path):
    """A module that imports from a subpackage (``from .engine import f``, ``from
    ..datasets import g`` inside it, ``arithlib.plots.heads``) depends on every module of
    it: an edit to ``engine/passes.py`` gives a new key (the old closure followed flat
    modules only, so edits to ``arithlib/engine``, ``plots`` or ``report`` kept old keys)."""
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("from .engine import f\n")
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "__init__.py").write_text("from .passes import f\n")
    (tmp_path / "engine" / "passes.py").write_text("from ..datasets import g\nf = 1\n")
    (tmp_path / "datasets.py").write_text("g = 1\n")
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "__init__.py").write_text("")
    (tmp_path / "plots" / "heads.py").write_text("X = 1\n")
    (tmp_path / "nb.py").write_text("import arithlib.plots.heads as plots\n")
    assert module_closure(["a"], tmp_path) == {"__init__", "a", "engine/__init__", "engine/passes", "datasets"}
    assert module_closure(["nb"], tmp_path) == {"__init__", "nb", "plots/__init__", "plots/heads"}
    assert module_closure(["engine.passes"], tmp_path) == {"__init__", "engine/__init__", "engine/passes", "datasets"}
    (tmp_path / "c.py").write_text('"""Unlike :func:`arithlib.plots.heads.X`, ..."""\n')  # a mention, no import
    assert module_closure(["c"], tmp_path) == {"__init__", "c"}
    k = code_fingerprint(["a"], tmp_path)
    (tmp_path / "engine" / "passes.py").write_text("from ..datasets import g\nf = 2\n")
    assert code_fingerprint(["a"], tmp_path) != k
    k = code_fingerprint(["a"], tmp_path)
    (tmp_path / "datasets.py").write_text("g = 2\n")  # imported by the subpackage with two dots
    assert code_fingerprint(["a"], tmp_path) != k


def test_a_subpackage_module_is_keyed_by_its_own_code():
    """``store(..., code=arithlib.engine.passes)``: the key holds that module's code (the old
    key took the last name part, "passes", found no such top-level file and hashed nothing)."""
    import importlib

    passes, heads = (importlib.import_module(m) for m in ("arithlib.engine.passes", "arithlib.plots.heads"))
    assert key_value(passes) == code_fingerprint(["engine/passes"]) != key_value(heads)
    assert "engine/passes" in module_closure(["engine/passes"]) and "engine/adapter" in module_closure(
        ["engine/passes"]
    )


def test_code_must_be_named(tmp_path):
    with pytest.raises(TypeError):
        Store(tmp_path)("x", Counter(), n=1)  # the code the result depends on is part of every key


def test_a_loaded_result_reports_the_seconds_it_took_when_computed(tmp_path):
    import time

    def slow():
        time.sleep(0.05)
        return 1

    first = Store(tmp_path)
    first("x", slow, code=[], n=1)
    assert first.reused_seconds == 0.0
    later = Store(tmp_path)  # a resumed run: a new store on the same folder
    assert later("x", slow, code=[], n=1) == 1
    assert later.reused_seconds >= 0.05
    later.path("x", code=[], n=1).with_suffix(".json").unlink()  # a result without its record: computed again
    again = Store(tmp_path)
    again("x", slow, code=[], n=1)
    assert again.reused_seconds == 0.0


def test_a_table_keys_by_its_values_and_columns():
    import pandas as pd

    frame = pd.DataFrame({"a": [1, 2], "b": [3.0, 4.0]})
    assert key_value(frame) == key_value(frame.copy())
    assert key_value(frame) != key_value(frame.assign(b=[3.0, 5.0]))
    assert key_value(frame) != key_value(frame.rename(columns={"b": "c"}))
    assert key_value(frame.a) != key_value(frame.a.rename("z"))


def test_a_code_name_that_names_no_module_is_refused():
    """A name that resolves to nothing (a module moved to a subpackage: ``"cna"`` for
    ``"yu.cna"``) would drop its code from the key: refused, naming the form expected."""
    with pytest.raises(ValueError, match="yu.cna"):
        code_fingerprint(["cna"])
    assert module_closure(["yu.cna"]) == module_closure(["yu/cna"]) and "yu/cna" in module_closure(["yu.cna"])
    import arithlib.yu.cna as cna

    assert key_value(cna) == code_fingerprint(["yu/cna"])
