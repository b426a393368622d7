"""A sweep's probes and its from-scratch baseline: few-shot accuracy equal to ``vitkit fewshot``'s on the same
model, the attention probe against a closed form and blind to a class-token model's untrained last-layer queries, the
parts probe against plain torch and a model that always picks the wrong side, a ResNet's blank attention, and a
``pretrain: false`` cell that trains the finetune stage alone from the first stage's model settings."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import save_file
from torch import nn

from vitkit.cli import main
from vitkit.data import TensorImageDataset
from vitkit.data.procedural import CLASS_NAMES, EVAL_STREAM, LABEL_PARTS, RELATIONS, SHAPES, ProceduralShapes
from vitkit.errors import UserError
from vitkit.hub import load_model
from vitkit.inspect.attention import attention_distance
from vitkit.models.vit import VisionTransformer
from vitkit.sweep import load_spec, run_sweep
from vitkit.sweep.probes import (
    ATTENTION_FILE,
    FEWSHOT_FILE,
    PARTS_FILE,
    Probes,
    attention_figure,
    label_part_accuracy,
    measured_groups,
    probe_metric,
    run_probes,
)
from vitkit.sweep.run import plan_cell, run_status

TINY = {
    "model": {"name": "vit_ti16", "patch_size": 4, "width": 16, "depth": 2, "num_heads": 2, "mlp_dim": 32},
    "data": {"source": "digits"},
    "optim": {"name": "adamw", "lr": 1e-3, "batch_size": 32},
    "schedule": {"steps": 4, "warmup_steps": 0},
    "run": {"log_every": 1, "eval_every": 0, "save_every": 0, "plots": False, "threads": 1},
}


def _spec(path: Path, **changes) -> Path:
    doc = {"config": TINY, "grid": {"model.depth": [1, 2]}, "seeds": [0], "metrics": ["eval_top1"], **changes}
    path.write_text(yaml.safe_dump(doc))
    return path


def test_the_fewshot_probe_writes_what_vitkit_fewshot_writes(tmp_path):
    spec = _spec(
        tmp_path / "s.yaml",
        grid={"model.depth": [1]},
        metrics=["fewshot.5shot", "fewshot.10shot"],
        probes={"fewshot": {"data": "digits", "shots": [5, 10], "seeds": 2}},
    )
    result = run_sweep(spec, tmp_path / "out", log=lambda line: None)
    run_dir = tmp_path / "out" / "depth-1_seed-0"
    probe = json.loads((run_dir / FEWSHOT_FILE).read_text())
    assert main(["fewshot", str(run_dir), "--data", "digits", "--shots", "5", "10", "--seeds", "2",
                 "--out", str(tmp_path / "cli.json")]) == 0  # fmt: skip
    cli = json.loads((tmp_path / "cli.json").read_text())
    assert probe["results"] == cli["results"] and probe["data"] == cli["data"]
    assert result.rows[0].mean["fewshot.10shot"] == cli["results"]["10"]["mean"]
    assert 0.1 < cli["results"]["10"]["mean"] <= 1.0


def _uniform_attention(model: VisionTransformer) -> None:
    """Zero query and key weights: every query attends to every key equally."""
    with torch.no_grad():
        for block in model.blocks:
            qkv = block.attn.qkv
            width = qkv.weight.shape[1]
            qkv.weight[: 2 * width].zero_()
            qkv.bias[: 2 * width].zero_()


def test_the_attention_probe_gives_the_closed_form_of_uniform_attention(tmp_path):
    """Uniform attention over a 4x4 grid of 4-pixel patches: the mean distance is the mean over all ordered pairs
    of patch centres (self pairs included) of their distance, in pixels, in every layer and head."""
    spec = _spec(tmp_path / "s.yaml", grid={"model.depth": [2]}, metrics=["eval_top1"])
    run_sweep(spec, tmp_path / "out", log=lambda line: None)
    run_dir = tmp_path / "out" / "depth-2_seed-0"
    model = load_model(run_dir)
    _uniform_attention(model)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(run_dir / "model.safetensors"))
    run_probes(Probes(attention_images=7), run_dir)
    centres = [(4 * r, 4 * c) for r in range(4) for c in range(4)]
    expected = sum(math.dist(a, b) for a, b in itertools.product(centres, centres)) / len(centres) ** 2
    doc = json.loads((run_dir / ATTENTION_FILE).read_text())
    assert doc["images"] == 7 and doc["uniform"] == pytest.approx(expected, rel=1e-9)
    assert doc["untrained_layers"] == [1] and doc["distance"][1] is None  # a class-token model's last layer
    assert doc["distance"][0] == pytest.approx([expected] * 2, rel=1e-5)
    assert probe_metric(run_dir, "attention.layer0") == pytest.approx(expected, rel=1e-5)
    assert probe_metric(run_dir, "attention.layer1") is None
    sim = torch.tensor(doc["position_similarity"])  # (4, 4, 4, 4) cosine similarities: 1 on the diagonal
    assert sim.shape == (4, 4, 4, 4) and all(sim[r, c, r, c] == pytest.approx(1.0) for r in range(4) for c in range(4))


def test_the_attention_metrics_read_the_probe_file_by_hand(tmp_path):
    """layer<i> is the mean over heads, spread<i> the farthest head minus the nearest, local<i> the share of heads
    under half of uniform attention's distance, rise the last measured layer's mean minus the first's; a layer not
    measured is blank, one past the model's last an error naming the file."""
    doc = {"images": 4, "distance": [[2.0, 4.5, 6.0], [2.9, 3.1, 7.0], None], "untrained_layers": [2], "uniform": 6.0}
    (tmp_path / ATTENTION_FILE).write_text(json.dumps(doc))
    expected = {"layer0": 12.5 / 3, "spread0": 4.0, "local0": 1 / 3, "layer1": 13 / 3, "local1": 1 / 3, "rise": 0.5 / 3}
    assert {name: probe_metric(tmp_path, f"attention.{name}") for name in expected} == pytest.approx(expected)
    assert probe_metric(tmp_path, "attention.layer2") is None and probe_metric(tmp_path, "attention.local2") is None
    with pytest.raises(UserError, match=r"attention.json has 3 layers \(0 to 2\)"):
        probe_metric(tmp_path, "attention.spread3")
    (tmp_path / ATTENTION_FILE).write_text(json.dumps({k: v for k, v in doc.items() if k != "uniform"}))
    with pytest.raises(UserError, match=r"attention.json has no uniform attention distance; delete it and rerun"):
        probe_metric(tmp_path, "attention.local0")
    (tmp_path / ATTENTION_FILE).write_text(json.dumps({**doc, "distance": [[1.0, 3.0], None]}))
    assert probe_metric(tmp_path, "attention.rise") is None  # one layer measured: no growth to speak of
    (tmp_path / ATTENTION_FILE).write_text(json.dumps({"skipped": "ResNetV2 has no attention"}))
    assert probe_metric(tmp_path, "attention.rise") is None


def test_the_attention_figure_has_a_dot_per_head_and_seed_and_no_depth_tick_past_the_last_measured_layer(tmp_path):
    """Two class-token runs of three layers (the last not measured): ticks at layers 1-2 only, a dot for each head of
    each seed at its file's distance; with a GAP group measured to layer 3 beside them, ticks at 1-3."""
    token = [[[2.0, 6.0], [5.0, 7.0], None], [[3.0, 4.0], [6.5, 7.5], None]]
    gap = [[1.0, 2.0], [3.0, 4.0], [8.0, 9.0]]
    groups = []
    for label, runs in (("token", token), ("gap", [gap])):
        dirs = []
        for seed, distance in enumerate(runs):
            dirs.append(tmp_path / f"{label}_seed-{seed}")
            dirs[-1].mkdir()
            doc = {"images": 4, "distance": distance, "untrained_layers": [2] * (label == "token"), "uniform": 6.0}
            (dirs[-1] / ATTENTION_FILE).write_text(json.dumps(doc))
        groups.append((label, {"model.classifier": label}, dirs))

    ax = attention_figure("s", measured_groups(groups[:1])).axes[0]
    assert list(ax.get_xticks()) == [1, 2] and ax.get_xlim()[1] < 3
    offsets = [np.ma.filled(c.get_offsets(), math.nan) for c in ax.collections]
    dots = sorted((round(float(x)), float(y)) for xy in offsets for x, y in xy if not math.isnan(y))
    want = sorted((layer + 1, d) for run in token for layer, row in enumerate(run) if row for d in row)
    assert dots == want
    (mean,) = [line for line in ax.get_lines() if line.get_label().startswith("token")]
    assert list(mean.get_ydata()[:2]) == [3.75, 6.5] and math.isnan(mean.get_ydata()[2])  # over heads and seeds
    assert "untrained layers left out" in ax.get_title()
    assert ax.get_ylim() == (0, pytest.approx(1.1 * 7.5))  # from zero to a tenth above the farthest head

    ax = attention_figure("s", measured_groups(groups)).axes[0]
    assert list(ax.get_xticks()) == [1, 2, 3] and [t.get_text() for t in ax.get_legend().get_texts()] == [
        "classifier=token (n=2)",
        "classifier=gap (n=1)",
        "uniform attention",
        "half of uniform: local heads below",
    ]
    local = [line for line in ax.get_lines() if line.get_linestyle() == ":"]  # dotted, at half of uniform
    assert len(local) == 1 and list(local[0].get_ydata()) == [pytest.approx(3.0)] * 2
    (groups[0][2][0] / ATTENTION_FILE).write_text(json.dumps({"distance": token[0], "uniform": 9.0}))
    assert attention_figure("s", measured_groups(groups[:1])).axes[0].get_ylim()[1] > 9.0  # above uniform too


SHAPES_DATA = {"source": "shapes", "img_size": 16, "num_images": 128, "eval_images": 48}


@pytest.fixture(scope="module")
def shapes_sweep(tmp_path_factory):
    """A class-token and a GAP ViT, 4 steps on 16 px shapes, measured by the attention and parts probes."""
    tmp = tmp_path_factory.mktemp("shapes")
    spec = _spec(
        tmp / "s.yaml",
        config={**TINY, "data": SHAPES_DATA},
        grid={"model.classifier": ["token", "gap"]},
        metrics=[
            "attention.layer0",
            "attention.layer1",
            "attention.spread0",
            "attention.rise",
            "parts.shape",
            "parts.side",
        ],
        probes={"attention": {"images": 8}, "parts": {}},
    )
    result = run_sweep(spec, tmp / "out", log=lambda line: None)
    assert result.failed == {}
    return result


def _held_out_shapes(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n held-out images of SHAPES_DATA, drawn here, and their labels."""
    data = ProceduralShapes(n, stream=EVAL_STREAM, img_size=16)
    return torch.stack([data[i][0] for i in range(n)]), data.labels


def test_a_class_token_models_last_layer_is_not_measured_and_a_gap_models_every_layer_is(shapes_sweep):
    token, gap = (json.loads((shapes_sweep.out / f"classifier-{c}_seed-0" / ATTENTION_FILE).read_text())
                  for c in ("token", "gap"))  # fmt: skip
    assert token["untrained_layers"] == [1] and token["distance"][1] is None and len(token["distance"][0]) == 2
    assert gap["untrained_layers"] == [] and [len(row) for row in gap["distance"]] == [2, 2]
    rows = {row.values["model.classifier"]: row.mean for row in shapes_sweep.rows}
    assert rows["token"]["attention.layer1"] is None  # a blank cell in the table
    assert rows["token"]["attention.layer0"] == pytest.approx(sum(token["distance"][0]) / 2)
    assert rows["gap"]["attention.layer1"] == pytest.approx(sum(gap["distance"][1]) / 2)
    assert rows["gap"]["attention.spread0"] == pytest.approx(abs(gap["distance"][0][0] - gap["distance"][0][1]))
    assert rows["gap"]["attention.rise"] == pytest.approx(sum(gap["distance"][1]) / 2 - sum(gap["distance"][0]) / 2)
    assert rows["token"]["attention.rise"] is None  # one layer measured
    assert shapes_sweep.out / "attention_distance.png" in shapes_sweep.files


def test_the_attention_probe_is_blind_to_the_untrained_queries_of_a_class_token_models_last_layer(
    shapes_sweep, tmp_path
):
    """Turn the last block's query weights only where the class token's queries do not reach: the model's outputs
    stay, its last layer's patch-query attention changes, and the probe records the same."""
    run_dir = tmp_path / "token"
    shutil.copytree(shapes_sweep.out / "classifier-token_seed-0", run_dir)
    recorded = (run_dir / ATTENTION_FILE).read_text()
    (run_dir / ATTENTION_FILE).unlink()
    model = load_model(run_dir).eval()
    images, _ = _held_out_shapes(8)  # the probe's
    block, width = model.blocks[-1], model.config.width
    seen = []
    hook = block.norm1.register_forward_hook(lambda module, args, out: seen.append(out[:, 0]))
    with torch.no_grad():
        logits = model(images)
    hook.remove()
    basis, _ = torch.linalg.qr(seen[0].T.double())  # (D, 8): the class token's inputs to the last attention
    away = torch.eye(width, dtype=torch.float64) - basis @ basis.T  # what of an input the class token never has
    turn = 3 * torch.randn(width, width, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    before = attention_distance(model, images)
    with torch.no_grad():
        block.attn.qkv.weight[:width] += (turn @ away).float()  # the query rows
        torch.testing.assert_close(model(images), logits, rtol=0, atol=1e-5)
    after = attention_distance(model, images)
    assert (after[:-1] == before[:-1]).all() and abs(after[-1] - before[-1]).max() > 0.1
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(run_dir / "model.safetensors"))
    run_probes(Probes(attention_images=8), run_dir)
    assert (run_dir / ATTENTION_FILE).read_text() == recorded


def test_the_parts_probe_scores_shape_and_side_as_plain_torch_does(shapes_sweep):
    run_dir = shapes_sweep.out / "classifier-token_seed-0"
    doc = json.loads((run_dir / PARTS_FILE).read_text())
    images, labels = _held_out_shapes(48)  # every held-out image
    with torch.no_grad():
        pred = load_model(run_dir).eval()(images).argmax(dim=1)
    expected = {
        "top1": (pred == labels).double().mean().item(),
        "shape": (pred // 2 == labels // 2).double().mean().item(),
        "side": (pred % 2 == labels % 2).double().mean().item(),
    }
    assert doc == {"images": 48, "accuracy": expected, "values": {"shape": 5, "side": 2}}  # chance: 1/5, 1/2
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])  # the run's own evaluation
    assert last["kind"] == "eval" and last["eval_images"] == 48 and last["eval_top1"] == pytest.approx(expected["top1"])
    token = next(row.mean for row in shapes_sweep.rows if row.values["model.classifier"] == "token")
    assert token["parts.shape"] == expected["shape"] and token["parts.side"] == expected["side"]


class _WrongSide(nn.Module):
    """Each image's shape with the marker on the wrong side, from the labels of the images in the order shown."""

    def __init__(self, labels: torch.Tensor) -> None:
        super().__init__()
        self.labels, self.seen, self.modes = labels, 0, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.modes.append((self.training, torch.is_inference_mode_enabled()))
        y = self.labels[self.seen : self.seen + len(x)]
        self.seen += len(x)
        return F.one_hot(2 * (y // 2) + 1 - y % 2, len(CLASS_NAMES)).float()


def test_a_model_that_always_picks_the_wrong_side_gets_every_shape_and_no_side():
    names = [f"{SHAPES[LABEL_PARTS['shape'](y)]}_{RELATIONS[LABEL_PARTS['side'](y)]}" for y in torch.arange(10)]
    assert names == CLASS_NAMES  # the parts name the classes
    data = ProceduralShapes(30, stream=EVAL_STREAM, img_size=8)
    model = _WrongSide(data.labels).train()
    doc = label_part_accuracy(model, data, max_images=25, batch_size=10)
    assert doc == {
        "images": 25,
        "accuracy": {"top1": 0.0, "shape": 1.0, "side": 0.0},
        "values": {"shape": 5, "side": 2},
    }
    assert model.seen == 25 and model.modes == [(False, True)] * 3 and model.training  # eval mode, then restored
    digits_like = TensorImageDataset(torch.zeros(4, 3, 8, 8), torch.arange(4))
    with pytest.raises(UserError, match="probes.parts: the labels of TensorImageDataset do not factor"):
        label_part_accuracy(model, digits_like)


def test_a_resnet_has_no_attention_and_its_metric_is_blank(tmp_path):
    resnet = {**TINY, "model": {"name": "bit_r50x1", "layers": [1], "width_factor": 0.5}}
    spec = _spec(
        tmp_path / "s.yaml",
        config=resnet,
        grid={"model.width_factor": [0.5]},
        metrics=["eval_top1", "attention.layer0"],
        probes={"attention": {"images": 4}},
    )
    result = run_sweep(spec, tmp_path / "out", log=lambda line: None)
    (run_dir,) = [d for d in (tmp_path / "out").iterdir() if d.is_dir()]
    assert "skipped" in json.loads((run_dir / ATTENTION_FILE).read_text())
    assert result.rows[0].mean["attention.layer0"] is None and result.rows[0].mean["eval_top1"] is not None


def test_a_cell_that_does_not_pretrain_trains_the_finetune_stage_alone_with_the_same_model(tmp_path):
    spec_path = _spec(
        tmp_path / "s.yaml",
        grid={},
        cells=[{"run.objective": "classification"}, {"pretrain": False}],
        overrides=["model.width=24"],
        metrics=["finetune.eval_top1"],
        finetune={"config": {"data": {"source": "digits", "train_fraction": 0.5}},
                  "overrides": ["schedule.steps=3", "optim.name=adamw", "optim.lr=0.001", "run.plots=false"]},
    )  # fmt: skip
    spec = load_spec(spec_path)
    pre, scratch = (plan_cell(spec, cell, tmp_path / "out", threads=1) for cell in spec.expand())
    assert pre.first is not None and scratch.first is None
    assert any(o.startswith("run.init_from=") for o in pre.finetune[1])
    assert not any(o.startswith("run.init_from=") for o in scratch.finetune[1])
    result = run_sweep(spec, tmp_path / "out", log=lambda line: None)
    assert [r.n for r in result.rows] == [1, 1] and all(r.mean["finetune.eval_top1"] is not None for r in result.rows)
    out = tmp_path / "out"
    assert not (out / "pretrain-false_seed-0").exists()
    assert run_status(out / "pretrain-false_seed-0--finetune") == "finished"
    models = [json.loads((out / f"{n}--finetune" / "config.json").read_text())["model"]
              for n in ("objective-classification_seed-0", "pretrain-false_seed-0")]  # fmt: skip
    assert models[0] == models[1] and models[0]["width"] == 24 and models[0]["depth"] == 2
    rerun = run_sweep(spec, out, log=lambda line: None)  # finished: nothing runs again
    assert rerun.actions == {
        "objective-classification_seed-0": ["skipped", "skipped"],
        "pretrain-false_seed-0": ["skipped"],
    }


def test_probe_and_baseline_specs_are_checked(tmp_path):
    with pytest.raises(UserError, match="fewshot"):
        load_spec(_spec(tmp_path / "a.yaml", metrics=["fewshot.5shot"]))  # no probe
    with pytest.raises(UserError, match="attention.spread<i>, attention.local<i> or attention.rise"):
        load_spec(_spec(tmp_path / "b.yaml", metrics=["attention.last"], probes={"attention": {"images": 4}}))
    for name in ("layer12", "spread0", "local3", "rise"):  # the names the probe reads (each checked in a test above)
        load_spec(_spec(tmp_path / "b.yaml", metrics=[f"attention.{name}"], probes={"attention": {"images": 4}}))
    with pytest.raises(UserError, match="probes.attention"):
        load_spec(_spec(tmp_path / "c.yaml", probes={"attention": {"images": 0}}))
    with pytest.raises(UserError, match="probes"):
        load_spec(_spec(tmp_path / "d.yaml", probes={"linear": {}}))
    with pytest.raises(UserError, match="needs a finetune stage"):
        load_spec(_spec(tmp_path / "e.yaml", grid={}, cells=[{"pretrain": False}]))
    with pytest.raises(UserError, match="'parts.shape': not one of the parts probe's"):
        load_spec(_spec(tmp_path / "f.yaml", metrics=["parts.shape"]))  # no probe
    with pytest.raises(UserError, match="parts.colour"):
        load_spec(_spec(tmp_path / "g.yaml", metrics=["parts.colour"], probes={"parts": {}}))
    with pytest.raises(UserError, match="probes.parts"):
        load_spec(_spec(tmp_path / "h.yaml", probes={"parts": {"images": 0}}))
    spec = load_spec(_spec(tmp_path / "i.yaml", metrics=["parts.side"], probes={"parts": {"images": 9}}))
    assert spec.probes == Probes(parts=True, parts_images=9) and spec.probes.files == [PARTS_FILE]
