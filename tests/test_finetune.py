"""Fine-tuning in one command, and config semantics without surprises."""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import yaml
from test_design import image_folder

from vitkit import UserError, VisionTransformer
from vitkit.checkpoint import read_native, save_pretrained
from vitkit.checkpoint.official import vitkit_to_official
from vitkit.cli import main
from vitkit.train import Trainer, config_from_dict
from vitkit.train import engine as engine_mod
from vitkit.train.config import SECTIONS, describe_config
from vitkit.train.finetune import default_batch_size, default_steps, finetune_config

SOURCE = dict(img_size=32, patch_size=8, width=32, depth=2, num_heads=4, mlp_dim=64, num_classes=7, gelu="tanh")


def _folder(root: Path) -> Path:
    return image_folder(root, per_class=8, size=40, name="class{}")


def _official(path: Path, **overrides) -> Path:
    model = VisionTransformer(**{**SOURCE, **overrides})
    np.savez(path, **vitkit_to_official(model))
    return path


def test_paper_length_scaled_to_the_data():
    assert default_steps(3_680, 512) == 500  # Pets: the paper's 500 steps
    assert default_steps(50_000, 512) == 10_000  # CIFAR
    assert default_steps(1_281_167, 512) == 20_000  # ImageNet
    assert default_steps(40, 32) == math.ceil(102.4 * 40 / 32)  # tiny data: no more passes than CIFAR's
    assert default_steps(3_680, 128) == 2_000  # the same images seen at another batch size
    assert default_batch_size(19) == 16 and default_batch_size(100_000) == 512


def test_finetune_command_takes_everything_from_the_checkpoint_and_the_data(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ckpt = _official(tmp_path / "pre.npz")
    data = _folder(tmp_path / "images")
    assert main(["finetune", str(ckpt), "--data", str(data), "run.progress=false"]) == 0
    out = capsys.readouterr().out
    assert f"fine-tuning {ckpt} on folder at 32 px: sgd lr 0.01" in out
    run = tmp_path / "runs" / "finetune-pre.npz"
    config, _, meta = read_native(run)
    # the architecture is the checkpoint's, the head the data's, the numerics the official ones
    assert (config["width"], config["depth"], config["num_heads"], config["mlp_dim"]) == (32, 2, 4, 64)
    assert (config["num_classes"], config["gelu"], config["representation_size"]) == (3, "tanh", None)
    assert meta["class_names"] == ["class0", "class1", "class2"]
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    optim, schedule = resolved["optim"], resolved["schedule"]
    assert (optim["name"], optim["momentum"], optim["weight_decay"], optim["grad_clip"]) == ("sgd", 0.9, 0.0, 1.0)
    assert resolved["model"] == {"name": None} and resolved["data"]["img_size"] == 32
    assert schedule["decay"] == "cosine" and schedule["epochs"] is None
    n_train = int(re.search(r"(\d+) train / \d+ eval images", out).group(1))  # the folder's split
    assert optim["batch_size"] == default_batch_size(n_train) == 16
    assert schedule["steps"] == default_steps(n_train, 16) and schedule["warmup_steps"] == round(
        0.05 * schedule["steps"]
    )
    # every choice can be overridden
    cfg = finetune_config(str(ckpt), str(data), ["optim.lr=0.003", "schedule.steps=7", "data.img_size=48"])
    assert (cfg.optim.lr, cfg.schedule.steps, cfg.data.img_size) == (0.003, 7, 48)


def test_finetune_from_a_run_directory_uses_its_preprocessing(tmp_path):
    model = VisionTransformer(**{**SOURCE, "in_chans": 3})
    run = tmp_path / "run"
    save_pretrained(model, run, metadata={"img_size": 32, "mean": [0.4, 0.4, 0.4], "std": [0.2, 0.2, 0.2]})
    cfg = finetune_config(str(run), str(_folder(tmp_path / "images")), ["schedule.steps=2"])
    assert (cfg.data.img_size, cfg.data.mean, cfg.data.std) == (32, [0.4, 0.4, 0.4], [0.2, 0.2, 0.2])
    assert cfg.model.name is None and cfg.run.init_from == str(run)


def test_train_with_init_from_takes_the_architecture_from_the_checkpoint(tmp_path):
    ckpt = _official(tmp_path / "pre.npz", width=48, num_heads=3)
    doc = {
        "data": {"source": "synthetic", "img_size": 32, "synthetic_size": 32, "synthetic_classes": 4},
        "optim": {"name": "sgd", "lr": 0.01, "batch_size": 8},
        "schedule": {"steps": 2},
        "run": {"init_from": str(ckpt), "out_dir": str(tmp_path / "runs"), "name": "ft", "progress": False},
    }
    trainer = Trainer(config_from_dict(doc))
    try:
        c = trainer.model.config
        assert (c.width, c.num_heads, c.depth, c.num_classes, c.gelu) == (48, 3, 2, 4, "tanh")
    finally:
        trainer.close()
    with pytest.raises(UserError, match="model.name: not set"):
        Trainer(config_from_dict({**doc, "run": {**doc["run"], "init_from": None}}))


def test_steps_and_epochs_together_are_an_error_that_says_what_to_drop():
    with pytest.raises(UserError, match=r"both set; give one: add schedule.steps=none to count in epochs"):
        config_from_dict({"schedule": {"steps": 100}}, ["schedule.epochs=1"])
    assert (
        config_from_dict({"schedule": {"steps": 100}}, ["schedule.epochs=1", "schedule.steps=none"]).schedule.steps
        is None
    )
    assert config_from_dict({"schedule": {"steps": 0, "epochs": 3}}).schedule.epochs == 3  # older files: 0 = unset


def _tiny(tmp_path: Path, *overrides: str):
    doc = {
        "model": {"name": "vit_ti16", "patch_size": 8, "width": 32, "depth": 1, "num_heads": 2, "mlp_dim": 64},
        "data": {"source": "synthetic", "img_size": 16, "synthetic_size": 32},
        "optim": {"batch_size": 8},
        "run": {"out_dir": str(tmp_path / "runs"), "progress": False, "plots": False},
    }
    return config_from_dict(doc, list(overrides))


def test_a_warmup_longer_than_the_run_is_halved_with_a_warning(tmp_path):
    with pytest.warns(UserWarning, match=r"warmup_steps=50 is not shorter than the run \(10 steps\).*over 5 steps"):
        trainer = Trainer(_tiny(tmp_path, "schedule.steps=10", "schedule.warmup_steps=50", "optim.lr=0.1"))
    try:
        assert trainer.schedule.warmup_steps == 5 and trainer.cfg.schedule.warmup_steps == 50
        lrs = [engine_mod.lr_at(s, 10, 0.1, trainer.schedule) for s in range(10)]
        assert max(lrs) == pytest.approx(0.1)  # the learning rate reaches its value
    finally:
        trainer.close()


def test_bf16_autocast_on_a_cpu_without_native_bf16_warns(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_mod, "bf16_is_fast", lambda device: False)
    with pytest.warns(UserWarning, match="run.amp=bf16 on a CPU without native bf16.*run.amp=none is faster"):
        Trainer(_tiny(tmp_path, "schedule.steps=1", "run.amp=bf16")).close()
    monkeypatch.setattr(engine_mod, "bf16_is_fast", lambda device: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Trainer(_tiny(tmp_path, "schedule.steps=1", "run.amp=bf16")).close()


def test_vitkit_config_lists_every_key_with_type_value_and_meaning(capsys):
    listing = describe_config()
    keys = {line.split()[0] for line in listing.splitlines()}
    for section, cls in SECTIONS.items():
        if section != "model":
            assert {f"{section}.{f.name}" for f in fields(cls) if f.init} <= keys
    assert {"model.name", "model.resnet_layers", "model.ln_eps", "model.gelu"} <= keys
    assert all(len(line.split(maxsplit=3)) == 4 for line in listing.splitlines()), "a key without a meaning"
    assert main(["config", "digits"]) == 0
    assert re.search(r"^optim\.lr\s+float\s+0\.0015\s+peak learning rate", capsys.readouterr().out, re.M)
