"""Masked patch prediction: corruption statistics, targets, the objective's shapes and losses, training and exact
resume, and the hand-off of an MPP run to fine-tuning and few-shot evaluation."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_train import stopped_and_resumed

from vitkit.checkpoint import read_native
from vitkit.cli import main as cli_main
from vitkit.data import DatasetInfo
from vitkit.errors import UserError
from vitkit.hub import load_model
from vitkit.models import VisionTransformer, model_from_config
from vitkit.train import config_from_dict, train
from vitkit.train.config import MPPConfig
from vitkit.train.model import init_from_checkpoint
from vitkit.train.mpp import (
    KEPT,
    MASKED,
    REPLACED,
    UNCHANGED,
    MaskedPatchPrediction,
    MPPModel,
    Targets,
    colour_classes,
    corrupt,
    draw_corruption,
)

TINY_VIT = dict(img_size=16, patch_size=4, width=32, depth=2, num_heads=2, mlp_dim=64, num_classes=4)


def mpp_doc(tmp_path, **sections) -> dict:
    doc = {
        "model": {"name": "vit_ti16", "patch_size": 4, "width": 32, "depth": 2, "num_heads": 2, "mlp_dim": 64},
        "data": {"source": "synthetic", "img_size": 16, "synthetic_size": 64, "synthetic_classes": 4},
        "optim": {"name": "adamw", "lr": 1e-3, "batch_size": 16},
        "schedule": {"steps": 6, "warmup_steps": 2},
        "run": {
            "out_dir": str(tmp_path / "runs"),
            "name": "mpp",
            "progress": False,
            "plots": False,
            "threads": 1,
            "objective": "mpp",
        },
    }
    for section, values in sections.items():
        doc[section] = {**doc.get(section, {}), **values}
    return doc


def info(in_chans: int = 3, mean=0.5, std=0.5) -> DatasetInfo:
    as_list = (lambda v: [v] * in_chans) if not isinstance(mean, list) else (lambda v: v)
    return DatasetInfo(4, [str(k) for k in range(4)], in_chans, 16, as_list(mean), as_list(std))


# ---------------------------------------------------------------------------------------------- corruption
def test_corruption_rates_match_the_paper_within_a_few_standard_errors():
    cfg = MPPConfig()
    torch.manual_seed(0)
    B, N = 4000, 16
    kind, _ = draw_corruption(B, N, cfg)
    chosen = kind != KEPT
    assert (chosen.sum(dim=1) == N // 2).all()  # exactly half of every image's patches
    n = int(chosen.sum())
    for value, share in ((MASKED, 0.8), (REPLACED, 0.1), (UNCHANGED, 0.1)):
        rate = float((kind == value).sum()) / n
        se = math.sqrt(share * (1 - share) / n)
        assert abs(rate - share) < 4 * se, (value, rate)
    # an odd patch count rounds half up; other ratios and shares follow the config
    kind, _ = draw_corruption(2000, 15, MPPConfig(mask_ratio=0.4, mask_share=0.5, random_share=0.5))
    assert ((kind != KEPT).sum(dim=1) == 6).all()
    n = int((kind != KEPT).sum())
    assert int((kind == UNCHANGED).sum()) == 0
    assert abs(float((kind == MASKED).sum()) / n - 0.5) < 4 * math.sqrt(0.25 / n)


def test_a_random_replacement_is_another_patch_of_the_same_image_never_itself():
    torch.manual_seed(1)
    B, N, D = 500, 9, 4
    kind, source = draw_corruption(B, N, MPPConfig(mask_share=0.0, random_share=1.0))
    assert (source != torch.arange(N)).all()
    counts = torch.bincount((source - torch.arange(N)).remainder(N).flatten(), minlength=N)
    assert counts[0] == 0 and counts[1:].min() > 0.8 * B * N / (N - 1)  # uniform over the N - 1 others
    tokens = torch.randn(B, N, D)
    mask_token = torch.full((D,), 7.0)
    out = corrupt(tokens, kind, source, mask_token)
    replaced = kind == REPLACED
    expected = tokens[torch.arange(B)[:, None].expand(B, N), source]  # the clean embedding of the source
    assert torch.equal(out[replaced], expected[replaced]) and torch.equal(out[~replaced], tokens[~replaced])
    kind, source = draw_corruption(B, N, MPPConfig())
    out = corrupt(tokens, kind, source, mask_token)
    assert (out[kind == MASKED] == 7.0).all()
    assert torch.equal(out[(kind == KEPT) | (kind == UNCHANGED)], tokens[(kind == KEPT) | (kind == UNCHANGED)])


def test_the_model_corrupts_patch_embeddings_before_the_position_embedding_never_the_class_token():
    torch.manual_seed(0)
    model = MPPModel(VisionTransformer(**TINY_VIT), MPPConfig())
    seen = {}
    embed_tokens = model.vit.embed_tokens

    def spy(tokens, grid):
        seen["tokens"] = tokens.detach().clone()
        out = embed_tokens(tokens, grid)
        seen["embedded"] = out.detach().clone()
        return out

    model.vit.embed_tokens = spy
    x = torch.randn(3, 3, 16, 16)
    clean, _ = model.vit.patch_embed(x)
    pred, kind = model(x)
    assert seen["tokens"].shape == clean.shape == (3, 16, 32)  # patches only: the class token is added after
    assert torch.equal(seen["tokens"][kind == KEPT], clean[kind == KEPT].detach())
    assert torch.allclose(
        seen["tokens"][kind == MASKED], model.mpp.mask_token.detach().expand(int((kind == MASKED).sum()), -1)
    )
    cls = model.vit.cls_token[0, 0] + model.vit.pos_embed[0, 0]
    assert torch.allclose(seen["embedded"][:, 0], cls.detach().expand(3, -1))
    assert pred.shape == (3 * 8, 512)  # one prediction per corrupted patch, 2^(3 x 3) colour classes


@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_every_trainable_parameter_gets_a_gradient_and_the_pooling_head_is_frozen(classifier, device):
    model = MPPModel(VisionTransformer(**{**TINY_VIT, "classifier": classifier}), MPPConfig()).to(device)
    pred, _ = model(torch.randn(2, 3, 16, 16).to(device))
    pred.square().sum().backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {n for n, p in model.named_parameters() if p.grad is not None} == trainable
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == {"vit.head.weight", "vit.head.bias"}


# ------------------------------------------------------------------------------------------------- targets
@pytest.mark.parametrize("mean, std", [(0.5, 0.5), ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
def test_constant_colour_patches_fall_in_their_exact_bins(mean, std):
    # every (r, g, b) level on a bin edge k / 8 (where rounding would bite) and at 1.0, one per 4x4 patch
    levels = torch.tensor([k / 8 for k in range(8)] + [1.0])
    torch.manual_seed(0)
    rgb = levels[torch.randint(0, 9, (2, 16, 3))]  # (B, N, 3) in [0, 1]
    pixels = rgb.reshape(2, 4, 4, 3).permute(0, 3, 1, 2).repeat_interleave(4, 2).repeat_interleave(4, 3)
    m = torch.tensor(mean if isinstance(mean, list) else [mean] * 3).view(1, 3, 1, 1)
    s = torch.tensor(std if isinstance(std, list) else [std] * 3).view(1, 3, 1, 1)
    images = (pixels - m) / s
    targets = Targets(MPPConfig(), m.flatten().tolist(), s.flatten().tolist(), (4, 4))(images)
    bins = (rgb * 8).round().long().clamp(max=7)
    assert torch.equal(targets, bins[..., 0] * 64 + bins[..., 1] * 8 + bins[..., 2])


def test_grey_images_have_eight_classes_at_three_bits():
    grey = torch.tensor([k / 8 for k in range(8)] + [1.0, 0.3, 0.99])
    classes = colour_classes(grey.view(-1, 1, 1, 1).expand(-1, 1, 4, 4), bits=3)
    assert classes.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 7, 2, 7]
    model = MPPModel(VisionTransformer(**{**TINY_VIT, "in_chans": 1}), MPPConfig())
    assert model.mpp.head.out_features == 8
    assert colour_classes(torch.full((1, 3, 4, 4), 0.0), bits=2).item() == 0
    assert colour_classes(torch.full((1, 3, 4, 4), 1.0), bits=2).item() == 63  # 2^(2 x 3) - 1


@pytest.mark.parametrize("target, out_dim", [("color", 512), ("color_grid", 16 * 512), ("pixels", 3 * 8 * 8)])
def test_each_target_has_the_right_shapes_and_initial_loss(target, out_dim):
    vit = VisionTransformer(**{**TINY_VIT, "patch_size": 8})  # 2x2 patches of 8x8 pixels, 4x4 cells of 2x2
    objective = MaskedPatchPrediction(MPPConfig(target=target), info())
    model = objective.wrap(vit)
    assert model.mpp.head.out_features == out_dim
    torch.manual_seed(0)
    x = torch.rand(5, 3, 16, 16) * 2 - 1
    pred, target_values, kind = objective.outputs(model, x)
    M = 5 * 2  # half of 4 patches per image
    assert pred.shape == (M, out_dim) and kind.shape == (5, 4)
    loss = objective.criterion(pred, target_values)
    if target == "color":
        assert target_values.shape == (M,) and target_values.dtype == torch.long
    if target == "color_grid":
        assert target_values.shape == (M, 16) and target_values.max() < 512
        # a cell is 2x2 pixels: its class is that of the cell's mean colour
        cell = (x[0, :, :2, :2] * 0.5 + 0.5).clamp(0, 1)
        full = objective.targets(x)
        assert full[0, 0, 0] == colour_classes(cell, 3)
    if target in ("color", "color_grid"):  # a zero head predicts uniformly: log K
        assert loss.item() == pytest.approx(math.log(512), rel=1e-6)
    else:  # the normalised patch itself; a zero head's error is its mean square
        assert target_values.shape == (M, 3 * 64)
        assert torch.equal(objective.targets(x)[0, 0], x[0, :, :8, :8].flatten())
        assert loss.item() == pytest.approx(float(target_values.pow(2).mean()), rel=1e-6)
    right, total = objective.correct(pred, target_values)
    assert total == (M * 16 if target == "color_grid" else M) and 0 <= right <= total


def test_config_checks_ratios_and_shares():
    for bad, message in (
        ({"mask_ratio": 0.0}, "mask_ratio"),
        ({"mask_ratio": 1.5}, "mask_ratio"),
        ({"mask_share": 0.8, "random_share": 0.3}, "sum to at most 1"),
        ({"random_share": -0.1}, "random_share"),
        ({"target": "colour"}, "expected one of color, color_grid, pixels"),
        ({"bits": 0}, "bits"),
    ):
        with pytest.raises(UserError, match=message):
            MPPConfig(**bad)
    with pytest.raises(UserError, match="did you mean mpp.mask_ratio"):
        config_from_dict({}, ["mpp.mask_rato=0.5"])
    with pytest.raises(UserError, match="does not divide"):
        MPPModel(VisionTransformer(**{**TINY_VIT, "patch_size": 2}), MPPConfig(target="color_grid"))


# ------------------------------------------------------------------------------------------------ training
def test_loss_falls_on_a_tiny_run(tmp_path):
    doc = mpp_doc(
        tmp_path,
        data={"source": "digits"},  # grey: 8 colour classes, from log 8 = 2.08 at the start
        schedule={"steps": 60, "warmup_steps": 5},
        run={"log_every": 10},
        optim={"lr": 3e-3},
    )
    result = train(config_from_dict(doc))
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert losses[-1] < 0.8 * losses[0], losses
    assert set(result.metrics) == {"eval_mpp_loss", "eval_mpp_acc", "eval_images"}


def test_resume_of_an_mpp_run_is_exact(tmp_path):
    doc = mpp_doc(tmp_path, model={"dropout": 0.1}, mpp={"target": "color_grid", "grid": 2})
    reference, resumed = stopped_and_resumed(doc)
    a, b = read_native(reference.run_dir)[1], read_native(resumed.run_dir)[1]
    assert any(k.startswith("mpp.") for k in a) and a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.metrics == reference.metrics


# ------------------------------------------------------------------------------------------------ hand-off
@pytest.fixture(scope="module")
def mpp_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("mpp")
    return train(config_from_dict(mpp_doc(tmp_path, data={"source": "digits"}))).run_dir


def test_an_mpp_run_saves_a_plain_vit_plus_its_head_which_loaders_drop(mpp_run):
    config, state, meta = read_native(mpp_run)
    assert meta["objective"] == "mpp" and meta["drop_on_load"] == ["mpp."] and meta["mpp"]["bits"] == 3
    assert {k for k in state if k.startswith("mpp.")} == {"mpp.mask_token", "mpp.head.weight", "mpp.head.bias"}
    model, report = load_model(mpp_run, return_report=True)
    assert isinstance(model, VisionTransformer) and report.ok
    assert sorted(report.dropped) == ["mpp.head.bias", "mpp.head.weight", "mpp.mask_token"]
    plain = model_from_config(config)
    plain.load_state_dict({k: v for k, v in state.items() if not k.startswith("mpp.")})  # strict: a plain ViT


def test_fine_tuning_an_mpp_run_drops_its_head_and_reports_it(mpp_run, tmp_path, capsys):
    vit = VisionTransformer(**{**TINY_VIT, "in_chans": 1, "num_classes": 10})
    report = init_from_checkpoint(vit, str(mpp_run), 10)
    assert "dropped: mpp.head.bias, mpp.head.weight, mpp.mask_token" in report
    assert not vit.head.weight.any() and vit.head.out_features == 10
    assert torch.equal(vit.blocks[0].attn.qkv.weight, read_native(mpp_run)[1]["blocks.0.attn.qkv.weight"])
    out = str(tmp_path / "ft")
    args = ["finetune", str(mpp_run), "--data", "digits", "schedule.steps=2", "run.progress=false"]
    assert cli_main([*args, f"run.out_dir={out}", "run.plots=false", "data.train_fraction=0.1"]) == 0
    text = capsys.readouterr().out
    assert "dropped: mpp.head.bias" in text and "143 train" in text and "final held-out accuracy" in text


def test_fewshot_runs_on_an_mpp_checkpoint(mpp_run, tmp_path, capsys):
    out = tmp_path / "fewshot.json"
    assert cli_main(["fewshot", str(mpp_run), "--shots", "1", "2", "--seeds", "1", "--out", str(out)]) == 0
    assert out.is_file() and "few-shot linear accuracy" in capsys.readouterr().out


def test_train_fraction_keeps_a_stratified_subset():
    from vitkit.data import DataConfig, build_datasets

    train_set, test_set, _ = build_datasets(DataConfig(source="digits", train_fraction=0.1))
    counts = torch.bincount(train_set.labels, minlength=10)
    assert len(train_set) == 143 and len(test_set) == 360 and counts.min() >= 14 and counts.max() <= 15
    again, _, _ = build_datasets(DataConfig(source="digits", train_fraction=0.1))
    assert torch.equal(again.images, train_set.images)  # the same subset for every run with this split_seed
    with pytest.raises(UserError, match="train_fraction"):
        build_datasets(DataConfig(train_fraction=0.0))


def test_mpp_trains_under_two_process_ddp(tmp_path):
    """The ViT's head and pooling take no part in MPP (frozen), so DDP waits for no gradient that never comes."""
    import os
    import socket
    import subprocess
    import sys

    import yaml

    doc = mpp_doc(tmp_path, schedule={"steps": 3}, optim={"batch_size": 16, "accum_steps": 2})
    config = tmp_path / "ddp.yaml"
    config.write_text(yaml.safe_dump(doc))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
    cmd += ["-m", "vitkit.cli", "train", str(config), "run.name=ddp", "run.device=cpu"]  # gloo, also beside a GPU
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("final held-out masked patch prediction") == 1  # rank 0 only


@pytest.mark.parametrize("num_patches, ratio, corrupted", [(9, 0.5, 5), (25, 0.5, 13), (10, 0.25, 3), (7, 0.5, 4)])
def test_an_odd_patch_count_rounds_the_corrupted_count_half_up(num_patches, ratio, corrupted):
    # round(ratio x N) with halves rounded up (9 patches at 50% -> 5), never floored (4) nor rounded to even (4)
    kind, _ = draw_corruption(64, num_patches, MPPConfig(mask_ratio=ratio), generator=torch.Generator().manual_seed(0))
    assert ((kind != KEPT).sum(dim=1) == corrupted).all()
