"""The recorded software environment: versions, commit, and its place in a run's params."""

from __future__ import annotations

from importlib.metadata import version

import arithlib.environment as env


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

    from arithlib.models import random_model_dir
    from arithlib.runs import start_run

    run = start_run("99_test", str(random_model_dir("qwen2")), out_dir=str(tmp_path))
    params = json.loads((run.out / "99_test_params.json").read_text())
    assert params["environment"]["packages"]["transformers"] == version("transformers")
    assert "git_commit" in params["environment"]
