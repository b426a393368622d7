"""Polyak averaging of the weights (optim.polyak), as the paper's ImageNet results use it (factor 0.9999)."""

from __future__ import annotations

import json
import warnings
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


@pytest.mark.parametrize("warmup", [True, False])
def test_the_average_is_the_exponential_average_of_every_step_with_its_warm_up(tmp_path, warmup, device):
    trainer = Trainer(tiny(tmp_path, f"optim.polyak_warmup={warmup}", f"run.device={device}"))
    try:
        decay = 0.8
        expected = {n: p.detach().double().clone() for n, p in trainer.model.named_parameters()}  # starts at init
        batches = trainer.batches(0)
        for t in range(6):
            trainer.train_step(batches)
            # TF's ExponentialMovingAverage(num_updates=t): min(decay, (1 + t) / (10 + t)); 0.1, 0.18, ... here
            d = min(decay, (1.0 + t) / (10.0 + t)) if warmup else decay
            for n, p in trainer.model.named_parameters():
                expected[n] = d * expected[n] + (1 - d) * p.detach().double()
        got = dict(trainer.averaged.module.named_parameters())
        for n, want in expected.items():
            torch.testing.assert_close(got[n].double(), want, rtol=0, atol=1e-6)
        raw = dict(trainer.model.named_parameters())
        assert any(not torch.equal(raw[n], got[n]) for n in raw)  # a real average, not a copy
        # evaluation reads the averaged weights, and its record says so
        metrics = trainer.evaluate()
        assert metrics == evaluate(trainer.averaged.module, trainer.eval_ds, device)
        record = trainer.metrics.records()[-1]
        assert record["weights"].startswith("polyak average 0.8")
        assert ("warm-up" in record["weights"]) == warmup
    finally:
        trainer.close()


def test_the_warm_up_is_on_by_default_and_a_run_shorter_than_the_horizon_warns(tmp_path):
    assert config_from_dict({}).optim.polyak_warmup is True
    with pytest.warns(
        UserWarning,
        match=r"optim.polyak=0.99 averages over about 100 steps, more than this run's 6: "
        r"the average stays in its warm-up \(factor \(1 \+ t\) / \(10 \+ t\), at most 0.4000 here\)",
    ):
        Trainer(tiny(tmp_path, "optim.polyak=0.99", "run.name=a")).close()
    with pytest.warns(UserWarning, match=r"94.1% of the average is still the initial weights at the end"):
        Trainer(tiny(tmp_path, "optim.polyak=0.99", "optim.polyak_warmup=false", "run.name=b")).close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Trainer(tiny(tmp_path, "optim.polyak=0.8", "run.name=c")).close()  # 6 steps cover a horizon of 5


def test_the_plots_say_the_evaluated_model_is_the_average(tmp_path):
    from vitkit.train.metrics import accuracy_figure, loss_figure

    result = train(tiny(tmp_path, "run.name=plots"))
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    for fig in (accuracy_figure(records), loss_figure(records)):
        assert "\nevaluated: the polyak average 0.8 (warm-up" in fig.axes[0].get_title()


def test_the_saved_model_is_the_average_and_resume_is_exact(tmp_path):
    straight = train(tiny(tmp_path, "run.name=straight"))
    config, state, meta = read_native(straight.run_dir)
    assert meta["weights"] == "polyak average 0.8 (warm-up (1+t)/(10+t))"
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
