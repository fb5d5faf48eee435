"""arithlib works when installed as a package: the top-level data/ ships inside the wheel
as arithlib/data/ and is read through importlib.resources (arithlib.run.paths.data_path)."""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import arithlib.run.paths as paths

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DATA_FILES = sorted(p.name for p in (ROOT / "data").iterdir() if p.is_file())


def test_every_data_file_is_found_through_data_path():
    assert DATA_FILES, "data/ is empty"
    for name in DATA_FILES:
        assert paths.data_path(name).read_bytes() == (ROOT / "data" / name).read_bytes()
    assert paths.DATA_DIR == paths.data_dir()


def test_missing_data_file_names_the_ones_there():
    with pytest.raises(FileNotFoundError, match="templates.json"):
        paths.data_path("no_such_file.json")


def test_pyproject_lists_every_subpackage():
    """setuptools' explicit ``packages`` list ships only what it names: every folder of
    arithlib/ with an __init__.py must be in it (arithlib.plots was missed once)."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    subpackages = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "arithlib").rglob("__init__.py")}
    assert subpackages <= set(cfg["packages"]), (
        f"not in pyproject.toml's packages: {subpackages - set(cfg['packages'])}"
    )


def test_pyproject_ships_every_data_file_in_the_wheel():
    """The setuptools config maps data/ to the package arithlib.data and its package-data
    globs cover every file there (the slow test below builds the wheel and checks it)."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "arithlib.data" in cfg["packages"] and "arithlib" in cfg["packages"]
    assert cfg["package-dir"]["arithlib.data"] == "data"
    globs = cfg["package-data"]["arithlib.data"]
    missing = [n for n in DATA_FILES if not any(fnmatch.fnmatch(n, g) for g in globs)]
    assert not missing, f"data files not matched by package-data {globs}: {missing}"


def test_data_dir_prefers_the_packaged_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """An installed wheel has arithlib/data/; that copy wins over any data/ beside it."""
    pkg = tmp_path / "arithlib"
    (pkg / "data").mkdir(parents=True)
    (pkg / "data" / "templates.json").write_text("{}")
    monkeypatch.setattr(paths.resources, "files", lambda _name: pkg)
    assert paths.data_dir() == pkg / "data"
    assert paths.data_path("templates.json") == pkg / "data" / "templates.json"
    monkeypatch.setattr(paths, "SOURCE_DATA_DIR", tmp_path / "nowhere")
    (pkg / "data" / "templates.json").unlink()
    (pkg / "data").rmdir()
    with pytest.raises(FileNotFoundError, match="reinstall arithlib"):
        paths.data_dir()


# --------------------------------------------------------------------------- a real install

SNIPPET = r"""
import json, sys
from pathlib import Path
import arithlib, arithlib.run.paths as paths
import arithlib.core.datasets as ds, arithlib.yu.bias_professions as bias_professions, arithlib.methods.general_ability as ga

prefix = Path(sys.prefix).resolve()
assert prefix in Path(arithlib.__file__).resolve().parents, arithlib.__file__
assert prefix in paths.data_dir().resolve().parents, paths.data_dir()
names = sorted(p.name for p in paths.data_dir().iterdir() if p.is_file())
texts = {n: paths.data_path(n).read_text(encoding="utf-8") for n in names}
# the library's own readers, one per data file
assert ds.load_json("templates.json")["zhang"] and ds.number_to_words(42) == "forty-two"
assert ds.zhang_word_problems(n_per_template=1) and ds.load_gender_data()
assert bias_professions.load_professions()["professions"] and ga.load_facts()
print(json.dumps({"arithlib": arithlib.__file__, "data_dir": str(paths.data_dir()),
                  "files": {n: len(t) for n, t in texts.items()}}))
"""


@pytest.mark.slow
def test_wheel_installs_and_reads_its_data_outside_the_repo(tmp_path: Path):
    """Build the wheel (no isolation, no dependencies), install it into a fresh venv that
    sees this interpreter's site-packages through a .pth file (so torch and the rest are
    not reinstalled; the editable arithlib there is not activated, since .pth files of an
    added folder are not processed), and read every data file from a folder outside the
    repository."""
    src = tmp_path / "src"  # a copy: setuptools writes build/ and *.egg-info into the source folder
    for name in ("pyproject.toml", "README.md"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    for name in ("arithlib", "data"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(src)],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("arithlib-*.whl")
    listed = set(zipfile.ZipFile(wheel).namelist())
    assert {f"arithlib/data/{n}" for n in DATA_FILES} <= listed, sorted(listed)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (site / "parent_site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "-q", "--target", str(site), str(wheel)],
        check=True,
        cwd=tmp_path,
    )

    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    out = subprocess.run([str(python), "-c", SNIPPET], check=True, capture_output=True, text=True, cwd=work, env=env)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(report["files"]) == DATA_FILES
    assert Path(report["arithlib"]).resolve().is_relative_to(site.resolve())
    assert not Path(report["data_dir"]).resolve().is_relative_to(ROOT.resolve())
