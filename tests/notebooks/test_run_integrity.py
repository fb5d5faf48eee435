"""run_all.sh loses nothing and loads nothing wrong when runs collide, a disk fills or a
run is killed: one run at a time per folder (a second stops at once, naming the
first), outputs replaced whole or not at all, no notebook outliving its run, and -p
values that mean what was typed, even with --quick."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from fake_runs import SCRIPT, rn, run_args, write_notebook


def _start(args: list[str], command: str) -> subprocess.Popen:
    env = dict(os.environ, ARITHLIB_RUN_COMMAND=command)
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )


def _wait_for(condition, limit_s: float = 120.0) -> bool:
    """Poll ``condition`` until it holds (True) or ``limit_s`` passes (False)."""
    end = time.time() + limit_s
    while time.time() < end:
        if condition():
            return True
        time.sleep(0.2)
    return condition()


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill_tree(proc: subprocess.Popen, pids: list[int] = ()) -> None:
    """Clean up after a test: the runner this test started and the processes it named."""
    for pid in [proc.pid, *pids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.communicate(timeout=30)
    except (subprocess.TimeoutExpired, ValueError):
        pass


# --------------------------------------------------------------------------- one run at a time


@pytest.mark.parametrize("same_figures", [True, False], ids=["same-figures", "other-figures-same-outputs"])
def test_two_runs_started_together_one_stops_at_once_naming_the_other(tmp_path, same_figures):
    """Two runs on the same folders (or on the same outputs folder with different
    --figures): the second stops at once with one line naming the first (pid, command);
    the first finishes with all of its outputs and key."""
    nb_dir, out = tmp_path / "nb", tmp_path / "out"
    nb_dir.mkdir()
    go = tmp_path / "go"
    write_notebook(
        nb_dir / "00_a.ipynb",
        "import time\nfrom pathlib import Path\nd = Path(out_dir) / model\n(d / '00_a_table.csv').write_text('a\\n1\\n')\n"
        f"end = time.time() + 120\nwhile not Path({str(go)!r}).exists() and time.time() < end:\n    time.sleep(0.1)\n",
    )
    figs = [tmp_path / "fig", tmp_path / ("fig" if same_figures else "fig2")]
    runs = [_start(run_args(nb_dir, out, fig, "--force"), f"./run_all.sh --force run{i}") for i, fig in enumerate(figs)]
    try:
        assert _wait_for(lambda: any(r.poll() is not None for r in runs)), "both runs went on at once"
        loser = next(r for r in runs if r.poll() is not None)
        winner = next(r for r in runs if r is not loser)
        go.write_text("")
        _, err = loser.communicate(timeout=30)
        assert loser.returncode != 0
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "another run is using" in lines[0], err
        assert f"pid {winner.pid}" in lines[0] and f"run{runs.index(winner)}" in lines[0]
        out_text, err = winner.communicate(timeout=300)
        assert winner.returncode == 0, err
        fig = figs[runs.index(winner)] / "m"
        assert (fig / "00_a_table.csv").read_text() == "a\n1\n" and (out / "00_a.key").is_file()
        assert not (out / ".run.lock").exists() and not (fig / ".run.lock").exists()  # released
    finally:
        go.write_text("")
        for r in runs:
            if r.poll() is None:
                _kill_tree(r)


def test_the_lock_of_a_killed_run_is_taken_over(tmp_path, capsys):
    nb_dir, out, fig = tmp_path / "nb", tmp_path / "out", tmp_path / "fig"
    nb_dir.mkdir()
    write_notebook(nb_dir / "00_a.ipynb", "x = 1\n")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    out.mkdir()
    (out / ".run.lock").write_text(json.dumps({"pid": dead.pid, "command": "./run_all.sh killed", "started": 0}))
    assert rn.main(run_args(nb_dir, out, fig)) == 0
    said = capsys.readouterr().out
    assert "taking over the lock" in said and f"pid {dead.pid}" in said and (out / "00_a.key").is_file()


def test_a_run_that_has_just_taken_the_lock_is_named_not_left_unknown(tmp_path):
    """A run writes its record just after it takes the lock: a second run that meets the
    lock in that moment waits for the record and names the holder (it said 'pid ?')."""
    import fcntl
    import threading

    run_lock = sys.modules["run_lock"]
    path = tmp_path / ".run.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held, record not yet written
    record = json.dumps({"pid": os.getpid(), "command": "./run_all.sh first", "started": time.time()})
    writer = threading.Timer(0.3, lambda: os.write(fd, record.encode()))
    writer.start()
    try:
        with pytest.raises(run_lock.Locked, match=rf"pid {os.getpid()}, .*first"):
            run_lock.RunLock(tmp_path, "./run_all.sh second").acquire()
    finally:
        writer.join()
        os.close(fd)


# --------------------------------------------------------------------------- outputs replaced whole


def test_a_full_disk_mid_promote_keeps_the_previous_outputs(tmp_path, monkeypatch, capsys):
    """Moving a notebook's outputs into a figures folder on another, nearly full disk
    fails at one file (a cross-device move that copies, then ENOSPC half-way through a
    PDF): the figures folder keeps every previous output as it was, the run says so in
    one line and exits 1 with its timings written."""
    nb_dir, out, fig = tmp_path / "nb", tmp_path / "out", tmp_path / "fig"
    nb_dir.mkdir()
    model = fig / "m"
    model.mkdir(parents=True)
    old = {
        "01_a_1.csv": "old 1\n",
        "01_a_2.pdf": "old pdf\n",
        "01_a_3.png": "old png\n",
        "01_a_gone.csv": "stale\n",
        "00_up.csv": "upstream\n",
    }
    for name, text in old.items():
        (model / name).write_text(text)
    write_notebook(
        nb_dir / "01_a.ipynb",
        "from pathlib import Path\nd = Path(out_dir) / model\n"
        "for n in ('01_a_1.csv', '01_a_2.pdf', '01_a_3.png'):\n    (d / n).write_text('new ' + n * 200)\n",
    )
    real_copyfile, real_rename = shutil.copyfile, os.rename

    def into_figures(dst) -> bool:
        return str(model) in os.path.abspath(dst)

    def rename(src, dst, *a, **kw):  # the figures are on another filesystem
        if into_figures(dst) and not into_figures(src):
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        return real_rename(src, dst, *a, **kw)

    def copyfile(src, dst, *a, **kw):  # ... which fills up half-way through the PDF
        if into_figures(dst) and os.path.basename(dst) == "01_a_2.pdf":
            with open(dst, "wb") as f:
                f.write(Path(src).read_bytes()[:100])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        return real_copyfile(src, dst, *a, **kw)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(shutil, "copyfile", copyfile)
    assert rn.main(run_args(nb_dir, out, fig)) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "01_a" in line]
    assert len(lines) == 1 and "No space left on device" in lines[0] and "keeps its previous outputs" in lines[0], err
    kept = {p.name: p.read_text() for p in model.iterdir() if p.is_file() and p.name != "timings.csv"}
    assert kept == old  # every previous output, as it was
    assert not [p for p in model.iterdir() if p.name.startswith(".promote")]
    assert not (out / "01_a.key").exists()
    assert (out / "timings.csv").read_text().splitlines()[1].startswith("01_a,")  # timings kept
    staged = list((out / "staging").glob("run-*/01_a/m/01_a_2.pdf"))
    assert len(staged) == 1 and staged[0].read_text().startswith("new ")  # this run's outputs kept

    monkeypatch.undo()  # with room on the disk the same run replaces them whole
    assert rn.main(run_args(nb_dir, out, fig)) == 0
    assert (model / "01_a_2.pdf").read_text().startswith("new ") and not (model / "01_a_gone.csv").exists()
    assert (model / "00_up.csv").read_text() == "upstream\n"


# --------------------------------------------------------------------------- no orphans


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP], ids=["SIGKILL", "SIGHUP"])
def test_no_notebook_outlives_a_killed_run(tmp_path, sig):
    """A SIGKILL of the runner, or its terminal closing (SIGHUP), stops the notebook's
    kernel, papermill and the memory sampler too: nothing goes on writing into the cache
    and staging folder that a rerun uses."""
    nb_dir, out, fig = tmp_path / "nb", tmp_path / "out", tmp_path / "fig"
    nb_dir.mkdir()
    pids = tmp_path / "pids"
    write_notebook(
        nb_dir / "00_a.ipynb",
        "import os, time, psutil\nfrom pathlib import Path\n"
        "sampler = psutil.Process(os.getppid()).ppid()  # papermill's parent: peak_memory.py\n"
        f"Path({str(pids)!r}).write_text(f'{{os.getpid()}} {{os.getppid()}} {{sampler}}')\ntime.sleep(300)\n",
    )
    run = _start(run_args(nb_dir, out, fig), "./run_all.sh")
    found: list[int] = []
    try:
        assert _wait_for(lambda: pids.is_file() and len(pids.read_text().split()) == 3), run.stderr.read()
        found = [int(p) for p in pids.read_text().split()]  # the kernel, papermill, the memory sampler
        assert all(_alive(p) for p in found)
        os.kill(run.pid, sig)
        run.communicate(timeout=60)
        assert _wait_for(lambda: not any(_alive(p) for p in found), 60), (
            f"still running after the run was killed: {[p for p in found if _alive(p)]}"
        )
    finally:
        _kill_tree(run, found)


# --------------------------------------------------------------------------- parameters


def test_a_boolean_parameter_takes_true_or_false_typed_as_its_default(tmp_path):
    nb = tmp_path / "01_a.ipynb"
    write_notebook(nb, "pass\n", params="use_cache = True\nn = 3\nrate = 0.5\nscale = 'auto'\n")
    for text, value in (("false", False), ("FALSE", False), ("True", True), ("true", True)):
        assert rn.params_by_notebook({"use_cache": text}, [nb]) == {"01_a": {"use_cache": value}}
    for text in ("0", "no", "'false'", "fals"):
        with pytest.raises(SystemExit, match="-p use_cache takes true or false") as err:
            rn.params_by_notebook({"use_cache": text}, [nb])
        assert "\n" not in str(err.value)
    assert rn.params_by_notebook({"n": "4", "rate": "1", "scale": "8"}, [nb]) == {
        "01_a": {"n": 4, "rate": 1.0, "scale": 8}
    }
    with pytest.raises(SystemExit, match="-p n takes a whole number"):
        rn.params_by_notebook({"n": "4.5"}, [nb])


def test_use_cache_false_reaches_the_notebook_as_false_and_quick_keeps_the_users_values(tmp_path, capsys):
    """``-p use_cache false`` turns caching off (not the true string 'false'); ``--quick``
    says which values it sets and never replaces one given with -p."""
    nb_dir, out, fig = tmp_path / "nb", tmp_path / "out", tmp_path / "fig"
    nb_dir.mkdir()
    write_notebook(
        nb_dir / "01_a.ipynb",
        "if quick:\n    n_items, n_other = 2, 3\n    batch = 4\nfrom pathlib import Path\n"
        "(Path(out_dir) / model / '01_a_seen.txt').write_text(repr((use_cache, n_items, n_other, batch)))\n",
        params="use_cache = True\nn_items = 100\nn_other = 100\nbatch = 100\n",
    )
    assert (
        rn.main(
            run_args(nb_dir, out, fig, "--quick", "True", "--param", "use_cache", "false", "--param", "n_items", "50")
        )
        == 0
    )
    assert (fig / "m" / "01_a_seen.txt").read_text() == "(False, 50, 3, 4)"
    said = capsys.readouterr().out
    assert "--quick sets in 01_a: n_other=3, batch=4; kept from -p: n_items=50" in said
