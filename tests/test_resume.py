"""Resuming a run: the records after a SIGKILL equal an uninterrupted run's, the directory resumed is the one
named (moved or copied ones too), changes are kept in the record, a fine-tune resumes without its source,
and a run that fails before its first step leaves nothing behind."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file
from test_train import tiny as tiny_doc

from vitkit import UserError
from vitkit.checkpoint import read_native
from vitkit.cli import main
from vitkit.train import STATE_NAME, Trainer, config_from_dict, load_config, read_train_state, train

REPO = Path(__file__).resolve().parents[1]
EXACT = ("kind", "step", "epoch", "loss", "lr", "eval_loss", "eval_top1", "eval_top5")  # all but the timings


def tiny(tmp_path: Path, *overrides: str):
    return config_from_dict(tiny_doc(tmp_path), list(overrides))


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def exact(rows: list[dict]) -> list[dict]:
    return [{k: r[k] for k in EXACT if k in r} for r in rows]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return read_native(run_dir)[1]


def stop_after(cfg, steps: int) -> Path:
    """A run of cfg saved after ``steps`` steps (its records written as the loop writes them), then left."""
    trainer = Trainer(cfg)
    try:
        batches = trainer.batches(0)
        while trainer.step < steps:
            trainer.window.append(trainer.train_step(batches))
        trainer.save()
        return trainer.run_dir
    finally:
        trainer.close()


# ----------------------------------------------------------------------------------------- the records
def test_records_after_a_sigkill_and_resume_equal_an_uninterrupted_runs(tmp_path):
    # saves every 7 steps, records every 5 and 3 steps an epoch: a resume falls inside a record's window
    overrides = ["schedule.steps=120", "run.save_every=7", "run.log_every=5", "run.eval_every=20", "model.dropout=0.1"]
    reference = train(tiny(tmp_path, *overrides, "run.name=reference"))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(tiny(tmp_path, *overrides, "run.name=killed").to_dict()))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "vitkit.cli", "train", str(config)], env=env, stderr=subprocess.PIPE)
    run_dir = tmp_path / "runs" / "killed"
    deadline = time.monotonic() + 120
    # kill between two saves, once the state is past its first save and a record lies beyond it
    while proc.poll() is None and time.monotonic() < deadline:
        state = run_dir / STATE_NAME
        if state.is_file() and (run_dir / "metrics.jsonl").is_file():
            steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()[:-1]]
            if steps and steps[-1] > 14 and steps[-1] % 7:
                break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err.decode()
    killed_at = read_train_state(run_dir / STATE_NAME)[0]["step"]
    assert 0 < killed_at < 120 and killed_at % 5, killed_at  # the resume starts inside a record's window

    resumed = train(tiny(tmp_path, *overrides, "run.name=killed", "run.resume=true"))
    assert resumed.run_dir == run_dir and resumed.step == 120
    a, b = weights(reference.run_dir), weights(resumed.run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert exact(records(resumed.run_dir)) == exact(records(reference.run_dir))
    times = [r["time"] for r in records(resumed.run_dir) if r["kind"] == "train"]
    assert times == sorted(times)  # the run's clock goes on across the resume


def test_a_record_averages_every_step_since_the_previous_one(tmp_path):
    """An independent check of the record's loss: the mean of the per-step losses of the same steps."""
    cfg = tiny(tmp_path, "schedule.steps=8", "run.log_every=5", "run.name=steps")
    trainer = Trainer(cfg)
    try:
        batches = trainer.batches(0)
        losses = [trainer.train_step(batches) for _ in range(8)]
    finally:
        trainer.close()
    run = train(tiny(tmp_path, "schedule.steps=8", "run.log_every=5", "run.name=logged")).run_dir
    train_records = [r for r in records(run) if r["kind"] == "train"]
    assert [r["step"] for r in train_records] == [5, 8]  # 3 steps an epoch: both cross a boundary
    assert train_records[0]["loss"] == pytest.approx(sum(losses[:5]) / 5, rel=1e-12)
    assert train_records[1]["loss"] == pytest.approx(sum(losses[5:]) / 3, rel=1e-12)


# ------------------------------------------------------------------------------------- which directory
def test_resume_names_the_directory_it_continues(tmp_path, capsys):
    older = stop_after(tiny(tmp_path, "schedule.steps=6"), 2)
    newer = stop_after(tiny(tmp_path, "schedule.steps=6"), 3)
    assert (older.name, newer.name) == ("tiny", "tiny-1")
    capsys.readouterr()
    result = train(tiny(tmp_path, "schedule.steps=6", f"run.resume={older}"))
    assert result.run_dir == older and result.step == 6
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"resuming {older} at step 2"
    assert (newer / STATE_NAME).is_file() and read_train_state(newer / STATE_NAME)[0]["step"] == 3  # untouched
    # true: the newest, and the message names the other
    train(tiny(tmp_path, "schedule.steps=6", "run.resume=true"))
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"resuming {newer} at step 3") and str(older) in first


def test_a_runs_own_config_yaml_resumes_that_run(tmp_path, capsys):
    older = stop_after(tiny(tmp_path, "schedule.steps=6"), 2)
    stop_after(tiny(tmp_path, "schedule.steps=6"), 3)  # a newer run of the same name
    assert main(["train", str(older / "config.yaml"), "run.resume=true"]) == 0
    assert f"resuming {older} at step 2" in capsys.readouterr().out
    assert read_train_state(older / STATE_NAME)[0]["step"] == 6


def test_the_final_line_times_the_steps_this_process_trained(tmp_path, capsys):
    run_dir = stop_after(tiny(tmp_path, "schedule.steps=6"), 2)
    capsys.readouterr()
    assert main(["train", str(run_dir / "config.yaml"), "run.resume=true"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    wall, steps, steps_s = re.search(r"wall time ([\d.]+) s \((\d+) steps in ([\d.]+) s\)", last).groups()
    assert steps == "4" and float(steps_s) <= float(wall)  # 4 of the 6: the other 2 were trained before
    result = train(tiny(tmp_path, "schedule.steps=6", "run.name=fresh"))
    assert result.steps_run == 6 and 0 < result.steps_s < result.wall_s


def test_a_moved_run_directory_resumes_as_it_is(tmp_path):
    reference = train(tiny(tmp_path, "schedule.steps=6", "run.name=reference"))
    run = stop_after(tiny(tmp_path, "schedule.steps=6"), 3)
    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    shutil.move(run, moved)
    assert main(["train", str(moved / "config.yaml"), "run.resume=true"]) == 0  # no resume_with_changes
    assert load_config(moved / "config.yaml").run.out_dir == str(moved.parent)  # the record says where it is now
    a, b = weights(reference.run_dir), weights(moved)
    assert all(torch.equal(a[k], b[k]) for k in a)
    copied = tmp_path / "copy"
    shutil.copytree(moved, copied)
    result = train(tiny(tmp_path, "schedule.steps=8", f"run.resume={copied}"))
    assert result.run_dir == copied and result.step == 8 and read_train_state(moved / STATE_NAME)[0]["step"] == 6


def test_a_resume_with_changes_keeps_the_earlier_values(tmp_path):
    run = stop_after(tiny(tmp_path, "schedule.steps=6"), 3)
    train(tiny(tmp_path, "schedule.steps=6", "optim.lr=1e-2", "run.resume=true", "run.resume_with_changes=true"))
    text = (run / "config.yaml").read_text()
    assert "# resumed at step 3 with changes: optim.lr: 0.001 -> 0.01" in text
    assert load_config(run / "config.yaml").optim.lr == 0.01  # the file still parses: the history is comments
    train(tiny(tmp_path, "schedule.steps=8", "optim.lr=1e-2", "run.resume=true"))
    lines = [line for line in (run / "config.yaml").read_text().splitlines() if line.startswith("# resumed")]
    assert lines == [
        "# resumed at step 3 with changes: optim.lr: 0.001 -> 0.01",
        "# resumed at step 6 with changes: schedule.steps: 6 -> 8",
    ]


def test_saved_paths_resolve_from_anywhere(tmp_path, monkeypatch):
    source = train(tiny(tmp_path, "run.name=source")).run_dir
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    shutil.copytree(source, work / "src")
    cfg = tiny(tmp_path, "run.init_from=src", "run.out_dir=out", "run.name=ft", "schedule.steps=6")
    run = stop_after(cfg, 2)
    saved = load_config(work / run / "config.yaml")
    assert saved.run.init_from == str(work / "src") and saved.run.out_dir == str(work / "out")
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(work / run / "config.yaml"), "run.resume=true"]) == 0


def test_a_finetune_resumes_without_its_source(tmp_path):
    source = train(tiny(tmp_path, "run.name=source")).run_dir
    finetune = [f"run.init_from={source}", "schedule.steps=6", "model.name=none"]
    reference = train(tiny(tmp_path, *finetune, "run.name=reference"))
    run = stop_after(tiny(tmp_path, *finetune, "run.name=ft"), 3)
    shutil.rmtree(source)
    assert main(["train", str(run / "config.yaml"), "run.resume=true"]) == 0
    a, b = weights(reference.run_dir), weights(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------- failures
@pytest.mark.parametrize("tensorboard", [False, True])
def test_a_run_that_fails_before_its_first_step_leaves_no_directory(tmp_path, tensorboard):
    from PIL import Image

    for label in ("a", "b"):
        (tmp_path / "imgs" / label).mkdir(parents=True)
        for i in range(6):
            Image.new("RGB", (16, 16), (40 * i, 0, 0)).save(tmp_path / "imgs" / label / f"{i}.png")
    (tmp_path / "imgs" / "a" / "0.png").write_bytes(b"not an image")
    cfg = tiny(
        tmp_path,
        "data.source=folder",
        f"data.root={tmp_path / 'imgs'}",
        "data.val_fraction=0.5",
        "optim.batch_size=4",
        f"run.tensorboard={tensorboard}",
    )
    with pytest.raises(Exception, match=r"0\.png"):
        train(cfg)
    assert not (tmp_path / "runs" / "tiny").exists()
    finished = train(tiny(tmp_path)).run_dir
    assert finished.name == "tiny" and not (finished / ".lock").exists()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda doc: doc.update(step="ten"), "step='ten', expected a whole number"),
        (lambda doc: doc.update(step=10**12), "step=1000000000000, expected a whole number"),
        (lambda doc: doc.pop("param_groups"), "has no 'param_groups'"),
        (lambda doc: doc.update(param_groups=[{"lr": 1}]), "param_groups=.*expected a list of optimizer groups"),
        (lambda doc: doc.update(optim_plain_state={"0": 3}), "optim_plain_state=.*expected an object"),
        (lambda doc: doc.update(loss_window="1.5"), "loss_window=.*expected a list of losses"),
    ],
)
def test_a_hand_edited_state_is_one_line_naming_it(tmp_path, capsys, edit, message):
    run = stop_after(tiny(tmp_path), 2)
    state = run / STATE_NAME
    with safe_open(str(state), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    doc = json.loads(meta["vitkit_train_state"])
    edit(doc)
    save_file(tensors, str(state), metadata={"vitkit_train_state": json.dumps(doc)})
    with pytest.raises(UserError, match=message):
        read_train_state(state)
    assert main(["train", str(run / "config.yaml"), "run.resume=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert str(state) in err and len(err.splitlines()) == 1, err
