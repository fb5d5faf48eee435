"""The command line (arithlib.cli; ./run_all.sh hands its arguments to it): every missing
or bad value stops it before anything runs, with one line on stderr and exit status 2 (no
traceback, no value ever run as code); --help lists every option with its default, the
models and the notebooks; one notebook alone gets every core."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))

from arithlib import cli  # noqa: E402

cli._run_notebooks()  # scripts/ on the path
import notebook_files as nf  # noqa: E402  (scripts/, on the path the CLI set)


@pytest.fixture
def ran(monkeypatch, tmp_path):
    """What the CLI hands to ``run_notebooks.run`` (which runs nothing here): the module is
    looked up as the CLI looks it up, since other tests load their own copy."""
    seen = {}
    rn = cli._run_notebooks()
    monkeypatch.setattr(rn, "run", lambda args, plan: seen.update(args=args, plan=plan, rn=rn) or 0)
    return seen


def _cli(capsys, tmp_path, *argv: str) -> tuple[int, str, str]:
    """Run the CLI in this process on a scratch outputs/figures folder; (status, stdout, stderr).
    ``--print-figures`` keeps a run that passed its checks from starting any notebook."""
    status = cli.main(
        ["run", "--figures", str(tmp_path / "fig"), "--out", str(tmp_path / "out"), "--print-figures", *argv]
    )
    out, err = capsys.readouterr()
    return status, out, err


BAD = {
    "unknown model": (["--model", "no-such-model"], "unknown model 'no-such-model'"),
    "a quote in the model name": (["--model", "it's"], 'unknown model "it\'s"'),
    "unknown device": (["--device", "tpu"], "unknown device 'tpu'"),
    "unknown notebook": (["--only", "99"], "--only 99 matches no notebook"),
    "--model without its value": (["--model"], "'--model' requires an argument"),
    "-p without its value": (["-p", "key_threshold"], "'-p' requires 2 arguments"),
    "-p alone": (["-p"], "'-p' requires 2 arguments"),
    "seed not a number": (["--seed", "x"], "Invalid value for '--seed'"),
    "negative seed": (["--seed", "-1"], "--seed"),
    "jobs not a number": (["--jobs", "two"], "Invalid value for '--jobs'"),
    "no jobs": (["--jobs", "0"], "--jobs"),
    "threads not a number": (["--threads", "1.5"], "Invalid value for '--threads'"),
    "negative threads": (["--threads", "-1"], "--threads"),
    "unknown option": (["--modle", "x"], "No such option: --modle"),
    "unknown dtype": (["--dtype", "float8"], "unknown dtype 'float8'"),
    "device map not JSON": (["--device-map", "{broken"], "is not valid JSON"),
    "unknown parameter": (
        ["--only", "01", "-p", "key_treshold", "-0.1"],
        "unknown parameter key_treshold for notebook 01_identify_heads (did you mean key_threshold?)",
    ),
    "unknown parameter, all notebooks": (["-p", "nope", "1"], "--list-params lists each notebook's parameters"),
    "parameter of an unselected notebook": (
        ["--only", "00", "-p", "key_threshold", "-0.1"],
        "unknown parameter key_threshold for notebook 00_model_accuracy",
    ),
    "parameter set by an option": (["-p", "seed", "1"], "-p seed: set it with --seed"),
    "float parameter": (
        ["--only", "01", "-p", "key_threshold", "notanumber"],
        "-p key_threshold takes a number (default -0.05), not 'notanumber'",
    ),
    "int parameter": (["--only", "00", "-p", "fewshot", "2.5"], "-p fewshot takes a whole number (default 2)"),
    "bool parameter": (["--only", "01", "-p", "use_cache", "yes"], "-p use_cache takes true or false"),
    "list parameter, not a list": (["--only", "01", "-p", "ops", "+"], "-p ops takes a list"),
    "list parameter, wrong items": (["--only", "01", "-p", "ops", "[1, 2]"], "item 0 is 1, not text"),
    "list of records, wrong shape": (["--only", "02", "-p", "cases", '[["+", 4]]'], "item 0 has 2 items, not 3"),
    "list parameter, code": (["--only", "01", "-p", "ops", "[__import__('os').getpid()]"], "-p ops takes a list"),
}


@pytest.mark.parametrize("argv,message", list(BAD.values()), ids=list(BAD))
def test_a_bad_value_is_one_line_and_status_2_before_anything_runs(argv, message, capsys, tmp_path):
    status, out, err = _cli(capsys, tmp_path, *argv)
    assert status == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err and message in lines[0], err
    assert lines[0].startswith("python -m arithlib run: error: ")
    assert not out and not (tmp_path / "fig").exists() and not (tmp_path / "out").exists()


def test_the_unknown_model_line_lists_the_valid_ones(capsys, tmp_path):
    from arithlib.core.models import known_models

    _, _, err = _cli(capsys, tmp_path, "--model", "no-such-model")
    assert all(name in err for name in known_models())


def test_cuda_without_a_gpu_is_one_line(capsys, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    status, _, err = _cli(capsys, tmp_path, "--device", "cuda")
    assert status == 2 and len(err.strip().splitlines()) == 1 and "no GPU is visible" in err


def test_a_model_whose_weight_files_changed_is_refused(capsys, tmp_path, monkeypatch):
    from arithlib.core import install, weights

    def changed(name):
        raise weights.ModelFilesChanged(
            f"/x/{name}/model.safetensors changed after the model was installed; "
            f"reinstall the model: {weights.reinstall_command(name)}"
        )

    monkeypatch.setattr(install, "check_installed", changed)
    status, _, err = _cli(capsys, tmp_path, "--model", "smollm2-135m")
    assert status == 2 and len(err.strip().splitlines()) == 1
    assert "changed after the model was installed" in err and "reinstall smollm2-135m" in err


def test_good_values_pass_and_reach_the_run_typed(capsys, tmp_path, ran):
    status = cli.main(
        [
            "run",
            "--model",
            "org/m",
            "--device",
            "cpu",
            "--only",
            "01,02",
            "-p",
            "key_threshold",
            "-0.1",
            "-p",
            "ops",
            '["+", "-"]',
            "-p",
            "use_cache",
            "FALSE",
            "-p",
            "cases",
            '[["*", 2, 3]]',
            "--seed",
            "3",
            "--quick",
            "--no-report",
            "--figures",
            str(tmp_path / "f"),
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert status == 0, capsys.readouterr().err
    args, plan = ran["args"], ran["plan"]
    assert (args.model, args.device, args.quick, args.seed, args.report) == ("org/m", "cpu", "True", 3, False)
    assert plan.by_notebook["01_identify_heads"] == {"key_threshold": -0.1, "ops": ["+", "-"], "use_cache": False}
    assert plan.by_notebook["02_mlp_probing"] == {"cases": [["*", 2, 3]]}  # 02 has no ops
    assert plan.changes == ["--quick", "--seed 3", "-p key_threshold", "-p ops", "-p use_cache", "-p cases"]


@pytest.mark.parametrize(
    "argv,jobs,threads",
    [
        ([], 2, 1),  # every notebook: two at a time, one thread each
        (["--only", "00"], 2, 2),  # one notebook: every core
        (["--only", "00,03"], 2, 1),
        (["--jobs", "1"], 1, 2),
        (["--only", "00", "--threads", "1"], 2, 1),
        (["--only", "00", "--threads", "0"], 2, 0),
    ],
)
def test_one_notebook_alone_gets_every_core(argv, jobs, threads, monkeypatch, capsys, tmp_path, ran):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # a 2-core machine
    assert (
        cli.main(
            [
                "run",
                "--model",
                "org/m",
                "--device",
                "cpu",
                "--figures",
                str(tmp_path / "f"),
                "--out",
                str(tmp_path / "o"),
                "--no-report",
                *argv,
            ]
        )
        == 0
    ), capsys.readouterr().err
    rn = ran["rn"]
    assert (ran["args"].jobs, ran["args"].threads) == (jobs, threads)
    assert rn.default_threads(2, 16, 1) == 16 and rn.default_threads(4, 16, 9) == 4 and rn.default_threads(1, 8, 9) == 8


def test_help_lists_every_option_with_its_default_the_models_and_the_notebooks(capsys):
    from arithlib.core.models import known_models

    assert cli.main(["run", "--help"]) == 0
    text = capsys.readouterr().out
    for name in known_models():
        assert name in text
    for stem in NOTEBOOKS:
        assert stem in text
    options = [
        "--model",
        "--device",
        "--dtype",
        "--device-map",
        "--quick",
        "--seed",
        "--param",
        "--only",
        "--force",
        "--jobs",
        "--threads",
        "--figures",
        "--out",
        "--report",
        "--list-params",
        "--notebooks",
    ]
    blocks = text.split("\n  -")
    for option in options:
        block = next(
            (b for b in blocks if b.lstrip("-").startswith(option.lstrip("-")) or f", {option}" in b.split("\n")[0]),
            None,
        )
        assert block is not None, f"{option} not in --help"
        assert "[default: " in " ".join(block.split()), f"{option} has no default in --help"
    assert "ast.literal_eval" in text and "outputs/scratch/figures" in text  # -p typing, the scratch rule


def test_list_params_prints_each_notebooks_parameters(capsys):
    assert cli.main(["run", "--only", "01", "--list-params"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("01_identify_heads:") and "  key_threshold = -0.05    # a number" in text
    assert "  model =" not in text  # set by --model


def test_values_are_typed_as_the_default_and_never_run():
    tv = nf.typed_value
    assert tv("k", " 7 ", "3") == 7 and tv("x", "1", "0.5") == 1.0 and tv("b", "FALSE", "True") is False
    assert tv("s", "7+2", '"3+5"') == "7+2"  # text stays text (no arithmetic on it)
    assert tv("s", "-2", '"-1"') == "-2"  # a text default that reads as a number takes text
    assert tv("s", "8", '"auto"') == 8 and tv("s", "'8'", '"auto"') == "8" and tv("s", "cpu", '"auto"') == "cpu"
    assert tv("n", "None", "None") is None and tv("n", "[1, 2]", "None") == [1, 2] and tv("n", "x y", "None") == "x y"
    assert tv("t", "[1, 2]", "(6, 12)") == (1, 2) and tv("f", "[1, 0.5]", "[0.1, 0.2]") == [1.0, 0.5]
    for name, text, default in (
        ("k", "1e3", "3"),
        ("k", "True", "3"),
        ("x", "nan", "0.5"),
        ("l", "[1, 'a']", "[1, 2]"),
        ("l", "__import__('os')", "[1]"),
        ("b", "1", "True"),
    ):
        with pytest.raises(ValueError, match=f"-p {name} takes "):
            tv(name, text, default)


# --------------------------------------------------------------------------- through a shell


def _setup_is_a_no_op(venv: Path) -> bool:
    """Whether scripts/setup.sh would install nothing into ``venv`` (its stamp: the lock's
    and pyproject's hashes, this checkout)."""
    stamp = venv / ".arithlib-lock"
    if not stamp.is_file():
        return False
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    for kind in ("cpu", "cuda"):
        lock, project = ROOT / "requirements" / f"lock-{kind}.txt", ROOT / "pyproject.toml"
        text = f"{digest(lock)}  {lock}\n{digest(project)}  {project}\n"
        if stamp.read_text().strip() == f"{hashlib.sha256(text.encode()).hexdigest()[:16]} {ROOT}":
            return True
    return False


def test_python_m_arithlib_with_a_quote_in_the_model_name_is_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "arithlib", "run", "--model", "it's"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and 'unknown model "it\'s"' in proc.stderr


def test_run_all_sh_help_lists_the_models_and_notebooks():
    venv = Path(sys.prefix)
    if not _setup_is_a_no_op(venv):
        pytest.skip(f"scripts/setup.sh would install into {venv} first")
    proc = subprocess.run(
        ["./run_all.sh", "-h"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, ARITHLIB_VENV=str(venv)),
        timeout=300,
    )
    assert proc.returncode == 0 and "Usage: ./run_all.sh [OPTIONS]" in proc.stdout, proc.stderr
    assert all(stem in proc.stdout for stem in NOTEBOOKS) and "toy-arith" in proc.stdout


@pytest.mark.parametrize(
    "argv,message",
    [(["--model", "it's"], 'unknown model "it\'s"'), (["--only", "01", "--model"], "'--model' requires an argument")],
    ids=["quote-in-model", "missing-value"],
)
def test_run_all_sh_with_a_bad_value_exits_2_with_one_line(argv, message):
    venv = Path(sys.prefix)
    if not _setup_is_a_no_op(venv):
        pytest.skip(f"scripts/setup.sh would install into {venv} first")
    env = dict(os.environ, ARITHLIB_VENV=str(venv))
    proc = subprocess.run(["./run_all.sh", *argv], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "unbound variable" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("./run_all.sh: error: ") and message in lines[0], proc.stderr
