"""Training engine: configs, one-step train + load back, exact resume after SIGKILL, 2-process gloo DDP,
the non-finite guard, fine-tuning from an official .npz, bad inputs, overfitting one batch, digits."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from vitkit.checkpoint.native import read_native
from vitkit.checkpoint.official import vitkit_to_official
from vitkit.cli import main as cli_main
from vitkit.errors import UserError
from vitkit.models import create_model, model_from_config
from vitkit.train import (
    STATE_NAME,
    NonFiniteLossError,
    Trainer,
    config_from_dict,
    evaluate,
    load_config,
    read_train_state,
    shipped_configs,
    train,
)
from vitkit.train.optim import build_optimizer, lr_at, param_groups
from vitkit.train.sampling import SeededBatches, StepPlan

REPO = Path(__file__).resolve().parents[1]


def tiny(tmp_path: Path, **sections) -> dict:
    """A tiny synthetic run as a nested dict; keyword sections update the defaults."""
    doc = {
        "model": {"name": "vit_ti16", "patch_size": 8, "width": 32, "depth": 2, "num_heads": 2, "mlp_dim": 64},
        "data": {"source": "synthetic", "img_size": 16, "synthetic_size": 64, "synthetic_classes": 4},
        "optim": {"name": "adamw", "lr": 1e-3, "batch_size": 16},
        "schedule": {"steps": 4, "warmup_steps": 2},
        "run": {"out_dir": str(tmp_path / "runs"), "name": "tiny", "progress": False, "plots": False, "threads": 1},
    }
    for section, values in sections.items():
        doc[section] = {**doc[section], **values}
    return doc


def write_yaml(path: Path, doc: dict) -> Path:
    path.write_text(yaml.safe_dump(doc))
    return path


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return read_native(run_dir)[1]


def stopped_and_resumed(doc: dict, steps: int = 3):
    """(a run straight through, the same run saved after ``steps`` steps and resumed): their results."""
    reference = train(config_from_dict(doc, ["run.name=ref"]))
    first = Trainer(config_from_dict(doc, ["run.name=cut"]))
    batches = first.batches(0)
    for _ in range(steps):
        first.train_step(batches)
    first.save()
    first.close()
    return reference, train(config_from_dict(doc, ["run.name=cut", "run.resume=true"]))


# --------------------------------------------------------------------------------------------- config
def test_config_overrides_are_typed():
    cfg = load_config(
        None,
        [
            "optim.lr=3e-4",
            "optim.betas=0.9,0.95",
            "run.compile=true",
            "schedule.steps=1e3",
            "schedule.epochs=none",
            "data.mean=0.5,0.4,0.3",
            "model.representation_size=none",
            "run.init_from=null",
            "model.depth=3",
        ],
    )
    assert cfg.optim.lr == 3e-4 and cfg.optim.betas == (0.9, 0.95) and cfg.run.compile is True
    assert cfg.schedule.steps == 1000 and isinstance(cfg.schedule.steps, int)
    assert (
        cfg.data.mean == [0.5, 0.4, 0.3]
        and cfg.model.fields["representation_size"] is None
        and cfg.model.fields["depth"] == 3
    )
    assert cfg.run.name == "digits"  # the config's stem
    again = config_from_dict(yaml.safe_load(cfg.to_yaml()))  # the resolved YAML round-trips
    assert again == cfg


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lrr=1", "did you mean optim.lr"),
        ("optm.lr=1", "did you mean optim"),
        ("optim.lr=fast", "optim.lr='fast': expected a number"),
        ("optim.batch_size=1.5", "expected an integer"),
        ("run.plots=maybe", "expected a bool"),
        ("run.compile=maybe", "run.compile='maybe': expected true, false or a torch.compile mode"),
        ("optim.betas=0.9", "expected 2 values"),
        ("optim.name=lamb", "expected one of adamw, adam, sgd"),
        ("lr=3", "expected section.key=value"),
        ("optim.accum_steps=3", "multiple of optim.accum_steps"),
    ],
)
def test_config_errors_name_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


def test_shipped_configs_parse(tmp_path):
    ckpt = tmp_path / "ckpt.npz"  # a fine-tune's recipe reads its source's preprocessing
    np.savez(ckpt, **vitkit_to_official(create_model("vit_ti16", width=32, depth=1, num_heads=2, mlp_dim=64)))
    assert {"digits", "vit_b16_pretrain", "vit_b16_finetune"} <= set(shipped_configs())
    for name, path in shipped_configs().items():
        header = path.read_text().splitlines()[:4]
        assert any("command:" in line for line in header) and any("runtime:" in line for line in header), name
        required = "???" in path.read_text()
        with pytest.raises(ValueError, match="required") if required else contextlib.nullcontext():
            load_config(name)
        cfg = load_config(name, ["data.root=/data", f"run.init_from={ckpt}"] if required else [])
        assert cfg.run.name == name
    pre = load_config("vit_b16_pretrain", ["data.root=/d"])
    assert (pre.optim.name, pre.optim.betas, pre.optim.batch_size, pre.optim.grad_clip) == (
        "adamw",
        (0.9, 0.999),
        4096,
        1,
    )
    assert (pre.schedule.warmup_steps, pre.schedule.decay, pre.model.fields["representation_size"]) == (
        10000,
        "linear",
        768,
    )
    ft = load_config("vit_b16_finetune", ["data.root=/d", f"run.init_from={ckpt}"])
    assert (ft.optim.name, ft.optim.momentum, ft.optim.weight_decay, ft.optim.batch_size) == ("sgd", 0.9, 0.0, 512)
    assert (ft.data.img_size, ft.schedule.decay, ft.schedule.steps) == (384, "cosine", 10000)


# -------------------------------------------------------------------------------------- optim, sampling
def test_lr_schedule_and_weight_decay_groups():
    sched = config_from_dict({"schedule": {"steps": 110, "warmup_steps": 10, "decay": "cosine"}}).schedule
    assert lr_at(0, 110, 1.0, sched) == pytest.approx(0.1)
    assert lr_at(9, 110, 1.0, sched) == pytest.approx(1.0)
    assert lr_at(60, 110, 1.0, sched) == pytest.approx(0.5)
    assert lr_at(110, 110, 1.0, sched) == pytest.approx(0.0, abs=1e-12)
    sched = dataclasses.replace(sched, decay="linear", min_lr=0.1)  # a frozen value: replaced, not changed
    assert lr_at(35, 110, 1.0, sched) == pytest.approx(0.1 + 0.9 * 0.75)

    model = create_model("vit_ti16", width=32, depth=1, num_heads=2, mlp_dim=64, img_size=16, patch_size=8)
    decay, no_decay = param_groups(model, 0.05)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(p.ndim >= 2 for p in decay["params"])
    skipped = {names[id(p)] for p in no_decay["params"]}
    assert {"cls_token", "pos_embed", "blocks.0.attn.qkv.bias", "norm.weight"} <= skipped
    assert "blocks.0.attn.qkv.weight" not in skipped and "head.weight" not in skipped


def test_seeded_order_shards_and_resumes():
    one = StepPlan(50, batch_size=8, accum_steps=2, seed=3)
    ranks = [StepPlan(50, batch_size=8, accum_steps=2, world_size=2, rank=r, seed=3) for r in range(2)]
    for step in (0, 5, 7):  # step 7 is in epoch 1 (6 steps per epoch)
        for micro in range(2):
            whole = one.micro_batch(step, micro)[0]
            assert torch.equal(torch.cat([p.micro_batch(step, micro)[0] for p in ranks]), whole)
    full = list(SeededBatches(one, 0, 10))
    assert list(SeededBatches(one, 4, 10)) == full[8:]  # skipping to a step replays the same items and seeds
    assert sorted(i for batch in full[:12] for i, _ in batch) == sorted(one.permutation(0)[:48].tolist())


# --------------------------------------------------------------------------------------------- training
def test_one_step_train_checkpoint_and_load_back(tmp_path, capsys):
    cfg = config_from_dict(tiny(tmp_path, schedule={"steps": 1}))
    result = train(cfg)
    run = result.run_dir
    assert run == tmp_path / "runs" / "tiny"
    for name in ("config.yaml", "model.safetensors", "config.json", STATE_NAME, "metrics.jsonl"):
        assert (run / name).is_file(), name
    config, state, meta = read_native(run)
    assert meta["step"] == 1 and meta["class_names"] == [f"class_{k}" for k in range(4)] and meta["img_size"] == 16
    assert meta["metrics"]["eval_top1"] == result.metrics["eval_top1"]
    model = model_from_config(config)
    model.load_state_dict(state)
    trainer = Trainer(config_from_dict(tiny(tmp_path, run={"name": "other"})))
    again = evaluate(model, trainer.eval_ds)
    assert again["eval_loss"] == pytest.approx(result.metrics["eval_loss"], rel=1e-6)
    doc, _ = read_train_state(run / STATE_NAME)
    assert doc["step"] == 1
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in records} == {"train", "eval"}
    # the resolved config in the run reloads to the same config; a second run never overwrites the first
    assert config_from_dict(yaml.safe_load((run / "config.yaml").read_text())) == cfg
    assert train(cfg).run_dir == tmp_path / "runs" / "tiny-1"
    # `vitkit eval RUN` scores it on the run's own held-out data
    assert cli_main(["eval", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"top-1 {100 * result.metrics['eval_top1']:.2f}%" in out
    # data overrides may follow options; anything else left over is a usage error
    assert cli_main(["eval", str(run), "--batch-size", "7", "data.skip_corrupt=true"]) == 0
    assert f"top-1 {100 * result.metrics['eval_top1']:.2f}%" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["eval", str(run), "--batch-size", "7", "--bogus"])


def device_settings(device: torch.device) -> list[tuple[str, bool]]:
    """(run.amp, run.compile) pairs to train with on device: fp16 (GradScaler) and compilation on CUDA only."""
    settings = [("none", False), ("bf16", False)]
    if device.type == "cuda":
        settings += [("fp16", False), ("bf16", True)]
    return settings


@pytest.mark.filterwarnings("ignore:run.amp=bf16 on a CPU without native bf16")
def test_trains_on_the_device_in_each_precision(tmp_path, device):
    """run.device trains there in each precision the device has: the weights live on it, fp16 goes through the
    GradScaler, the losses and the final evaluation are finite, and the saved weights are finite and trained."""
    for amp, compiled in device_settings(device):
        name = f"{amp}-compiled" if compiled else amp
        overrides = [f"run.device={device}", f"run.amp={amp}", f"run.compile={compiled}", f"run.name={name}"]
        trainer = Trainer(config_from_dict(tiny(tmp_path), overrides))
        try:
            assert {p.device.type for p in trainer.model.parameters()} == {device.type}, name
            assert trainer.scaler.is_enabled() == (amp == "fp16"), name
            result = trainer.fit()
        finally:
            trainer.close()
        records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
        losses = [r["loss"] for r in records if r["kind"] == "train"]
        assert losses and all(math.isfinite(v) for v in losses), (name, losses)
        assert result.step == 4 and all(math.isfinite(v) for v in result.metrics.values()), (name, result.metrics)
        saved = weights(result.run_dir)
        assert all(torch.isfinite(v).all() for v in saved.values()), name
        assert saved["head.weight"].abs().max() > 0, f"{name}: the zero-initialised head never moved"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def test_resume_is_exact_on_the_dataloader_path(tmp_path):
    """An image folder (inception crop + flip per item, 2 DataLoader workers): stop after 3 steps, resume."""
    from PIL import Image

    gen = np.random.default_rng(0)
    for label in ("a", "b"):
        (tmp_path / "imgs" / label).mkdir(parents=True)
        for i in range(12):
            Image.fromarray(gen.integers(0, 255, (12, 12, 3), dtype=np.uint8)).save(
                tmp_path / "imgs" / label / f"{i}.png"
            )
    doc = tiny(
        tmp_path,
        data={"source": "folder", "root": str(tmp_path / "imgs"), "num_workers": 2},
        optim={"batch_size": 8},
        schedule={"steps": 6},
    )
    reference, resumed = stopped_and_resumed(doc)
    a, b = weights(reference.run_dir), weights(resumed.run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_two_process_gloo_matches_one_process(tmp_path):
    doc = tiny(
        tmp_path,
        optim={"name": "sgd", "lr": 0.1, "batch_size": 16, "accum_steps": 2},
        schedule={"steps": 5},
        data={"train_augment": "shift", "shift_pixels": 1},
    )
    single = train(config_from_dict(doc, ["run.name=single"]))
    config = write_yaml(tmp_path / "ddp.yaml", doc)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(_free_port()),
        "-m",
        "vitkit.cli",
        "train",
        str(config),
        "run.name=ddp",
        "run.device=cpu",  # gloo on the CPU, also where there is a GPU
    ]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final held-out accuracy" in proc.stdout and proc.stdout.count("final held-out") == 1  # rank 0 only
    a, b = weights(single.run_dir), weights(tmp_path / "runs" / "ddp")
    assert a["head.weight"].abs().max() > 1e-3  # it did train
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6


def test_a_non_finite_gradient_with_a_finite_loss_stops_before_the_step_is_applied(tmp_path):
    trainer = Trainer(config_from_dict(tiny(tmp_path, schedule={"steps": 6, "warmup_steps": 0})))
    try:
        batches = trainer.batches(0)
        trainer.train_step(batches)
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        moments = [s["exp_avg"].clone() for s in trainer.optimizer.state.values()]
        trainer.model.head.weight.register_hook(lambda g: g * math.inf)
        with pytest.raises(NonFiniteLossError, match=r"non-finite gradient norm \((inf|nan)\) at step 2"):
            trainer.train_step(batches)
        assert trainer.step == 1
        assert all(torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())  # nothing applied
        assert all(torch.equal(m, s["exp_avg"]) for m, s in zip(moments, trainer.optimizer.state.values(), strict=True))
    finally:
        trainer.close()


def test_a_records_images_per_s_counts_the_training_steps_not_the_evaluations_or_saves(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from vitkit.train import engine
    from vitkit.train.metrics import MetricsLog

    clock = [0.0]  # the engine's clock, moved only by the calls below
    monkeypatch.setattr(engine, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    run = {"log_every": 2, "eval_every": 3, "save_every": 5}
    trainer = Trainer(config_from_dict(tiny(tmp_path, schedule={"steps": 8, "warmup_steps": 0}, run=run)))

    def taking(seconds, f):
        def call(*args):
            clock[0] += seconds
            return f(*args)

        return call

    trainer.train_step = taking(1.0, trainer.train_step)  # a step takes a second, an evaluation 100, a save 1000
    trainer.evaluate = taking(100.0, trainer.evaluate)
    trainer.save = taking(1000.0, trainer.save)
    trainer.fit()
    records = [r for r in MetricsLog(trainer.run_dir).records() if r["kind"] == "train"]
    assert [r["step"] for r in records] == [2, 4, 6, 8]  # evaluations after steps 3 and 6, a save after step 5
    assert [r["images_per_s"] for r in records] == [16.0] * 4  # batches of 16, one a second
    assert records[-1]["time"] == 8 + 2 * 100 + 1000  # the run's wall time keeps them


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path, capsys):
    doc = tiny(
        tmp_path,
        optim={"name": "sgd", "lr": 1e30, "grad_clip": 0.0},
        schedule={"steps": 20, "warmup_steps": 0},
        run={"save_every": 1},
    )
    config = write_yaml(tmp_path / "nan.yaml", doc)
    with pytest.raises(NonFiniteLossError, match="non-finite"):  # the library raises; the CLI prints one line
        train(config_from_dict(doc, ["run.name=library", "run.save_every=0"]))
    assert cli_main(["train", str(config)]) == 1
    err = capsys.readouterr().err
    assert "non-finite loss" in err and "at step" in err and "Last good checkpoint" in err
    stopped_at = int(err.split("at step ")[1].split()[0])
    run = tmp_path / "runs" / "tiny"
    state_doc, _ = read_train_state(run / STATE_NAME)
    assert state_doc["step"] == stopped_at - 1 >= 1
    _, state, meta = read_native(run)
    assert meta["step"] == stopped_at - 1
    assert all(torch.isfinite(v).all() for v in state.values())


def test_finetune_from_official_npz_at_higher_resolution(tmp_path):
    pretrained = create_model(
        "vit_ti16",
        width=32,
        depth=2,
        num_heads=2,
        mlp_dim=64,
        img_size=16,
        patch_size=8,
        num_classes=7,
        representation_size=32,
    )
    with torch.no_grad():
        for p in pretrained.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # non-zero head and pre-logits
    np.savez(tmp_path / "pre.npz", **vitkit_to_official(pretrained))
    doc = tiny(
        tmp_path,
        data={"img_size": 32, "synthetic_classes": 3},
        run={"init_from": str(tmp_path / "pre.npz")},
        optim={"name": "sgd", "lr": 0.01, "weight_decay": 0.0},
        schedule={"steps": 2},
    )
    trainer = Trainer(config_from_dict(doc))
    model = trainer.model
    assert model.pre_logits is None and model.head.out_features == 3 and not model.head.weight.any()
    assert model.grid == (4, 4) and model.pos_embed.shape == (1, 17, 32)
    assert torch.equal(model.blocks[1].mlp.fc2.weight, pretrained.blocks[1].mlp.fc2.weight)
    assert torch.equal(model.pos_embed[:, 0], pretrained.pos_embed[:, 0])  # the class row is kept as is
    result = trainer.fit()
    trainer.close()
    assert result.step == 2 and read_native(result.run_dir)[0]["img_size"] == [32, 32]


def test_bad_inputs_fail_clearly_and_write_nothing(tmp_path, capsys):
    runs = tmp_path / "runs"
    other = create_model("vit_ti16", width=48, depth=1, num_heads=2, mlp_dim=64, img_size=16, patch_size=8)
    np.savez(tmp_path / "other.npz", **vitkit_to_official(other))
    cases = [
        (["optim.lrr=1"], "unknown config key 'optim.lrr'"),
        (["optim.lr=abc"], "expected a number"),
        (["data.source=folder", f"data.root={tmp_path / 'missing'}"], "missing"),
        ([f"run.init_from={tmp_path / 'other.npz'}"], "run.init_from"),
        ([f"run.init_from={tmp_path / 'nothing.npz'}"], "nothing.npz"),
    ]
    config = write_yaml(tmp_path / "t.yaml", tiny(tmp_path))
    for overrides, message in cases:
        assert cli_main(["train", str(config), *overrides]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
        assert not runs.exists(), overrides
    assert cli_main(["train", str(config), "run.resume=true"]) == 2
    assert "no train_state.safetensors" in capsys.readouterr().err


def test_overfits_one_batch():
    torch.manual_seed(0)
    model = create_model(
        "vit_ti16", width=48, depth=2, num_heads=3, mlp_dim=96, img_size=16, patch_size=4, num_classes=10, in_chans=1
    )
    x, y = torch.randn(16, 1, 16, 16), torch.randint(0, 10, (16,))  # noise with random labels: pure memorisation
    opt_cfg = config_from_dict({"optim": {"lr": 3e-3, "weight_decay": 0.0}}).optim
    opt = build_optimizer(model, opt_cfg)
    for _ in range(60):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert (model(x).argmax(-1) == y).float().mean() == 1.0 and loss.item() < 0.05


def test_short_digits_run_is_well_above_chance(tmp_path):
    cfg = load_config(
        None,
        [
            "schedule.steps=100",
            "schedule.epochs=none",
            "schedule.warmup_steps=5",
            "optim.batch_size=64",
            "optim.lr=3e-3",
            "model.depth=2",
            "model.width=48",
            "model.mlp_dim=96",
            "model.num_heads=3",
            f"run.out_dir={tmp_path}",
            "run.progress=false",
            "run.plots=true",
            "run.threads=1",
        ],
    )
    result = train(cfg)  # 100 steps of a 40k-parameter ViT: about 70% (chance: 10%)
    assert result.metrics["eval_images"] == 360 and result.metrics["eval_top1"] > 0.5
    assert math.isfinite(result.metrics["eval_loss"])
    assert (result.run_dir / "loss.png").stat().st_size > 0 and (result.run_dir / "accuracy.png").stat().st_size > 0


# ------------------------------------------------------------------------------------------------ plots
def _train_records(losses, first_step=1):
    return [
        {"kind": "train", "step": first_step + i, "epoch": 0, "loss": loss, "lr": 1e-3, "images_per_s": 100.0}
        for i, loss in enumerate(losses)
    ]


def _eval_record(step, loss=0.9, top1=0.5, top5=0.9):
    return {"kind": "eval", "step": step, "epoch": 1, "eval_loss": loss, "eval_top1": top1, "eval_top5": top5}


def test_loss_plot_says_when_the_train_loss_is_label_smoothed(tmp_path):
    from vitkit.train.metrics import loss_figure, plot_metrics

    records = [*_train_records([2.0, 1.6, 1.3, 1.1, 1.0]), _eval_record(5)]
    ax = loss_figure(records, label_smoothing=0.1).axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["train loss (label smoothing 0.1)", "eval loss"]
    ax = loss_figure(records).axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["train loss", "eval loss"]
    written = plot_metrics(records, tmp_path, label_smoothing=0.1)
    assert [p.name for p in written] == ["loss.png", "accuracy.png"] and all(p.stat().st_size > 0 for p in written)


def test_metric_plots_read_well_for_short_and_long_runs():
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.ticker import PercentFormatter

    from vitkit.train.metrics import accuracy_figure, loss_figure

    # a short run: every point is marked, steps are whole numbers, a loss within a decade stays linear
    short = [*_train_records([2.3, 2.0, 1.7]), _eval_record(3)]
    ax = loss_figure(short).axes[0]
    assert all(line.get_marker() not in (None, "", "None") for line in ax.get_lines())
    assert ax.get_yscale() == "linear" and all(float(t).is_integer() for t in ax.get_xticks())
    ax = accuracy_figure(short).axes[0]
    assert len(ax.get_lines()) == 2 and all(line.get_marker() not in (None, "", "None") for line in ax.get_lines())
    assert isinstance(ax.yaxis.get_major_formatter(), PercentFormatter) and all(
        float(t).is_integer() for t in ax.get_xticks()
    )

    # a long run late in training: plain lines, and tick labels without an offset or multiplier in the corner
    flat = [2.3021 + 1e-5 * (i % 7) for i in range(50)]
    fig = loss_figure(_train_records(flat, first_step=1_000_000))
    ax = fig.axes[0]
    assert all(line.get_marker() in (None, "", "None") for line in ax.get_lines())
    FigureCanvasAgg(fig).draw()
    assert ax.xaxis.get_offset_text().get_text() == "" and ax.yaxis.get_offset_text().get_text() == ""

    # a loss falling over more than a decade is drawn on a log scale
    ax = loss_figure(_train_records([2.3 * 0.8**i for i in range(30)])).axes[0]
    assert ax.get_yscale() == "log"


def test_training_passes_its_soft_targets_to_the_plots(tmp_path, monkeypatch):
    import vitkit.train.engine as engine

    seen = {}
    monkeypatch.setattr(engine, "plot_metrics", lambda records, out_dir, **kw: seen.update(kw))
    doc = tiny(tmp_path, schedule={"steps": 1}, optim={"label_smoothing": 0.1}, run={"plots": True})
    doc["data"] = {**doc["data"], "mixup_alpha": 0.2}
    train(config_from_dict(doc))
    assert seen == {"label_smoothing": 0.1, "mixup": 0.2, "cutmix": 0.0}


def test_training_configs_are_frozen_values():
    cfg = load_config("digits", ["optim.lr=3e-4"])
    assert cfg.run.name == "digits"  # the file's stem, set by replace
    for section, key, value in (
        ("run", "name", "x"),
        ("optim", "lr", 1.0),
        ("schedule", "steps", 3),
        ("mpp", "bits", 2),
    ):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(getattr(cfg, section), key, value)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optim = dataclasses.replace(cfg.optim, lr=1.0)
    changed = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=1e-2))
    assert changed.optim.lr == 1e-2 and cfg.optim.lr == 3e-4 and changed.run is cfg.run
    assert dataclasses.replace(cfg.schedule, steps=0).steps is None  # "not set", as older configs wrote it

    from harness import BenchConfig  # benchmarks/harness (benchmarks/ is on sys.path: conftest.py)

    bench = BenchConfig(model="vit_ti16", compare=["hf"], device="cpu")  # type: ignore[arg-type]
    assert bench.compare == ("hf",)  # a list given is kept as the declared tuple
    with pytest.raises(dataclasses.FrozenInstanceError):
        bench.batch_size = 4  # type: ignore[misc]


def test_train_augment_none_is_no_augmentation_not_the_sources_default():
    """data.train_augment=none means no augmentation (one of its choices); null leaves the source's default."""
    assert load_config("digits", ["data.train_augment=none"]).data.resolve().train_augment == "none"
    assert load_config("digits", ["data.train_augment=null"]).data.resolve().train_augment == "shift"
    assert load_config("digits", ["data.root=none"]).data.root is None  # elsewhere none is still null


@pytest.mark.parametrize("value, mode", [("false", None), ("true", "default"), ("reduce-overhead", "reduce-overhead")])
def test_run_compile_takes_a_torch_compile_mode(tmp_path, monkeypatch, value, mode):
    """run.compile=true compiles the training model in mode "default" with static shapes, a mode name in that mode;
    with CUDA graphs ("reduce-overhead") each step first tells torch a new step begins, so that a replay may
    overwrite the last step's graph outputs. A name torch.compile lacks is refused, naming the key."""
    calls, steps_begun = [], []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: calls.append(kw) or model)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: steps_begun.append(1))
    cfg = config_from_dict(tiny(tmp_path), [f"run.compile={value}"])
    trainer = Trainer(cfg)
    try:
        trainer.train_step(trainer.batches(0))
        trainer.train_step(trainer.batches(1))
    finally:
        trainer.close()
    assert calls == ([] if mode is None else [{"mode": mode, "dynamic": False}])
    assert len(steps_begun) == (2 if mode == "reduce-overhead" else 0)
    with pytest.raises(UserError, match=r"run.compile='fast': expected true, false or a torch.compile mode"):
        config_from_dict(tiny(tmp_path), ["run.compile=fast"])
