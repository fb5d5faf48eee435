"""A model's identity is its weights: installed weight files are recorded at install and
checked on load (a changed file is refused with the command that reinstalls the model),
and the fingerprint that keys stored results covers every weight value."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from arithlib.core import models, random_models
from arithlib.run.fingerprints import model_fingerprint

PACKAGED = "qwen2.5-coder-0.5b"


@pytest.fixture
def tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ARITHLIB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _change_final_norm(folder: Path) -> None:
    """Change one value of the final norm in ``folder/model.safetensors`` (keeping the
    file's size, as a bit flip on disk would)."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    tensors["model.norm.weight"][0] += 0.5
    save_file(tensors, path, metadata={"format": "pt"})


def _installed_packaged_model(cache: Path) -> Path:
    """A packaged model's install folder (``models/<name>/hf``, marker written last),
    holding a small random model's files in place of the dequantized weights."""
    hf = cache / "models" / PACKAGED / "hf"
    shutil.copytree(random_models.random_model_dir("qwen2"), hf)
    (hf / "weights.json").unlink(missing_ok=True)  # as installed: recorded by the install below
    return hf


def test_a_weight_file_changed_after_install_is_refused_with_the_reinstall_command(tmp_cache):
    """One value changed in the installed ``hf/model.safetensors`` (the final norm): the
    model is refused on load, in one line naming the file and the command that
    reinstalls it, instead of computing (and caching) results with other weights."""
    hf = _installed_packaged_model(tmp_cache)
    assert models.model_dir(PACKAGED) == hf  # the first load records the weights it finds
    _change_final_norm(hf)
    with pytest.raises(RuntimeError, match="reinstall") as err:
        models.model_dir(PACKAGED)
    message = str(err.value)
    assert "\n" not in message and str(hf / "model.safetensors") in message
    assert f"python -m arithlib.core.install reinstall {PACKAGED}" in message
    with pytest.raises(RuntimeError, match="changed after the model was installed"):
        models.load_model(PACKAGED)
    from arithlib.core.install import check_installed

    with pytest.raises(RuntimeError, match="reinstall"):  # run_all.sh's check before any notebook starts
        check_installed(PACKAGED)


def test_an_untouched_model_passes_the_cheap_check_and_a_touched_one_the_full_hash(tmp_cache, monkeypatch):
    from arithlib.core import weights

    hf = _installed_packaged_model(tmp_cache)
    models.model_dir(PACKAGED)
    record = json.loads((hf / "weights.json").read_text())
    hashed = []
    real = weights.sha256_file
    monkeypatch.setattr(weights, "sha256_file", lambda p, *a: hashed.append(Path(p).name) or real(p, *a))
    models.model_dir(PACKAGED)
    assert hashed == []  # size and time unchanged: not read again
    st = (hf / "model.safetensors").stat()
    os.utime(hf / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # copied, same bytes
    models.model_dir(PACKAGED)
    assert hashed == ["model.safetensors"]
    after = json.loads((hf / "weights.json").read_text())
    assert after["model.safetensors"]["sha256"] == record["model.safetensors"]["sha256"]
    assert after["model.safetensors"]["mtime_ns"] == st.st_mtime_ns + 10**9  # noted: not hashed again
    models.model_dir(PACKAGED)
    assert hashed == ["model.safetensors"]


def test_a_random_model_changed_after_it_was_built_is_refused(tmp_cache):
    folder = random_models.random_model_dir("qwen2")
    assert (folder / "weights.json").is_file()  # recorded when built
    _change_final_norm(folder)
    with pytest.raises(RuntimeError, match="changed after the model was installed"):
        models.load_model(str(folder))


def test_the_fingerprint_covers_every_weight_value(tmp_cache):
    """Every value of every weight keys a stored result: a change far inside a tensor
    (beyond any sample), or one made without torch's version counter (``.data``, a fused
    optimizer step), gives another fingerprint; the same weights the same one."""
    bridge = models.load_model(str(random_models.random_model_dir("qwen2"))).bridge
    hf = models.hf_module(bridge)
    before = model_fingerprint(bridge)
    assert model_fingerprint(bridge) == before
    embed = hf.model.embed_tokens.weight
    last = embed.data.view(-1)[-1].item()
    embed.data.view(-1)[-1] = last + 1.0  # the last value of the embedding, through .data
    assert model_fingerprint(bridge) != before
    embed.data.view(-1)[-1] = last
    assert model_fingerprint(bridge) == before
    norm = hf.model.norm.weight
    norm.grad = torch.ones_like(norm)
    torch.optim.AdamW([norm], lr=0.1, fused=True).step()  # in place, torch's version counter untouched
    assert model_fingerprint(bridge) != before


def test_a_trained_toy_model_records_its_weights(tmp_cache, monkeypatch):
    from arithlib.core import toy, toy_data

    monkeypatch.setattr(toy, "toy_accuracy_table", lambda *args: {})  # the full evaluation is slow
    cfg = toy_data.ToyConfig(
        n_layers=1,
        d_model=16,
        n_heads=2,
        n_kv_heads=1,
        d_mlp=32,
        max_operand=9,
        max_mul_operand=4,
        steps=12,
        batch_size=4,
        shots=1,
    )
    for folder in toy.toy_checkpoint_dirs(cfg).values():
        record = json.loads((folder / "weights.json").read_text())
        assert set(record) == {"model.safetensors"}
