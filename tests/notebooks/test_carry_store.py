"""scripts/carry_store.py: a model's stored results go from one machine's cache to a
committed folder and back, so that a run longer than a working session resumes on the next
machine; what it carries and what it leaves behind."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from arithlib.run.stored import Store

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("carry_store", ROOT / "scripts" / "carry_store.py")
cs = importlib.util.module_from_spec(spec)
sys.modules["carry_store"] = cs
spec.loader.exec_module(cs)

MODEL = "some/model"


def _fill(cache: Path) -> None:
    """A cache with a section, a head-sweep batch, a small and a large finished fine-tuned
    model, one still training, and another model's section."""
    slug = cs.model_slug(MODEL)
    Store(cache / "sections" / slug)("a section", lambda: {"x": 1}, code=["core.stats"], n=3)
    Store(cache / "sections" / slug)("a large section", lambda: b"x" * 2 * 2**20, code=["core.stats"], n=3)
    (cache / "head_sweep" / slug / "sub").mkdir(parents=True)
    (cache / "head_sweep" / slug / "sub" / "batch-1.pkl").write_bytes(b"b1")
    ft = cache / "finetune" / slug
    for name, size in (("small", 10), ("large", 3 * 2**20)):
        (ft / name / "checkpoints").mkdir(parents=True)
        (ft / name / "result.pt").write_bytes(b"r" * size)
        (ft / name / "key.json").write_text("{}")
        (ft / name / "checkpoints" / "epoch-001.pt").write_bytes(b"c")
    (ft / "training" / "checkpoints").mkdir(parents=True)
    (ft / "training" / "checkpoints" / "epoch-001.pt").write_bytes(b"c")
    (cache / "sections" / "other").mkdir(parents=True)
    (cache / "sections" / "other" / "x.pkl").write_bytes(b"o")


def test_save_carries_the_stores_and_small_finished_models_only(tmp_path):
    cache, dest = tmp_path / "cache", tmp_path / "figures" / "stored"
    _fill(cache)
    r = cs.save(MODEL, cache, dest, max_bytes=2**20)
    got = sorted(str(e.rel) for e in cs.carried_entries(dest))
    folder = cache / "sections" / cs.model_slug(MODEL)
    sections = ["sections/" + p.name for p in folder.glob("a-section-*")]
    assert len(sections) == 2  # the result and its seconds
    assert got == sorted(
        ["finetune/small/key.json", "finetune/small/result.pt", "head_sweep/sub/batch-1.pkl"] + sections
    )
    large = [str(p.relative_to(cache)) for p in folder.glob("a-large-section-*.pkl")]
    assert len(large) == 1  # left behind with its seconds file
    assert sorted(r["left_behind"]) == sorted(large + [str(Path("finetune") / cs.model_slug(MODEL) / "large")])
    assert (dest / "README.md").is_file() and MODEL in (dest / "README.md").read_text()
    assert r["copied"] == r["files"] == len(got) and r["removed"] == 0
    again = cs.save(MODEL, cache, dest, max_bytes=2**20)
    assert again["copied"] == 0  # unchanged files are not rewritten


def test_a_restored_result_is_loaded_not_recomputed_on_a_new_machine(tmp_path):
    old, new, dest = tmp_path / "old", tmp_path / "new", tmp_path / "stored"
    value = {"t": torch.arange(3), "s": "ok"}
    Store(old / "sections" / cs.model_slug(MODEL))("section", lambda: value, code=["core.stats"], k=1)
    cs.save(MODEL, old, dest, max_bytes=2**20)
    assert cs.restore(MODEL, new, dest) == 2  # the result and its seconds
    store = Store(new / "sections" / cs.model_slug(MODEL))

    def recompute():
        raise AssertionError("the carried result was not used")

    got = store("section", recompute, code=["core.stats"], k=1)
    assert torch.equal(got["t"], value["t"]) and got["s"] == "ok"
    assert store.reused_seconds >= 0
    assert cs.restore(MODEL, new, dest) == 0  # present files are left alone


def test_save_is_a_mirror_and_an_empty_cache_removes_the_folder(tmp_path):
    cache, dest = tmp_path / "cache", tmp_path / "stored"
    _fill(cache)
    cs.save(MODEL, cache, dest, max_bytes=2**20)
    (cache / "head_sweep" / cs.model_slug(MODEL) / "sub" / "batch-1.pkl").unlink()
    r = cs.save(MODEL, cache, dest, max_bytes=2**20)
    assert r["removed"] == 1 and not (dest / "head_sweep").exists()
    for p in sorted(cache.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    cs.save(MODEL, cache, dest, max_bytes=2**20)
    assert not dest.exists()


def test_status_and_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("ARITHLIB_CACHE", str(tmp_path / "cache"))
    _fill(tmp_path / "cache")
    dest = tmp_path / "stored"
    assert cs.main(["save", MODEL, "--dir", str(dest), "--max-mib", "1"]) == 0
    out = capsys.readouterr().out
    assert "left behind" in out and "large" in out
    assert cs.main(["status", MODEL, "--dir", str(dest)]) == 0
    assert "carried: 5 files" in capsys.readouterr().out
    assert cs.main(["drop", MODEL, "--dir", str(dest)]) == 0 and not dest.exists()


def test_every_store_folder_the_notebooks_use_is_carried():
    """A notebook that stores results in a new cache folder must be carried too."""
    import re

    used = {
        m
        for nb in (ROOT / "notebooks").glob("[0-9][0-9]_*.py")
        for m in re.findall(r'cache_root\(\) / "(\w+)"', nb.read_text())
    }
    assert used, "no notebook stores results under cache_root()?"
    assert used <= set(cs.STORES) | {cs.FINETUNE}, used - set(cs.STORES) - {cs.FINETUNE}


def test_finished_notebooks_run_records_go_to_the_next_machine(tmp_path):
    """A finished notebook's key, seconds and peak memory are carried (so the next run
    skips it while its key holds); a notebook without a key (still running) is not, and
    a record already on the new machine is left alone."""
    old_out, new_out, dest = tmp_path / "old" / "m", tmp_path / "new" / "m", tmp_path / "stored"
    old_out.mkdir(parents=True)
    for suffix, text in ((".key", "abc\n"), (".seconds", "120\n"), (".peak_mib", "900\n")):
        (old_out / f"01_heads{suffix}").write_text(text)
    (old_out / "05_lora.seconds").write_text("7\n")  # no key: did not finish
    (old_out / "05_lora.log").write_text("log")
    assert cs.save_finished(old_out, dest) == 3
    assert sorted(p.name for p in (dest / cs.FINISHED).iterdir()) == [
        "01_heads.key",
        "01_heads.peak_mib",
        "01_heads.seconds",
    ]
    assert cs.carried_entries(dest) == []  # not cache files: restore does not put them in the cache
    new_out.mkdir(parents=True)
    (new_out / "01_heads.peak_mib").write_text("1\n")
    assert cs.restore_finished(dest, new_out) == 2
    assert (new_out / "01_heads.key").read_text() == "abc\n" and (new_out / "01_heads.peak_mib").read_text() == "1\n"
    (old_out / "01_heads.key").unlink()  # a mirror: what no longer finished is dropped
    assert cs.save_finished(old_out, dest) == 0 and not any((dest / cs.FINISHED).glob("*"))


def test_save_and_restore_through_the_command_line(tmp_path, monkeypatch):
    cache, outputs, dest = tmp_path / "cache", tmp_path / "outputs", tmp_path / "stored"
    monkeypatch.setenv("ARITHLIB_CACHE", str(cache))
    Store(cache / "sections" / cs.model_slug(MODEL))("s", lambda: 1, code=["core.stats"], n=1)
    run_out = outputs / cs.model_slug(MODEL)
    run_out.mkdir(parents=True)
    (run_out / "00_acc.key").write_text("k\n")
    assert cs.main(["save", MODEL, "--dir", str(dest), "--outputs", str(outputs)]) == 0
    assert (dest / cs.FINISHED / "00_acc.key").is_file() and (dest / "README.md").is_file()
    (run_out / "00_acc.key").unlink()
    assert cs.main(["restore", MODEL, "--dir", str(dest), "--outputs", str(outputs)]) == 0
    assert (run_out / "00_acc.key").read_text() == "k\n"


def test_finished_notebooks_outputs_are_packed_and_unpacked_with_figures(tmp_path):
    """With --figures, a finished notebook's outputs (its NN_* files and executed copy) go
    with its record, and replace older outputs of that notebook on the next machine."""
    outputs, fig, dest = tmp_path / "out", tmp_path / "fig", tmp_path / "stored"
    run_out, model_fig = outputs / cs.model_slug(MODEL), fig / cs.model_slug(MODEL)
    (model_fig / "notebooks").mkdir(parents=True)
    run_out.mkdir(parents=True)
    (run_out / "01_heads.key").write_text("k\n")
    (model_fig / "01_table.csv").write_text("new\n")
    (model_fig / "notebooks" / "01_heads.ipynb").write_text("{}")
    (model_fig / "03_other.csv").write_text("not finished\n")
    args = ["--dir", str(dest), "--outputs", str(outputs), "--figures", str(fig)]
    assert cs.main(["save", MODEL, *args]) == 0
    assert (dest / cs.FINISHED / "01_heads.tar.gz").is_file()
    new_outputs, new_fig = tmp_path / "new_out", tmp_path / "new_fig"
    (new_fig / cs.model_slug(MODEL)).mkdir(parents=True)
    (new_fig / cs.model_slug(MODEL) / "01_table.csv").write_text("old\n")
    args = ["--dir", str(dest), "--outputs", str(new_outputs), "--figures", str(new_fig)]
    assert cs.main(["restore", MODEL, *args]) == 0
    got = new_fig / cs.model_slug(MODEL)
    assert (got / "01_table.csv").read_text() == "new\n" and (got / "notebooks" / "01_heads.ipynb").is_file()
    assert not (got / "03_other.csv").exists()
    assert (new_outputs / cs.model_slug(MODEL) / "01_heads.key").read_text() == "k\n"
