"""Models arithlib has installed: the check that their weight files are those they were
installed with (:func:`check_installed`, before a run starts) and their reinstallation.

    python -m arithlib.core.install reinstall NAME    # delete the installed model NAME and install it again
"""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path

from .weights import reinstall_command, verify_weights


def check_installed(name: str) -> None:
    """:func:`verify_weights` for model ``name`` if arithlib has installed it (a packaged
    model, or the default toy model); nothing for a model not installed yet or not
    installed by arithlib. For run_all.sh, before any notebook starts."""
    from ..run.paths import cache_root
    from . import models, packaged_models

    if name in packaged_models.PACKAGED_MODELS:
        folder = cache_root() / "models" / name / "hf"
        installed = packaged_models._is_complete(folder)
    elif name == models.TOY_MODEL:
        from . import toy, toy_data

        folder = toy.installed_model_dir(toy_data.ToyConfig())  # the shipped weights' copy, or the model trained here
        installed = (folder / toy.COMPLETE_MARKER).exists()
    else:
        return
    if installed:
        verify_weights(folder, reinstall_command(name))


def reinstall(name: str) -> Path:
    """Delete the installed model ``name`` (a packaged model, or ``toy-arith`` with its
    checkpoints) and install it again (``toy-arith``: from its shipped weights, else by
    training it); returns its folder."""
    from ..run.paths import cache_root
    from . import models, packaged_models

    if name in packaged_models.PACKAGED_MODELS:
        shutil.rmtree(cache_root() / "models" / name / "hf", ignore_errors=True)
    elif name == models.TOY_MODEL:
        from . import toy, toy_data

        shutil.rmtree(toy.toy_run_dir(toy_data.ToyConfig()), ignore_errors=True)
    else:
        raise ValueError(f"{name!r} is not a model arithlib installs ({', '.join(models.known_models())})")
    return models.model_dir(name)


def main(argv: list[str]) -> int:
    """``reinstall NAME``: :func:`reinstall`; prints the model's folder."""
    if len(argv) != 2 or argv[0] != "reinstall":
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    try:
        print(reinstall(argv[1]))
    except ValueError as err:
        print(f"arithlib.core.install: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    sys.exit(main(sys.argv[1:]))
