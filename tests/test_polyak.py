"""Polyak averaging of the weights (optim.polyak), as the paper's ImageNet results use it (factor 0.9999)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vitkit import UserError
from vitkit.checkpoint import read_native
from vitkit.hub import load_model
from vitkit.train import Trainer, config_from_dict, evaluate, train


def tiny(tmp_path: Path, *overrides: str):
    doc = {
        "model": {"name": "vit_ti16", "patch_size": 8, "width": 32, "depth": 1, "num_heads": 2, "mlp_dim": 64},
        "data": {"source": "synthetic", "img_size": 16, "synthetic_size": 48},
        "optim": {"name": "sgd", "lr": 0.5, "momentum": 0.0, "batch_size": 8, "polyak": 0.8},
        "schedule": {"steps": 6},
        "run": {"out_dir": str(tmp_path / "runs"), "name": "avg", "progress": False, "plots": False},
    }
    return config_from_dict(doc, list(overrides))


def test_the_average_is_the_papers_exponential_average_of_every_step(tmp_path):
    trainer = Trainer(tiny(tmp_path))
    try:
        decay = 0.8
        expected = {n: p.detach().double().clone() for n, p in trainer.model.named_parameters()}  # starts at init
        batches = trainer.batches(0)
        for _ in range(6):
            trainer.train_step(batches)
            for n, p in trainer.model.named_parameters():
                expected[n] = decay * expected[n] + (1 - decay) * p.detach().double()
        got = dict(trainer.averaged.module.named_parameters())
        for n, want in expected.items():
            torch.testing.assert_close(got[n].double(), want, rtol=0, atol=1e-6)
        raw = dict(trainer.model.named_parameters())
        assert any(not torch.equal(raw[n], got[n]) for n in raw)  # a real average, not a copy
        # evaluation reads the averaged weights
        metrics = trainer.evaluate()
        assert metrics == evaluate(trainer.averaged.module, trainer.eval_ds)
    finally:
        trainer.close()


def test_the_saved_model_is_the_average_and_resume_is_exact(tmp_path):
    straight = train(tiny(tmp_path, "run.name=straight"))
    config, state, meta = read_native(straight.run_dir)
    assert meta["weights"] == "polyak average, factor 0.8"
    loaded = load_model(straight.run_dir)  # load_model gives the averaged weights
    assert all(torch.equal(v, state[k]) for k, v in loaded.state_dict().items())

    first = Trainer(tiny(tmp_path, "run.name=cut"))
    batches = first.batches(0)
    for _ in range(3):
        first.train_step(batches)
    first.save()
    first.close()
    resumed = train(tiny(tmp_path, "run.name=cut", "run.resume=true"))
    a, b = read_native(straight.run_dir)[1], read_native(resumed.run_dir)[1]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.metrics == straight.metrics


def test_polyak_factor_is_checked():
    with pytest.raises(UserError, match=r"optim.polyak=1.0: expected a factor in \[0, 1\)"):
        config_from_dict({}, ["optim.polyak=1"])
    assert config_from_dict({}).optim.polyak == 0.0  # off unless asked for
