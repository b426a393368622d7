"""Fine-tuning in one command, and config semantics without surprises."""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from test_design import image_folder

from vitkit import UserError, VisionTransformer, create_model
from vitkit.checkpoint import read_native, save_pretrained
from vitkit.checkpoint.loader import Checkpoint
from vitkit.checkpoint.official import vitkit_to_official
from vitkit.cli import main
from vitkit.data import build_datasets
from vitkit.train import Trainer, config_from_dict
from vitkit.train import setup as setup_mod
from vitkit.train.config import SECTIONS, describe_config
from vitkit.train.config_files import data_section
from vitkit.train.optim import build_optimizer, lr_at
from vitkit.train.recipe import (
    SMALL_SOURCE,
    SMALL_SOURCE_STEPS_PER_EPOCH,
    default_batch_size,
    default_optimizer,
    default_steps,
    finetune_config,
    load_config,
    source_params,
)

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
    assert default_batch_size(143, 4) == 32 and default_batch_size(3_680, 4) == 512  # 4 steps an epoch or more


def test_finetune_command_takes_everything_from_the_checkpoint_and_the_data(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    ckpt = _official(tmp_path / "pre.npz")
    data = _folder(tmp_path / "images")
    assert main(["finetune", str(ckpt), "--data", str(data), "run.progress=false", "optim.name=sgd"]) == 0
    out = capsys.readouterr().out
    assert re.search(
        rf"^fine-tuning {re.escape(str(ckpt))} \(.* params\) on folder .*at 32 px\n  sgd lr 0.01", out, re.M
    )
    run = tmp_path / "runs" / "finetune-pre"
    config, _, meta = read_native(run)
    # the architecture is the checkpoint's, the head the data's, the numerics the official ones
    assert (config["width"], config["depth"], config["num_heads"], config["mlp_dim"]) == (32, 2, 4, 64)
    assert (config["num_classes"], config["gelu"], config["representation_size"]) == (3, "tanh", None)
    assert meta["class_names"] == ["class0", "class1", "class2"]
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    optim, schedule = resolved["optim"], resolved["schedule"]
    # the paper's fine-tuning optimizer (Table 4): SGD momentum 0.9, lr 0.01, no weight decay, clip 1
    assert (optim["name"], optim["lr"], optim["momentum"], optim["weight_decay"], optim["grad_clip"]) == (
        "sgd",
        0.01,
        0.9,
        0.0,
        1.0,
    )
    assert resolved["model"] == {"name": None} and resolved["data"]["img_size"] == 32
    assert schedule["decay"] == "cosine" and schedule["epochs"] is None
    n_train = int(re.search(r"(\d+) train / \d+ eval images", out).group(1))  # the folder's split
    # a small source: batches that make SMALL_SOURCE_STEPS_PER_EPOCH steps an epoch (the paper's 512 is for large)
    assert optim["batch_size"] == default_batch_size(n_train, SMALL_SOURCE_STEPS_PER_EPOCH) == 4
    assert schedule["steps"] == default_steps(n_train, 4) and schedule["warmup_steps"] == round(
        0.05 * schedule["steps"]
    )
    # every choice can be overridden
    cfg = finetune_config(str(ckpt), str(data), ["optim.lr=0.003", "schedule.steps=7", "data.img_size=48"])
    assert (cfg.optim.lr, cfg.schedule.steps, cfg.data.img_size) == (0.003, 7, 48)


def _checkpoint(num_params: int, mpp_head: int = 0) -> Checkpoint:
    state = {"blocks.0.w": torch.zeros(num_params - 10), "head.weight": torch.zeros(10)}
    if mpp_head:
        state["mpp.head.weight"] = torch.zeros(mpp_head)
    return Checkpoint(Path("x"), "vitkit", {}, state)


def test_the_optimizer_is_the_papers_sgd_for_a_large_source_and_adamw_for_a_small_one(tmp_path):
    assert source_params(_checkpoint(1000, mpp_head=500)) == 1000  # a pretraining head is no part of the source
    assert default_optimizer(_checkpoint(SMALL_SOURCE)) == "sgd"
    assert default_optimizer(_checkpoint(SMALL_SOURCE - 1)) == "adamw"
    assert default_optimizer(_checkpoint(SMALL_SOURCE - 1, mpp_head=10)) == "adamw"
    # ViT-Ti/16, the smallest released ViT, is above the line: every released checkpoint gets the paper's recipe
    assert sum(p.numel() for p in create_model("vit_ti16").parameters()) >= SMALL_SOURCE
    data = str(_folder(tmp_path / "images"))
    small = finetune_config(str(_official(tmp_path / "pre.npz")), data, ["schedule.steps=4"])
    o = small.optim
    assert (o.name, o.lr, o.weight_decay, o.label_smoothing, o.grad_clip) == ("adamw", 1.5e-3, 0.05, 0.1, 1.0)
    # the digits config's optimizer is the small-source recipe
    digits = load_config("digits").optim
    assert (o.name, o.lr, o.weight_decay, o.label_smoothing, o.grad_clip) == (
        digits.name,
        digits.lr,
        digits.weight_decay,
        digits.label_smoothing,
        digits.grad_clip,
    )
    # a named optimizer takes that optimizer's recipe whatever the source's size
    sgd = finetune_config(str(tmp_path / "pre.npz"), data, ["schedule.steps=4", "optim.name=sgd"]).optim
    assert (sgd.lr, sgd.momentum, sgd.weight_decay, sgd.label_smoothing) == (0.01, 0.9, 0.0, 0.0)
    assert build_optimizer(VisionTransformer(**SOURCE), sgd).param_groups[0]["momentum"] == 0.9
    assert config_from_dict({}, ["optim.name=sgd"]).optim.momentum == 0.9  # the optimizer config's default too


def test_finetune_and_train_with_init_from_resolve_the_same_recipe(tmp_path):
    ckpt, data = str(tmp_path / "pre"), str(_folder(tmp_path / "images"))
    save_pretrained(VisionTransformer(**SOURCE), ckpt, metadata={"img_size": 32, "mean": [0.4] * 3, "std": [0.2] * 3})
    for overrides in ([], ["optim.name=sgd", "optim.batch_size=8"], ["schedule.epochs=3"]):
        one = finetune_config(ckpt, data, overrides).to_dict()
        other = config_from_dict({"data": data_section(data), "run": {"init_from": ckpt}}, overrides).to_dict()
        assert one["run"].pop("name") == "finetune-pre" and other["run"].pop("name") is None
        assert one == other, overrides
    # a YAML file's explicit values are the user's; the recipe fills only the rest
    path = tmp_path / "ft.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "data": data_section(data),
                "optim": {"name": "adamw", "lr": 3e-4, "batch_size": 8},
                "schedule": {"epochs": 2},
                "run": {"init_from": ckpt},
            }
        )
    )
    cfg = load_config(path)
    assert (cfg.optim.name, cfg.optim.lr, cfg.optim.batch_size, cfg.schedule.epochs) == ("adamw", 3e-4, 8, 2)
    assert (cfg.optim.weight_decay, cfg.schedule.steps, cfg.data.mean) == (0.05, None, [0.4] * 3)
    n_train = len(build_datasets(cfg.data)[0])
    assert cfg.schedule.warmup_steps == round(0.05 * 2 * (n_train // 8))
    with pytest.raises(UserError, match=r"^run.init_from: .*nothing.npz"):
        finetune_config(str(tmp_path / "nothing.npz"), data)


def test_shipped_pretraining_recipe_is_the_papers():
    # Table 3 / appendix B.1 for ImageNet-21k: Adam 0.9 / 0.999, weight decay 0.03 (0.1 is JFT-300M's), lr 1e-3,
    # 10k warmup steps then linear decay, clip 1, batch 4096, dropout 0.1, a pre-logits layer of the width
    pre = load_config("vit_b16_pretrain", ["data.root=/d"])
    o, s = pre.optim, pre.schedule
    assert (o.name, o.betas, o.weight_decay, o.lr, o.grad_clip, o.batch_size) == (
        "adamw",
        (0.9, 0.999),
        0.03,
        1e-3,
        1.0,
        4096,
    )
    assert (s.warmup_steps, s.decay, pre.model.fields["dropout"], pre.model.fields["representation_size"]) == (
        10_000,
        "linear",
        0.1,
        768,
    )


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
        config_from_dict({}, ["schedule.steps=100", "schedule.epochs=1"])
    with pytest.raises(UserError, match=r"schedule.steps=100 and schedule.epochs=1 are both set; keep one"):
        config_from_dict({"schedule": {"steps": 100, "epochs": 1}})
    # a length on the command line replaces the file's, in either unit
    assert config_from_dict({"schedule": {"steps": 100}}, ["schedule.epochs=1"]).schedule.steps is None
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
        lrs = [lr_at(s, 10, 0.1, trainer.schedule) for s in range(10)]
        assert max(lrs) == pytest.approx(0.1)  # the learning rate reaches its value
    finally:
        trainer.close()


def test_bf16_autocast_on_a_cpu_without_native_bf16_warns(tmp_path, monkeypatch):
    monkeypatch.setattr(setup_mod, "bf16_is_fast", lambda device: False)
    with pytest.warns(UserWarning, match="run.amp=bf16 on a CPU without native bf16.*run.amp=none is faster"):
        Trainer(_tiny(tmp_path, "schedule.steps=1", "run.amp=bf16")).close()
    monkeypatch.setattr(setup_mod, "bf16_is_fast", lambda device: True)
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
