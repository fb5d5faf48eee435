"""Tests of arithlib.core.toy: tokenizer, data, a tiny deterministic training run, the shipped
weights of the default model (checksums, install, refusal of a changed file), the
default model's accuracy, and (slow) that training it again reproduces the shipped
accuracies."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import arithlib.core.toy as toy
import arithlib.core.toy_data as toy_data
import arithlib.core.toy_eval as toy_eval
from arithlib.core.toy import (
    checkpoint_steps,
    toy_checkpoint_dir,
    toy_checkpoint_dirs,
    toy_model_dir,
    toy_run_dir,
    train_toy,
)
from arithlib.core.toy_data import (
    TOY_TEMPLATES,
    TOY_WORDS,
    ToyConfig,
    build_tokenizer,
    make_training_examples,
    split_pairs,
)
from arithlib.core.toy_eval import toy_accuracy
from arithlib.run.paths import DATA_DIR

TINY = ToyConfig(
    n_layers=1,
    d_model=32,
    n_heads=2,
    n_kv_heads=1,
    d_mlp=64,
    max_operand=19,
    max_mul_operand=9,
    steps=30,
    batch_size=8,
    shots=2,
)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _ids(tok, text: str, special: bool = False) -> list[int]:
    return tok(text, add_special_tokens=special)["input_ids"]


# --------------------------------------------------------------------------- tokenizer


def test_every_integer_to_999_is_one_token(tok):
    ids = [_ids(tok, str(n)) for n in range(1000)]
    assert all(len(i) == 1 for i in ids)
    assert len({i[0] for i in ids}) == 1000
    assert tok.unk_token_id not in {i[0] for i in ids}
    assert tok.decode(ids[537]) == "537"


def test_spaces_do_not_change_tokens(tok):
    assert _ids(tok, "3+5=") == _ids(tok, "3 + 5 =") == _ids(tok, " 3 +5 = ")
    assert [tok.convert_ids_to_tokens(i) for i in _ids(tok, "3+5=")] == ["3", "+", "5", "="]
    assert _ids(tok, "12-57=-45") == _ids(tok, "12 - 57 = - 45")
    assert len(_ids(tok, "12-57=-45")) == 6


def test_bos_is_prepended_once(tok):
    ids = _ids(tok, "3+5=", special=True)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids[1:] == _ids(tok, "3+5=")


def test_large_integers_are_unknown(tok):
    for text in ("1000", "12345", "007"):
        assert _ids(tok, text) == [tok.unk_token_id]
    assert _ids(tok, "1000+5=")[1:] == _ids(tok, "1+5=")[1:]


def _template_texts() -> list[str]:
    texts = [t for ts in TOY_TEMPLATES.values() for t in ts]
    data = json.loads((DATA_DIR / "templates.json").read_text())
    for section in ("zhang", "yu", "zhang_power", "nikankin"):
        for key, val in data.get(section, {}).items():
            if isinstance(val, list):
                texts += [re.sub(r"\[(.*?)\]", r"\1", t) for t in val]
    cf = data.get("zhang_counterfactual", {})
    texts += [" ".join(cf.get("words", [])), " ".join(cf.get("symbols", []))]
    return texts


def test_template_words_are_known(tok):
    words = json.loads((DATA_DIR / "number_words.json").read_text())
    number_words = [w for w in words["units"] + words["tens"] if w] + [words["hundred"]]
    texts = _template_texts() + [" ".join(number_words), " ".join(TOY_WORDS)]
    for text in texts:
        for variant in (text, text[:1].upper() + text[1:]):
            ids = _ids(tok, variant.format(A=23, B=7) + " 30\n")
            assert tok.unk_token_id not in ids, (variant, tok.convert_ids_to_tokens(ids))


def test_decode_is_readable(tok):
    for text in ("3+4=7\n8+1=9\n3-5=-2", "Q: What is the sum of 3 and 5? A: 8", "The difference between 9 and 4 is 5"):
        assert tok.decode(_ids(tok, text, special=True), skip_special_tokens=True) == text
    assert tok.decode(_ids(tok, "3 + 5 = 8")) == "3+5=8"


def test_tokenizer_round_trips_through_save(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in ("3+4=7\n8+1=9\n3-5=", "Q: What is 3 plus 5? A:"):
        assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.decode(loaded("3+5=8")["input_ids"], skip_special_tokens=True) == "3+5=8"


# --------------------------------------------------------------------------- data


def test_training_examples_are_deterministic_and_split_disjoint():
    cfg = ToyConfig()
    train, held = make_training_examples(cfg)
    assert (train, held) == make_training_examples(ToyConfig())
    assert not set(train) & set(held)
    assert "3+5=8" in train + held and "3-5=-2" in train + held and "12/4=3" in train + held
    assert make_training_examples(ToyConfig(seed=1))[1] != held
    split = split_pairs(cfg)
    for op, (tr, he) in split.items():
        assert not set(tr) & set(he)
        assert len(he) == round(0.1 * (len(tr) + len(he)))
    assert len(split["+"][0]) + len(split["+"][1]) == 100 * 100
    assert all(a % b == 0 for a, b in split["/"][0] + split["/"][1])


def test_training_batches_are_packed_few_shot_sequences(tok):
    cfg = ToyConfig(max_operand=19, max_mul_operand=9, batch_size=4, shots=3, template_frac=0.5)
    enc = toy_data._encode_examples(cfg, tok)
    ids, mask = toy_data._batch(cfg, enc, 7, tok.pad_token_id, tok.bos_token_id)
    assert torch.equal(ids, toy_data._batch(cfg, enc, 7, tok.pad_token_id, tok.bos_token_id)[0])
    assert (ids[:, 0] == tok.bos_token_id).all() and tok.unk_token_id not in ids
    newline = tok.convert_tokens_to_ids("\n")
    for row, m in zip(ids, mask):
        text = tok.decode(row, skip_special_tokens=True)
        lines = text.split("\n")
        assert len(lines) == 4 and lines[-1] == ""  # three examples, each ending in a newline
        assert m.sum() >= 2 * 3 and all(row[m][-1:] == newline)
        answers = tok.decode(row[m], skip_special_tokens=True).split("\n")[:-1]
        assert len(answers) == 3 and all(re.fullmatch(r"-?\d+", a) for a in answers)
    assert any(w in tok.decode(ids.flatten()) for w in ("plus", "minus", "times", "over", "sum", "ratio", "divides"))


def test_checkpoint_steps_are_log_spaced():
    assert checkpoint_steps(2000) == [0, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert checkpoint_steps(1500) == [0, 10, 20, 50, 100, 200, 500, 1000, 1500]
    assert checkpoint_steps(30) == [0, 10, 20, 30]


def test_config_key_is_stable_and_distinguishes():
    assert ToyConfig().key() == ToyConfig().key()
    assert ToyConfig(seed=1).key() != ToyConfig().key()
    assert re.fullmatch(r"[0-9a-f]{12}", ToyConfig().key())


# --------------------------------------------------------------------------- tiny training


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    return train_toy(TINY, tmp_path_factory.mktemp("tiny") / "run", progress=False, evaluate=False)


def test_tiny_run_writes_complete_checkpoints(tiny_run):
    run = tiny_run.parent
    assert (tiny_run / toy.COMPLETE_MARKER).exists()
    steps = sorted(int(p.name.split("-")[1]) for p in run.glob("step-*"))
    assert steps == [0, 10, 20]
    assert not list(run.glob(".tmp-*"))
    assert not list(run.rglob(toy.TRAINING_STATE))  # optimizer state is dropped when done
    for d in [*run.glob("step-*"), tiny_run]:
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            assert (d / name).exists(), d / name
    info = json.loads((tiny_run / toy.TOY_INFO).read_text())
    assert info["checkpoint_steps"] == [0, 10, 20, 30] and info["key"] == TINY.key()


def test_tiny_run_is_deterministic(tiny_run, tmp_path):
    again = train_toy(TINY, tmp_path / "run", progress=False, evaluate=False)
    for d in ("step-000000", "step-000020", "final"):
        a = load_file(tiny_run.parent / d / "model.safetensors")
        b = load_file(again.parent / d / "model.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    w0 = load_file(tiny_run.parent / "step-000000" / "model.safetensors")
    w1 = load_file(tiny_run / "model.safetensors")
    assert any(not torch.equal(w0[k], w1[k]) for k in w0)  # training moved the weights


def test_interrupted_run_resumes_to_the_same_weights(tiny_run, tmp_path, monkeypatch):
    real_batch = toy._batch

    def failing_batch(cfg, enc, step, *args):
        if step == 25:
            raise KeyboardInterrupt
        return real_batch(cfg, enc, step, *args)

    monkeypatch.setattr(toy, "_batch", failing_batch)
    with pytest.raises(KeyboardInterrupt):
        train_toy(TINY, tmp_path / "run", progress=False, evaluate=False)
    assert not (tmp_path / "run" / "final").exists()
    assert (tmp_path / "run" / "step-000020" / toy.TRAINING_STATE).exists()
    assert not (tmp_path / "run" / "step-000010" / toy.TRAINING_STATE).exists()
    (tmp_path / "run" / ".tmp-final-123").mkdir()  # debris of an interrupted write
    monkeypatch.setattr(toy, "_batch", real_batch)
    final = train_toy(TINY, tmp_path / "run", progress=False, evaluate=False)
    assert not list((tmp_path / "run").glob(".tmp-*"))
    a, b = load_file(tiny_run / "model.safetensors"), load_file(final / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoints_load_in_hf_and_bridge(tiny_run):
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(tiny_run, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_run)
    bridge = TransformerBridge.boot_transformers(str(tiny_run), device="cpu", dtype=torch.float32)
    ids = tok(["3+5=", "12-57="], return_tensors="pt")["input_ids"]
    assert torch.equal(bridge.to_tokens(["3+5=", "12-57="]), ids)  # one <bos>, not two
    _, cache = bridge.run_with_cache(ids)
    for name in ("blocks.0.attn.hook_z", "blocks.0.mlp.hook_post", "blocks.0.hook_resid_post"):
        assert name in cache
    assert cache["blocks.0.mlp.hook_post"].shape == (2, ids.shape[1], TINY.d_mlp)
    with torch.no_grad():
        assert torch.allclose(bridge(ids), hf(ids).logits, atol=1e-4)
    pairs = [(3, 5), (12, 57), (40, 2)]
    acc_hf = toy_accuracy(hf, tok, "-", pairs, prefix="7-3=4\n")
    assert 0.0 <= acc_hf <= 1.0
    assert toy_accuracy(bridge, tok, "-", pairs, prefix="7-3=4\n") == acc_hf


def test_cache_api_uses_cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("ARITHLIB_CACHE", str(tmp_path))
    monkeypatch.setattr(toy, "toy_accuracy_table", lambda *args: {})  # the full evaluation is slow
    cfg = ToyConfig(
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
    final = toy_model_dir(cfg, progress=False)
    assert final == tmp_path / "toy" / cfg.key() / "final"
    dirs = toy_checkpoint_dirs(cfg)
    assert sorted(dirs) == [0, 10, 12] and dirs[12] == final
    assert all((d / "model.safetensors").exists() for d in dirs.values())


def test_checkpoints_are_trained_only_as_far_as_asked_and_match_a_full_run(tiny_run, tmp_path, monkeypatch):
    """The training-dynamics checkpoints are trained on demand: asking for step 10 trains
    10 steps (no later checkpoint, no final model); asking for step 20 goes on from there;
    the weights are those of one uninterrupted run."""
    monkeypatch.setenv("ARITHLIB_CACHE", str(tmp_path))
    run = toy_run_dir(TINY)
    ten = toy_checkpoint_dir(TINY, 10, progress=False)
    assert ten == run / "step-000010" and (ten / toy.TRAINING_STATE).exists()
    assert not (run / "step-000020").exists() and not (run / "final").exists()
    twenty = toy_checkpoint_dir(TINY, 20, progress=False)
    assert not (run / "final").exists() and not (ten / toy.TRAINING_STATE).exists()
    for mine, full in ((ten, tiny_run.parent / "step-000010"), (twenty, tiny_run.parent / "step-000020")):
        a, b = load_file(mine / "model.safetensors"), load_file(full / "model.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="no checkpoint at step 15"):
        toy_checkpoint_dir(TINY, 15)


# --------------------------------------------------------------------------- the shipped weights


def test_the_default_config_has_shipped_weights_that_match_their_checksums():
    cfg = ToyConfig()
    shipped = toy.shipped_dir(cfg)
    assert shipped is not None and shipped == DATA_DIR / "toy" / cfg.key(), (
        f"no shipped toy model for the default config key {cfg.key()} (python -m arithlib.core.toy --ship writes it)"
    )
    sums = toy.verify_shipped(shipped)
    assert set(sums) == set(toy.SHIPPED_FILES)
    info = json.loads((shipped / toy.TOY_INFO).read_text())
    assert info["key"] == cfg.key() and info["config"] == json.loads(json.dumps(asdict(cfg)))
    weights = load_file(shipped / "model.safetensors")
    assert {w.dtype for w in weights.values()} == {torch.float32}
    assert sum(w.numel() for w in weights.values()) == info["n_params"]
    assert (shipped / "model.safetensors").stat().st_size < 4_000_000


@pytest.fixture
def shipped_copy(tmp_path, monkeypatch) -> Path:
    """A copy of the shipped folder as the data folder, and an empty cache."""
    key = ToyConfig().key()
    data = tmp_path / "data"
    shutil.copytree(DATA_DIR / "toy" / key, data / "toy" / key)
    monkeypatch.setattr(toy, "data_dir", lambda: data)
    monkeypatch.setenv("ARITHLIB_CACHE", str(tmp_path / "cache"))
    return data / "toy" / key


def test_loading_uses_the_shipped_weights_without_training(shipped_copy, monkeypatch):
    monkeypatch.setattr(toy, "_train", lambda *a, **k: pytest.fail("trained although weights are shipped"))
    cfg = ToyConfig()
    folder = toy_model_dir(cfg)
    assert folder == toy_run_dir(cfg) / "shipped" and (folder / toy.COMPLETE_MARKER).exists()
    for name in toy.SHIPPED_FILES:
        assert (folder / name).read_bytes() == (shipped_copy / name).read_bytes()
    assert (
        json.loads((folder / "weights.json").read_text())["model.safetensors"]["sha256"]
        == toy.read_sums(shipped_copy)["model.safetensors"]
    )
    assert toy_model_dir(cfg) == folder  # installed once
    assert toy_checkpoint_dir(cfg, cfg.steps) == folder  # the last checkpoint is the shipped model
    from arithlib.core import models

    assert models.model_dir("toy-arith") == folder


def test_a_changed_shipped_file_is_refused_in_one_line(shipped_copy):
    weights = shipped_copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(toy.ShippedWeightsChanged) as err:
        toy_model_dir(ToyConfig())
    msg = str(err.value)
    assert "\n" not in msg and "model.safetensors" in msg and "SHA-256" in msg
    assert "git checkout" in msg and "python -m arithlib.core.toy --train" in msg
    weights.unlink()
    with pytest.raises(toy.ShippedWeightsChanged, match="missing"):
        toy_model_dir(ToyConfig())


# --------------------------------------------------------------------------- the default model


@pytest.mark.toy_model
def test_default_toy_model_does_two_digit_addition_and_subtraction():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = ToyConfig()
    final = toy_model_dir(cfg)
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(final)
    split = split_pairs(cfg)
    for op in ("+", "-"):
        train, held = split[op]
        for prefix in ("", toy_eval.eval_prefix(op)):
            acc_train = toy_accuracy(model, tok, op, train, prefix)
            acc_held = toy_accuracy(model, tok, op, held, prefix)
            acc_all = (acc_train * len(train) + acc_held * len(held)) / (len(train) + len(held))
            assert acc_all >= 0.95, (op, prefix, acc_train, acc_held)
            assert acc_held >= 0.9, (op, prefix, acc_train, acc_held)
    assert final == toy_run_dir(cfg) / "shipped"  # the shipped weights: nothing trained


#: How far a new training run's accuracies may be from the shipped model's (absolute,
#: per operator and column of toy_accuracy_table). On the CPU the shipped weights were
#: trained on, with the same thread count, training is bit-identical (difference 0); on
#: another CPU the float sums round differently and the weights drift apart. + and -
#: (about 10,000 pairs each, near 100 %) stay close; the held-out * and / pairs (about
#: 100 each, where the model mostly fails to generalise) move by several pairs.
TRAINING_TOLERANCE = {"+": 0.03, "-": 0.03, "*": 0.05, "/": 0.05}
HELDOUT_MUL_DIV_TOLERANCE = 0.15


@pytest.mark.slow
def test_training_again_reproduces_the_shipped_accuracy(tmp_path):
    """Training the default config from scratch (about 4 minutes on 2 free cores, an
    hour on a loaded machine) gives the shipped model's accuracies within the tolerances
    above."""
    cfg = ToyConfig()
    final = train_toy(cfg, tmp_path / "run", progress=False)
    mine = json.loads((final / toy.TOY_INFO).read_text())["accuracy"]
    shipped = json.loads((toy.shipped_dir(cfg) / toy.TOY_INFO).read_text())["accuracy"]
    diffs = toy.accuracy_differences(mine, shipped)
    assert set(diffs) == {f"{op}/{col}" for op in shipped for col in shipped[op]}
    for key, diff in diffs.items():
        op, col = key.rsplit("/", 1)
        tol = HELDOUT_MUL_DIV_TOLERANCE if op in "*/" and col.startswith("heldout") else TRAINING_TOLERANCE[op]
        assert diff <= tol, f"{key}: trained {mine[op][col]:.4f} vs shipped {shipped[op][col]:.4f} (tolerance {tol})"
