"""A sweep's directory gets a run directory's protection: a cell is recognised by the config its run wrote there
(a directory the sweep did not write, or an edited spec's, is refused naming the difference, never deleted or
reported as the new spec's), one process at a time, workers that stop when the sweep dies, and a damaged file of a
cell named in one line."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_sweep import tiny_digits

from vitkit.cli import main
from vitkit.errors import UserError
from vitkit.report.sweep import write_sweep_report
from vitkit.sweep import run_sweep
from vitkit.sweep.run import run_status
from vitkit.train import NonFiniteLossError, TrainingInterrupted
from vitkit.train.state import STATE_NAME

TINY = tiny_digits(
    schedule={"steps": 4, "warmup_steps": 1}, run={"log_every": 2, "save_every": 2, "eval_batch_size": 512}
)
ROOT = Path(__file__).resolve().parents[1]


def _spec(path: Path, **changes) -> Path:
    doc = {"config": TINY, "grid": {"optim.lr": [0.001]}, "seeds": [0], "metrics": ["eval_top1"], **changes}
    path.write_text(yaml.safe_dump(doc))
    return path


def _sweep(spec: Path, out: Path, *args: str) -> int:
    return main(["sweep", str(spec), "--out", str(out), *args])


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_directory_the_sweep_did_not_write_is_kept_and_named(tmp_path, capsys):
    spec, out = _spec(tmp_path / "s.yaml"), tmp_path / "out"
    cell = out / "lr-0.001_seed-0"
    cell.mkdir(parents=True)
    (cell / "NOTES.txt").write_text("mine")
    assert _sweep(spec, out) == 2
    assert _error(capsys).endswith(
        f"{cell}: no run's config.yaml in it, but NOTES.txt; sweep into a new --out, or add --force to train this "
        "cell again"
    )
    assert sorted(p.name for p in cell.iterdir()) == ["NOTES.txt"]
    assert not (out / "sweep.csv").exists()
    assert _sweep(spec, out, "--force") == 0  # what --force is for: the cell trained again, in its place
    assert run_status(cell) == "finished" and not (cell / "NOTES.txt").exists()


def test_a_run_killed_before_its_first_save_is_restarted_but_not_a_file_beside_it(tmp_path, capsys):
    spec, out = _spec(tmp_path / "s.yaml"), tmp_path / "out"
    assert _sweep(spec, out) == 0
    cell = out / "lr-0.001_seed-0"
    for name in (STATE_NAME, "model.safetensors", "config.json"):  # as a run killed before its first save
        (cell / name).unlink()
    (cell / "NOTES.txt").write_text("mine")
    assert _sweep(spec, out) == 2
    assert "beside files no run writes (NOTES.txt); move them out, or add --force" in _error(capsys)
    assert (cell / "NOTES.txt").read_text() == "mine" and (cell / "config.yaml").is_file()
    (cell / "NOTES.txt").unlink()
    capsys.readouterr()
    assert _sweep(spec, out) == 0
    assert run_status(cell) == "finished"


def test_a_finished_cell_without_its_state_is_still_finished(tmp_path, capsys):
    """Deleting train_state.safetensors to save space: the model's metadata says the run finished."""
    spec, out = _spec(tmp_path / "s.yaml", seeds=[0, 1]), tmp_path / "out"
    assert _sweep(spec, out) == 0
    for seed in (0, 1):
        (out / f"lr-0.001_seed-{seed}" / STATE_NAME).unlink()
    assert run_status(out / "lr-0.001_seed-0") == "finished"
    stamp = (out / "lr-0.001_seed-0" / "model.safetensors").stat().st_mtime_ns
    result = run_sweep(spec, out, log=lambda line: None)
    assert result.actions == {"lr-0.001_seed-0": ["skipped"], "lr-0.001_seed-1": ["skipped"]}
    assert result.rows[0].n == 2
    assert (out / "lr-0.001_seed-0" / "model.safetensors").stat().st_mtime_ns == stamp
    assert run_sweep(spec, out, aggregate_only=True).rows[0].n == 2


def test_an_edited_spec_is_refused_naming_what_changed_and_new_cells_are_added(tmp_path, capsys):
    spec, out = _spec(tmp_path / "s.yaml"), tmp_path / "out"
    assert _sweep(spec, out) == 0
    before = (out / "sweep.csv").read_text()
    _spec(spec, overrides=["schedule.steps=6", "optim.weight_decay=0.1"])
    capsys.readouterr()
    assert _sweep(spec, out) == 2
    err = _error(capsys)
    assert "lr-0.001_seed-0: a run of another spec (optim.weight_decay: " in err
    assert "-> 0.1; schedule.steps: 4 -> 6)" in err
    assert (out / "sweep.csv").read_text() == before  # nothing reported as the new spec's
    # a spec that only adds cells (a seed, a grid value) extends the sweep: the old cells are skipped
    _spec(spec, seeds=[0, 1], grid={"optim.lr": [0.001, 0.003]})
    result = run_sweep(spec, out, log=lambda line: None)
    assert result.actions["lr-0.001_seed-0"] == ["skipped"] and len(result.actions) == 4
    # --quick, then the full spec into the same --out: the quick runs are not the full spec's
    quick = _spec(tmp_path / "q.yaml", quick={"overrides": ["schedule.steps=2"]})
    assert _sweep(quick, tmp_path / "q", "--quick") == 0
    capsys.readouterr()
    assert _sweep(quick, tmp_path / "q") == 2
    assert "(schedule.steps: 2 -> 4)" in _error(capsys)


def test_a_command_line_override_of_what_a_cell_sets_is_refused(tmp_path, capsys):
    spec, out = _spec(tmp_path / "s.yaml"), tmp_path / "out"
    for override in ("optim.lr=0.01", "run.seed=3"):
        assert _sweep(spec, out, override) == 2
        key = override.split("=")[0]
        assert _error(capsys) == (
            f"vitkit sweep: error: command line: {override}: {key} is set by each cell (its grid, cells, seeds or "
            "--out); change it in the spec instead"
        )
    assert not out.exists()


def test_a_bad_grid_value_is_the_specs_and_nothing_is_written(tmp_path, capsys):
    spec, out = _spec(tmp_path / "s.yaml", grid={"model.depth": [1, "two"]}), tmp_path / "out"
    assert _sweep(spec, out) == 2
    assert _error(capsys) == (
        f"vitkit sweep: error: {spec}: cell depth-two_seed-0: model.depth='two': expected an integer"
    )
    assert not out.exists()


HOLD = """
import sys, time
from vitkit.io import DirectoryLock
DirectoryLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(60)
"""


def test_two_sweeps_on_one_directory_the_second_is_refused_at_once(tmp_path, capsys):
    spec, out = _spec(tmp_path / "s.yaml"), tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        for extra in ((), ("--aggregate-only",)):
            assert _sweep(spec, out, *extra) == 2
            assert _error(capsys).endswith(
                f"{out}: in use by a live process (pid {holder.pid}); a run or sweep directory takes one process at "
                "a time"
            )
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # no cell was started
    assert _sweep(spec, out) == 0
    assert not (out / ".lock").exists()


def _children(pid: int) -> set[int]:
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found |= {int(p) for p in (task / "children").read_text().split()}
    return found


def _tracebacks(proc: subprocess.Popen) -> str:
    """Every thread's traceback from each live process of the tree (PYTHONFAULTHANDLER set: SIGABRT dumps them to
    stderr), as the process's stderr pipe has it; then none of them is left."""
    tree, todo = [], [proc.pid]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += [c for c in _children(pid) if c not in tree] if _alive(pid) else []
    for pid in tree:
        if _alive(pid):
            os.kill(pid, signal.SIGABRT)
    try:
        err = proc.communicate(timeout=30)[1]
    except subprocess.TimeoutExpired as e:  # a process outside the tree holds the pipe: what came so far
        err = e.stderr or b""
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return err.decode(errors="replace") if isinstance(err, bytes) else err


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the process tree in /proc")
def test_jobs_workers_stop_with_their_state_saved_when_the_sweep_is_killed(tmp_path):
    spec = _spec(tmp_path / "s.yaml", grid={"optim.lr": [0.001, 0.002]}, overrides=["schedule.steps=100000"])
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "vitkit.cli", "sweep", str(spec), "--out", str(out), "--jobs", "2"]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cells = [out / "lr-0.001_seed-0", out / "lr-0.002_seed-0"]
    try:
        deadline = time.monotonic() + 120
        while not all(run_status(c) == "partial" for c in cells):  # both cells training, a state saved
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        workers = _children(proc.pid)
    finally:
        proc.kill()  # as the OOM killer does: no handler runs in the sweep's process
        proc.wait()
    assert len(workers) >= 2
    deadline = time.monotonic() + 60
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(w) for w in workers), "workers outlived their sweep"
    assert all(run_status(c) == "partial" for c in cells)
    assert not any((c / ".lock").exists() for c in cells)


TGKILL = {"x86_64": 234, "aarch64": 131}.get(os.uname().machine)  # the syscall that signals one thread of a process


def _signal_a_helper_thread(pid: int, signum: int) -> None:
    """``signum`` to one thread of ``pid`` other than its main thread (tgkill), as the kernel may choose for a
    signal sent to the whole process."""
    helpers = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    assert helpers, "the sweep's process has no thread but its main one"
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(TGKILL, pid, helpers[0], signum) == 0, os.strerror(ctypes.get_errno())


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the process tree in /proc")
@pytest.mark.parametrize("receiver", ["process", "helper thread", "process started ignoring SIGINT"])
def test_an_interrupted_jobs_sweep_stops_its_workers_with_their_state_saved(tmp_path, receiver):
    """SIGINT to the sweep's process alone (not its process group, as `kill -INT` sends it): the running cells save
    their state at a step boundary, the queued one never starts, and the command ends as interrupted. Also when one
    of the process's helper threads receives it, while the main thread waits for the cells; and when the process
    started with SIGINT ignored, as a script's background job does (and a test runner started as one)."""
    if receiver == "helper thread" and TGKILL is None:
        pytest.skip(f"no tgkill number for {os.uname().machine}")
    overrides = ["schedule.steps=100000", "run.save_every=0"]  # a state only where a signal saves one
    spec = _spec(tmp_path / "s.yaml", grid={"optim.lr": [0.001, 0.002, 0.003]}, overrides=overrides)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1"}  # SIGABRT: every thread's traceback
    command = [sys.executable, "-m", "vitkit.cli", "sweep", str(spec), "--out", str(out), "--jobs", "2"]
    # SIGINT as the case says, not as this test's process has it
    disposition = signal.SIG_IGN if receiver.endswith("ignoring SIGINT") else signal.SIG_DFL

    def start_with_sigint():
        signal.signal(signal.SIGINT, disposition)

    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=start_with_sigint
    )
    cells = [out / "lr-0.001_seed-0", out / "lr-0.002_seed-0"]
    try:
        deadline = time.monotonic() + 120
        while not all((c / "metrics.jsonl").is_file() for c in cells):  # both cells training
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        workers = _children(proc.pid)
        if receiver != "helper thread":
            os.kill(proc.pid, signal.SIGINT)
        else:
            _signal_a_helper_thread(proc.pid, signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # a hang: fail with where each process of the sweep waits
            pytest.fail(f"the sweep did not stop within 120 s of SIGINT:\n{_tracebacks(proc)[-20000:]}")
    finally:
        proc.kill()
    assert proc.returncode == 130 and "interrupted" in err, err
    deadline = time.monotonic() + 30
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(workers) >= 2 and not any(_alive(w) for w in workers)
    assert all(run_status(c) == "partial" for c in cells)  # each stopped at a step boundary with its state saved
    assert not (out / "lr-0.003_seed-0").exists() and not any((c / ".lock").exists() for c in cells)


def test_what_a_worker_raises_crosses_back_to_the_sweep_whole():
    """A --jobs worker's exception reaches the sweep pickled: one that did not unpickle would break the pool, which
    then kills the other workers before they release their run directories."""
    for error in (TrainingInterrupted("stopped at step 3", 2), NonFiniteLossError("nan"), UserError("bad value")):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error)
    assert pickle.loads(pickle.dumps(TrainingInterrupted("stopped", 15))).signum == 15


@pytest.mark.parametrize("damage", ["garbage", "step 1e12"])
def test_a_damaged_state_fails_its_cell_in_one_line_naming_it(tmp_path, capsys, damage):
    spec, out = _spec(tmp_path / "s.yaml", seeds=[0, 1]), tmp_path / "out"
    assert _sweep(spec, out) == 0
    state = out / "lr-0.001_seed-0" / STATE_NAME
    if damage == "garbage":
        state.write_bytes(b"\x00" * 100)
    else:
        from safetensors import safe_open
        from safetensors.torch import save_file

        with safe_open(str(state), framework="pt") as f:
            meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        doc = json.loads(meta["vitkit_train_state"])
        doc["step"] = 10**12
        save_file(tensors, str(state), metadata={"vitkit_train_state": json.dumps(doc)})
    capsys.readouterr()
    result = run_sweep(spec, out, log=lambda line: None)
    assert list(result.failed) == ["lr-0.001_seed-0"] and str(state) in result.failed["lr-0.001_seed-0"]
    assert result.actions == {"lr-0.001_seed-1": ["skipped"]}
    assert _sweep(spec, out, "--aggregate-only") == 2
    assert _error(capsys).startswith(f"vitkit sweep: error: {state}: ")


def test_a_sweep_table_naming_a_run_outside_the_sweep_is_refused(tmp_path):
    spec, out = _spec(tmp_path / "s.yaml"), tmp_path / "sweep"
    run_sweep(spec, out, log=lambda line: None)
    doc = json.loads((out / "sweep.json").read_text())
    doc["runs"][0]["run"] = "../x"
    (out / "sweep.json").write_text(json.dumps(doc))
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.yaml").write_text("{}")
    with pytest.raises(UserError, match=r"sweep.json: run '../x' is not the name of a run directory inside"):
        write_sweep_report(out)
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == ["config.yaml"]
