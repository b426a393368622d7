"""A run directory is a record that is never overwritten or mixed, and outputs never clobber: resume checks,
the one-process lock, signals, leftovers of killed saves, non-finite weights, --force."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from test_train import tiny as tiny_doc

from vitkit import UserError, VisionTransformer
from vitkit.checkpoint import read_native, save_pretrained
from vitkit.cli import main
from vitkit.io import DirectoryLock
from vitkit.train import STATE_NAME, NonFiniteLossError, Trainer, config_from_dict, load_config, train

REPO = Path(__file__).resolve().parents[1]


def tiny(tmp_path: Path, *overrides: str):
    """test_train's tiny synthetic run, as a config, with section.key=value overrides."""
    return config_from_dict(tiny_doc(tmp_path), list(overrides))


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


# ---------------------------------------------------------------------------------------------- resume
def test_resume_with_another_config_is_an_error_that_lists_the_keys(tmp_path):
    run = train(tiny(tmp_path)).run_dir
    saved = (run / "config.yaml").read_bytes()
    with pytest.raises(UserError, match=r"optim\.lr: 0\.001 -> 0\.01; run\.seed: 0 -> 3.*resume_with_changes"):
        train(tiny(tmp_path, "run.resume=true", "optim.lr=1e-2", "run.seed=3"))
    assert (run / "config.yaml").read_bytes() == saved  # a refused resume leaves the record as it was
    # a longer run and other logging are what a resume is for
    longer = train(tiny(tmp_path, "run.resume=true", "schedule.steps=6", "run.log_every=1"))
    assert longer.run_dir == run and longer.step == 6
    # an explicit yes
    meant = train(
        tiny(tmp_path, "run.resume=true", "schedule.steps=6", "optim.lr=1e-2", "run.resume_with_changes=true")
    )
    assert meant.run_dir == run and "lr: 0.01" in (run / "config.yaml").read_text()


def test_a_failed_resume_leaves_config_yaml_as_it_was(tmp_path):
    run = train(tiny(tmp_path)).run_dir
    saved = (run / "config.yaml").read_bytes()
    (run / STATE_NAME).write_bytes(b"not a state")
    with pytest.raises(UserError, match="not a readable training state"):
        train(tiny(tmp_path, "run.resume=true", "schedule.steps=6"))
    assert (run / "config.yaml").read_bytes() == saved


def test_resume_with_changes_cannot_change_the_model_and_says_so_in_one_line(tmp_path, capsys):
    run = train(tiny(tmp_path)).run_dir
    depth, width = tiny_doc(tmp_path)["model"]["depth"], tiny_doc(tmp_path)["model"]["width"]
    args = [str(run / "config.yaml"), "run.resume=true", "run.resume_with_changes=true", f"model.depth={depth + 1}"]
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{run / 'train_state.safetensors'}: the saved model does not fit" in err[0]
    assert f"missing ['blocks.{depth}." in err[0] and "start a new run (run.init_from) to change it" in err[0]
    assert main(["train", *args[:3], f"model.mlp_dim={2 * width + 8}"]) == 2
    assert "shapes ['blocks.0.mlp.fc1.weight (" in capsys.readouterr().err


def test_resuming_a_finished_run_adds_no_records(tmp_path):
    first = train(tiny(tmp_path, "run.eval_every=2"))
    records = (first.run_dir / "metrics.jsonl").read_text()
    again = train(tiny(tmp_path, "run.resume=true", "run.eval_every=2"))
    assert again.run_dir == first.run_dir and again.metrics == first.metrics
    assert (first.run_dir / "metrics.jsonl").read_text() == records


# ------------------------------------------------------------------------------------------------ lock
_HOLD = """
import sys, time
from vitkit.io import DirectoryLock
DirectoryLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(60)
"""


def test_a_second_process_on_a_run_directory_fails_at_once(tmp_path, capsys):
    run = train(tiny(tmp_path)).run_dir
    assert not (run / ".lock").exists()  # a finished run holds no lock file
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(run)], stdout=subprocess.PIPE, env=_env(), text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError, match=rf"in use by a live process \(pid {holder.pid}\)"):
            DirectoryLock(run).acquire()
        config = run / "config.yaml"
        assert main(["train", str(config), "run.resume=true"]) == 2
        assert f"pid {holder.pid}" in capsys.readouterr().err
    finally:
        holder.kill()  # SIGKILL: no chance to clean up; the kernel drops the lock
        holder.wait()
    lock = DirectoryLock(run).acquire()  # the stale lock is taken over
    assert (run / ".lock").read_text().strip() == str(os.getpid())
    with pytest.raises(UserError, match="in use by this process"):
        DirectoryLock(run).acquire()
    lock.release()
    assert not (run / ".lock").exists()


def test_new_runs_of_one_name_never_share_a_directory(tmp_path):
    a, b = Trainer(tiny(tmp_path)), Trainer(tiny(tmp_path))
    try:
        assert a.run_dir != b.run_dir and {a.run_dir.name, b.run_dir.name} == {"tiny", "tiny-1"}
    finally:
        a.close()
        b.close()


# --------------------------------------------------------------------------------------------- signals
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_saves_a_resumable_checkpoint_at_a_step_boundary(tmp_path, signum):
    reference = train(tiny(tmp_path, "schedule.steps=150", "run.name=ref"))
    config = tmp_path / "cut.yaml"
    config.write_text(yaml.safe_dump(tiny(tmp_path, "schedule.steps=150", "run.name=cut", "run.log_every=1").to_dict()))
    proc = subprocess.Popen(
        [sys.executable, "-m", "vitkit.cli", "train", str(config)],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "runs" / "cut" / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 3) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err
    assert "run.resume=true" in err and signal.Signals(signum).name in err
    state = tmp_path / "runs" / "cut" / STATE_NAME
    assert state.is_file()
    resumed = train(tiny(tmp_path, "schedule.steps=150", "run.name=cut", "run.log_every=1", "run.resume=true"))
    assert resumed.step == 150
    a, b = read_native(reference.run_dir)[1], read_native(resumed.run_dir)[1]
    assert all(torch.equal(a[k], b[k]) for k in a)  # the interrupted run ends where the uninterrupted one does


# ------------------------------------------------------------------------------------- leftovers, non-finite
def test_leftovers_of_a_killed_save_are_removed_on_the_next_start(tmp_path):
    run = train(tiny(tmp_path)).run_dir
    # atomic_write's temp file (mkstemp: 8 characters) and safetensors' own (".tmp" and 6), as a SIGKILL leaves them
    leftovers = [run / ".model.safetensors.k1ll3d_x.tmp", run / ".tmpK1ll3d"]
    for leftover in leftovers:
        leftover.write_bytes(b"half a file")
    (run / "notes.tmp").write_text("mine")
    train(tiny(tmp_path, "run.resume=true", "schedule.steps=5"))
    assert not any(leftover.exists() for leftover in leftovers)
    assert (run / "notes.tmp").read_text() == "mine"  # only the writers' temp names are cleared


def test_non_finite_weights_are_never_saved_as_the_last_good_checkpoint(tmp_path):
    trainer = Trainer(tiny(tmp_path, "run.save_every=1"))
    try:
        batches = trainer.batches(0)
        trainer.train_step(batches)
        trainer.save()
        good = (trainer.state_path.read_bytes(), (trainer.run_dir / "model.safetensors").read_bytes())
        with torch.no_grad():
            trainer.model.blocks[0].mlp.fc1.weight[0, 0] = float("inf")
        with pytest.raises(NonFiniteLossError, match=r"non-finite weights.*blocks\.0\.mlp\.fc1\.weight.*step 1\)"):
            trainer.save()
        assert (trainer.state_path.read_bytes(), (trainer.run_dir / "model.safetensors").read_bytes()) == good
    finally:
        trainer.close()


# ---------------------------------------------------------------------------------------------- --force
def test_convert_and_export_never_replace_outputs_without_force(tmp_path, capsys):
    src = tmp_path / "src"
    save_pretrained(VisionTransformer(img_size=16, patch_size=8, width=32, depth=1, num_heads=2, mlp_dim=64), src)
    dst = tmp_path / "out.safetensors"
    assert main(["convert", str(src), str(dst), "--to", "timm"]) == 0
    before = dst.read_bytes()
    assert main(["convert", str(src), str(dst), "--to", "timm"]) == 2
    assert "exists; pass --force" in capsys.readouterr().err and dst.read_bytes() == before
    assert main(["convert", str(src), str(src)]) == 2  # a run's own weights are never overwritten by accident
    assert main(["convert", str(src), str(dst), "--to", "timm", "--force"]) == 0
    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"keep me")
    assert main(["export", str(src), "--onnx", str(onnx)]) == 2
    assert onnx.read_bytes() == b"keep me"
    assert main(["export", str(src), "--onnx", str(onnx), "--force"]) == 0
    assert onnx.read_bytes() != b"keep me" and not list(tmp_path.glob(".m.onnx.*"))


def test_a_full_disk_is_one_line_naming_the_file_and_leaves_the_old_one(tmp_path, monkeypatch, capsys):
    import errno

    from vitkit.checkpoint import native

    src = tmp_path / "src"
    save_pretrained(VisionTransformer(img_size=16, patch_size=8, width=32, depth=1, num_heads=2, mlp_dim=64), src)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(native, "save_file", full)
    dst = tmp_path / "out"
    assert main(["convert", str(src), str(dst)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err and str(dst / "model.safetensors") in err
    assert not dst.exists()  # no partial file, no leftover, not even the directory the write created


# --------------------------------------------------------------------------- messages that point the right way
def test_a_config_that_is_not_utf8_is_one_line(tmp_path, capsys):
    config = tmp_path / "latin1.yaml"
    config.write_bytes("run:\n  name: caf\xe9\n".encode("latin-1"))
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(config) in err and "UTF-8" in err, err


@pytest.mark.parametrize(("source_chans", "data_chans"), [(1, 3), (3, 1)])
def test_a_finetune_across_grey_and_rgb_converts_the_images_or_names_data_in_chans(
    tmp_path, capsys, source_chans, data_chans
):
    source = train(tiny(tmp_path, "run.name=source", f"data.in_chans={source_chans}")).run_dir
    data = {"source": "synthetic", "img_size": 16, "synthetic_size": 64, "synthetic_classes": 4}
    config = tmp_path / "ft.yaml"
    run = {"init_from": str(source), "out_dir": str(tmp_path / "runs"), "progress": False, "plots": False}
    config.write_text(yaml.safe_dump({"data": data, "run": run, "schedule": {"steps": 2}}))
    # the data's channels left to the recipe: the images are converted to the source's
    assert main(["train", str(config)]) == 0, capsys.readouterr().err
    assert read_native(tmp_path / "runs" / "ft")[0]["in_chans"] == source_chans
    # the data's channels given, and not the model's: one line naming the key, no directory
    assert main(["train", str(config), f"data.in_chans={data_chans}", "run.name=given"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"data.in_chans={data_chans}" in err and str(source) in err, err
    # every recipe key given (nothing read from the source at parse time): the engine says the same
    overrides = [f"data.in_chans={data_chans}", "data.mean=0.5", "data.std=0.5", "run.name=all"]
    resolved = load_config(tmp_path / "runs" / "ft" / "config.yaml", overrides)
    with pytest.raises(UserError, match=rf"data\.in_chans={data_chans}: run\.init_from .* {source_chans}-channel"):
        train(resolved)
    assert not (tmp_path / "runs" / "given").exists() and not (tmp_path / "runs" / "all").exists()


def test_eval_and_predict_of_an_mpp_run_say_its_head_is_untrained(tmp_path, capsys):
    from PIL import Image

    run = train(tiny(tmp_path, "run.objective=mpp", "run.name=mpp")).run_dir
    assert main(["eval", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "run.objective=mpp" in err and "never trained" in err, err
    image = tmp_path / "x.png"
    Image.new("RGB", (16, 16), (200, 10, 10)).save(image)
    assert main(["predict", str(run), str(image)]) == 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("vitkit predict: warning:") and "never trained" in err
    supervised = train(tiny(tmp_path, "run.name=supervised")).run_dir
    assert main(["predict", str(supervised), str(image)]) == 0 and capsys.readouterr().err == ""


def test_inspect_names_an_unreadable_image(tmp_path, capsys):
    from PIL import Image

    run = train(tiny(tmp_path)).run_dir
    good, bad = tmp_path / "good.png", tmp_path / "bad.png"
    Image.new("RGB", (16, 16), (10, 200, 10)).save(good)
    bad.write_bytes(good.read_bytes()[:40])  # a PNG cut short
    assert main(["inspect", str(run), str(good), str(bad), "--out", str(tmp_path / "figures")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bad) in err[0] and str(good) not in err[0], err
    # the run's own data: an unreadable image of an image folder is named too
    for label in ("a", "b"):
        (tmp_path / "imgs" / label).mkdir(parents=True)
        for i in range(3):
            (tmp_path / "imgs" / label / f"{i}.png").write_bytes(bad.read_bytes())
    assert main(["inspect", str(run), "--data", str(tmp_path / "imgs"), "--out", str(tmp_path / "f2")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(tmp_path / "imgs") in err and ".png" in err, err
