"""Which model a benchmark runs on, named by one ``--model`` string:

* a registry name or a local directory (:func:`arithlib.core.models.load_model`);
* ``random-<arch>``: a tiny random-weight model of that architecture (2 layers; the
  test suite's code-path check);
* ``random-<arch>:<shape>``: a random-weight model of a full-size shape from
  :data:`arithlib.core.random_models.FULL_SHAPES` (``random-llama:llama3-8b``), built directly on
  the device in the given dtype: how the GPU benchmarks run a paper-sized model
  without its weights.

    ap = argparse.ArgumentParser(); bench_model.add_arguments(ap, "qwen2.5-coder-0.5b")
    loaded = bench_model.load(a.model, a.device, a.dtype)
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from arithlib.core.models import LoadedModel, load_model
from arithlib.core.random_models import FULL_SHAPES, load_random_model

DTYPES = ("float32", "bfloat16", "float16")


def parse(spec: str) -> tuple[str, str] | None:
    """``(arch, shape)`` of a ``random-<arch>[:<shape>]`` spec, else None."""
    if not spec.startswith("random-"):
        return None
    arch, _, shape = spec.removeprefix("random-").partition(":")
    shape = shape or "tiny"
    if shape != "tiny" and (arch, shape) not in FULL_SHAPES:
        known = ", ".join(f"random-{a}:{s}" for a, s in FULL_SHAPES)
        raise ValueError(f"unknown random model {spec!r}: use random-<arch> (tiny) or one of {known}")
    return arch, shape


def load(spec: str, device: str = "cpu", dtype: str = "float32", seed: int = 0) -> LoadedModel:
    """The model ``spec`` names, on ``device`` in ``dtype`` (a torch dtype's name)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    torch_dtype = getattr(torch, dtype)
    random = parse(spec)
    if random is None:
        return load_model(spec, device=device, dtype=torch_dtype)
    return load_random_model(*random, seed=seed, device=device, dtype=torch_dtype)


def allowed_flips(n: int, dtype: torch.dtype) -> int:
    """Prompts whose verdict may differ between two computations of the same answers:
    none in float32; in bfloat16 / float16 max(1, 2 %) of ``n``, since passes of other
    shapes round differently and can swap the argmax of near-tied logits."""
    return 0 if dtype == torch.float32 else max(1, int(0.02 * n))


def add_arguments(ap: argparse.ArgumentParser, default_model: str) -> None:
    """``--model``, ``--device`` and ``--dtype``, as every benchmark takes them."""
    ap.add_argument(
        "--model",
        default=default_model,
        help="registry name, local dir, random-<arch> (tiny) or random-<arch>:<shape> "
        "(full size, e.g. random-llama:llama3-8b)",
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda (an error if no GPU is visible)")
    ap.add_argument("--dtype", default="float32", choices=DTYPES)


def add_run_arguments(ap: argparse.ArgumentParser) -> None:
    """``--threads`` (torch's, default one: the notebooks run with one each) and
    ``--no-append`` (print the table only), as the timed benchmarks take them."""
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the notebooks run with one each)")
    ap.add_argument("--no-append", action="store_true", help="print only, do not append to RESULTS.md")


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's thread count set to ``n`` for the block and restored after it (a
    benchmark's ``main()`` also runs inside the tests)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def restored(module: object, name: str) -> Iterator[None]:
    """``module.name`` as it was on entry again when the block ends, whatever a baseline
    put there meanwhile (a benchmark swaps a library function for the one it replaced)."""
    kept = getattr(module, name)
    try:
        yield
    finally:
        setattr(module, name, kept)
