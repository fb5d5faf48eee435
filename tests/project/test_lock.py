"""The lock (requirements/lock-*.txt), the conda files and pyproject.toml agree: every
package pinned exactly and hashed, the CPU lock on a CPU build of torch, the same
versions in both locks, pyproject's ranges satisfied, one Python version everywhere."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
LOCKS = {kind: ROOT / "requirements" / f"lock-{kind}.txt" for kind in ("cpu", "cuda")}


def pins(path: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) of a hashed requirements file."""
    out: dict[str, tuple[str, list[str]]] = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", path.read_text()):
        head = block.split("\\")[0].strip()
        if not head or head.startswith(("#", "-")):
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-\[\],]+)==(\S+)", head.split(";")[0].strip())
        assert m, f"{path.name}: not an exact pin: {head!r}"
        out[canonicalize_name(m.group(1))] = (m.group(2), re.findall(r"--hash=sha256:([0-9a-f]{64})", block))
    return out


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_every_package_pinned_and_hashed(kind):
    locked = pins(LOCKS[kind])
    assert len(locked) > 100
    assert all(hashes for _, hashes in locked.values()), [n for n, (_, h) in locked.items() if not h]
    torch = locked["torch"][0]
    assert torch.endswith("+cpu") if kind == "cpu" else "+" not in torch
    assert not any(n.startswith("nvidia-") for n in locked) or kind == "cuda"


def test_locks_agree_and_satisfy_pyproject():
    cpu, cuda = pins(LOCKS["cpu"]), pins(LOCKS["cuda"])
    shared = set(cpu) & set(cuda)
    assert set(cpu) <= set(cuda)  # the CUDA lock only adds torch's CUDA libraries
    assert {n for n in shared if cpu[n][0] != cuda[n][0]} == {"torch"}
    assert cpu["torch"][0].split("+")[0] == cuda["torch"][0]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for spec in project["dependencies"] + extras["notebooks"] + extras["dev"] + extras["site"]:
        req = Requirement(spec)
        version = cpu[canonicalize_name(req.name)][0].split("+")[0]
        assert req.specifier.contains(version, prereleases=True), f"lock has {req.name}=={version}, pyproject {spec}"


def test_one_python_version_everywhere():
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    lock = (ROOT / "scripts" / "lock.sh").read_text()
    py = re.search(r'LOCK_PY="([\d.]+)"', setup).group(1)
    assert f'PY_VERSION="{py}"' in lock
    assert f"CPython {py}" in LOCKS["cpu"].read_text()
    for name, kind in (("environment.yml", "cpu"), ("environment-cuda.yml", "cuda")):
        env = yaml.safe_load((ROOT / name).read_text())
        deps = env["dependencies"]
        assert f"python={py}" in deps
        pip = next(d["pip"] for d in deps if isinstance(d, dict))
        assert f"-r requirements/lock-{kind}.txt" in pip
        assert ("--extra-index-url https://download.pytorch.org/whl/cpu" in pip) == (kind == "cpu")


def test_ci_installs_a_fresh_venv_then_runs_the_readme_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "mktemp -d" in ci and "ARITHLIB_VENV" in ci and "./run_tests.sh" in ci
    readme = (ROOT / "README.md").read_text().splitlines()[:8]
    assert any(line.startswith("./run_tests.sh") for line in readme)


def test_setup_refuses_a_python_the_lock_is_not_made_for(tmp_path):
    """A venv on another Python gets an error that says what to do, before any install."""
    import subprocess

    py = tmp_path / "venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text("#!/bin/sh\necho 3.12\n")
    py.chmod(0o755)
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup.sh")],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "ARITHLIB_VENV": str(tmp_path / "venv"), "ARITHLIB_LOCK": "cpu"},
    )
    assert out.returncode == 2
    assert "Python 3.12" in out.stderr and "CPython 3.11" in out.stderr


def test_setup_refuses_an_unknown_lock_kind(tmp_path):
    import subprocess

    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup.sh")],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "ARITHLIB_VENV": str(tmp_path / "v"), "ARITHLIB_LOCK": "rocm"},
    )
    assert out.returncode == 2 and "ARITHLIB_LOCK must be cpu, cuda or auto" in out.stderr
