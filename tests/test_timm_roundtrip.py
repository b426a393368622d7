"""timm files written by vitkit read back as the same model: config.json beside the weights, as timm's hub writes it.

A bare timm state dict does not say its head count or GELU; those are guessed, and the guess is warned about
and reported rather than silently building another function.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_checkpoint import randomized  # noise on every parameter, zero-initialised ones too

from vitkit import UserError, VisionTransformer
from vitkit.checkpoint import read_checkpoint, save_pretrained
from vitkit.checkpoint.hf import save_hf
from vitkit.checkpoint.loader import convert, detect_format
from vitkit.checkpoint.timm import vitkit_to_timm
from vitkit.cli import main as cli_main
from vitkit.hub import load_model, load_pretrained

TINY = dict(img_size=32, patch_size=8, width=32, depth=2, num_heads=4, mlp_dim=64, num_classes=5)

# widths whose head count the registry does not know, both GELUs, both classifiers, pre-logits, eps, a hybrid
CASES = {
    "w48_h3_tanh": dict(TINY, width=48, num_heads=3, mlp_dim=100, gelu="tanh"),
    "w80_h5_gap": dict(TINY, width=80, num_heads=5, mlp_dim=160, classifier="gap", gelu="exact"),
    "w64_h4_prelogits": dict(TINY, width=64, num_heads=4, mlp_dim=128, representation_size=24, gelu="tanh"),
    "w48_h6_eps_rect": dict(TINY, width=48, num_heads=6, img_size=(32, 48), patch_size=(8, 16), ln_eps=1e-12),
    "off_grid_dynamic": dict(TINY, num_heads=2, img_size=36, dynamic_img_size=True, num_classes=0),
    "hybrid": dict(TINY, patch_size=1, resnet_layers=(1, 1), resnet_width=0.5, gelu="tanh"),
}


def build(**fields) -> VisionTransformer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # an image size off the patch grid is warned about on build
        return randomized(VisionTransformer(**fields))


def logits(model: torch.nn.Module) -> torch.Tensor:
    h, w = model.config.img_size
    x = torch.randn(2, model.config.in_chans, h, w, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(x)


def load_quietly(path: Path, **kwargs):
    """load_model, failing on any warning that a config field was guessed."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = load_model(path, **kwargs)
    assert not [w for w in caught if "guessed" in str(w.message)], [str(w.message) for w in caught]
    return out


def bare_timm_file(tmp_path: Path, model: torch.nn.Module) -> Path:
    (tmp_path / "bare").mkdir()
    path = tmp_path / "bare" / "vit.safetensors"
    save_file(vitkit_to_timm(model), str(path))
    return path


# -------------------------------------------------------------------------------------------- round trip
@pytest.mark.filterwarnings("ignore:ViTConfig. img_size .* is not a multiple")
@pytest.mark.parametrize("case", CASES)
def test_convert_to_timm_round_trips_exactly(tmp_path, case):
    model = build(**CASES[case])
    src = save_pretrained(model, tmp_path / "src")
    written = convert(src, tmp_path / "timm", to="timm")
    assert written == tmp_path / "timm" / "model.safetensors" and (tmp_path / "timm" / "config.json").is_file()
    for path in (tmp_path / "timm", written):  # the hub directory and the weights file inside it
        loaded, report = load_quietly(path, return_report=True)
        assert loaded.config == model.config
        assert report.ok and not report.guessed and not report.from_caller
        assert torch.equal(logits(loaded), logits(model))


def test_cli_convert_to_a_safetensors_file_writes_config_beside_it(tmp_path, capsys):
    """The reported case: width 64, 4 heads, tanh GELU came back with 1 head and exact GELU."""
    model = build(**dict(TINY, width=64, num_heads=4, mlp_dim=128, gelu="tanh"))
    src = save_pretrained(model, tmp_path / "src")
    dst = tmp_path / "out" / "vit.safetensors"
    assert cli_main(["convert", str(src), str(dst), "--to", "timm"]) == 0
    assert capsys.readouterr().out.split()[1] == str(dst)
    assert (tmp_path / "out" / "config.json").is_file()
    loaded = load_quietly(dst)
    assert (loaded.config.num_heads, loaded.config.gelu) == (4, "tanh")
    assert torch.equal(logits(loaded), logits(model))


# ---------------------------------------------------------------------------------------------- config.json
def test_config_json_is_timms_hub_config(tmp_path):
    model = build(**CASES["w64_h4_prelogits"])
    meta = {"class_names": list("abcde"), "mean": [0.4, 0.5, 0.6], "std": [0.2, 0.3, 0.4], "crop_fraction": 0.875}
    src = save_pretrained(model, tmp_path / "src", metadata=meta)
    convert(src, tmp_path / "t", to="timm")
    doc = json.loads((tmp_path / "t" / "config.json").read_text())
    assert doc["architecture"] == "vision_transformer"
    assert doc["model_args"] == dict(
        img_size=32,
        patch_size=8,
        in_chans=3,
        num_classes=5,
        embed_dim=64,
        depth=2,
        num_heads=4,
        mlp_ratio=2.0,
        qkv_bias=True,
        class_token=True,
        global_pool="token",
        fc_norm=False,
        act_layer="gelu_tanh",
        representation_size=24,
    )
    assert (doc["num_classes"], doc["global_pool"], doc["num_features"]) == (5, "token", 24)
    cfg = doc["pretrained_cfg"]
    assert cfg["input_size"] == [3, 32, 32] and cfg["interpolation"] == "bilinear"
    assert (cfg["mean"], cfg["std"], cfg["crop_pct"]) == (meta["mean"], meta["std"], 0.875)
    assert doc["label_names"] == list("abcde")
    _, got = load_model(tmp_path / "t", return_metadata=True)
    assert {k: got[k] for k in meta} == meta  # class names and preprocessing come back in vitkit's names
    assert read_checkpoint(tmp_path / "t").preprocessing == read_checkpoint(src).preprocessing  # the whole record


def test_config_json_names_timms_architecture_and_eps(tmp_path):
    ti16 = build(img_size=224, patch_size=16, width=192, depth=12, num_heads=3, mlp_dim=768, num_classes=0)
    convert(save_pretrained(ti16, tmp_path / "ti"), tmp_path / "ti_timm", to="timm")
    doc = json.loads((tmp_path / "ti_timm" / "config.json").read_text())
    assert doc["architecture"] == "vit_tiny_patch16_224" and "norm_eps" not in doc["model_args"]
    # no metadata: the record vitkit itself reads such a file with, [-1, 1] pixels, written out so that timm (whose
    # default would be ImageNet's mean and std) preprocesses as vitkit does
    pre = doc["pretrained_cfg"]
    assert (pre["mean"], pre["std"], pre["crop_pct"], pre["input_size"]) == ([0.5] * 3, [0.5] * 3, 1.0, [3, 224, 224])

    convert(save_pretrained(build(**CASES["w48_h6_eps_rect"]), tmp_path / "e"), tmp_path / "e_timm", to="timm")
    args = json.loads((tmp_path / "e_timm" / "config.json").read_text())["model_args"]
    assert (args["norm_eps"], args["img_size"], args["patch_size"], args["act_layer"]) == (
        1e-12,
        [32, 48],
        [8, 16],
        "gelu_tanh",
    )
    convert(save_pretrained(build(**CASES["hybrid"]), tmp_path / "h"), tmp_path / "h_timm", to="timm")
    assert json.loads((tmp_path / "h_timm" / "config.json").read_text())["architecture"] == "vision_transformer_hybrid"


def test_timm_hub_config_without_model_args(tmp_path):
    """A config as timm's hub holds for its own constructors: the architecture's name says heads and GELU."""
    ti16 = build(img_size=224, patch_size=16, width=192, depth=12, num_heads=3, mlp_dim=768, num_classes=3)
    hub = tmp_path / "hub"
    hub.mkdir()
    save_file(vitkit_to_timm(ti16), str(hub / "model.safetensors"))
    doc = {
        "architecture": "vit_tiny_patch16_224",
        "num_classes": 3,
        "num_features": 192,
        "global_pool": "token",
        "label_names": {"0": "x", "1": "y", "2": "z"},
        "pretrained_cfg": {"tag": "augreg_in21k_ft_in1k", "input_size": [3, 224, 224], "mean": [0.5] * 3},
    }
    (hub / "config.json").write_text(json.dumps(doc))
    loaded, meta = load_quietly(hub, return_metadata=True)
    assert (loaded.config.num_heads, loaded.config.gelu, loaded.config.img_size) == (3, "exact", (224, 224))
    assert meta == {"class_names": ["x", "y", "z"], "mean": [0.5] * 3, "in_chans": 3, "img_size": 224}


def test_config_json_that_contradicts_the_weights_is_refused(tmp_path):
    model = build(**CASES["w48_h3_tanh"])
    convert(save_pretrained(model, tmp_path / "src"), tmp_path / "t", to="timm")
    cfg = tmp_path / "t" / "config.json"
    good = json.loads(cfg.read_text())
    bad_docs = {
        "describes another model": {**good, "model_args": {**good["model_args"], "embed_dim": 64}},
        "reg_tokens=4 computes another function": {**good, "model_args": {**good["model_args"], "reg_tokens": 4}},
        "have no counterpart": {**good, "model_args": {**good["model_args"], "mlp_layer": "SwiGLU"}},
        "act_layer='quick_gelu'": {**good, "model_args": {**good["model_args"], "act_layer": "quick_gelu"}},
        "fc_norm=None": {**good, "model_args": {**good["model_args"], "global_pool": "avg", "fc_norm": None}},
        "gives a 8x8 token grid": {**good, "model_args": {**good["model_args"], "img_size": 64}},
    }
    for match, doc in bad_docs.items():
        cfg.write_text(json.dumps(doc))
        with pytest.raises(UserError, match=match):
            load_model(tmp_path / "t")


# -------------------------------------------------------------------------------------------- guesses
def test_bare_state_dict_warns_once_and_reports_its_guesses(tmp_path):
    model = build(**dict(TINY, width=192, num_heads=4, mlp_dim=64, gelu="tanh"))  # Ti's width, not its 3 heads
    path = bare_timm_file(tmp_path, model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded, report = load_model(path, return_report=True)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == 1
    assert sorted(report.guessed) == ["gelu", "num_heads"] and not report.from_caller
    assert report.guessed["num_heads"].startswith("num_heads: 3 (the registry's head count for width 192")
    assert report.guessed["gelu"].startswith("gelu: exact (timm's default")
    assert all(text in messages[0] for text in report.guessed.values())
    assert "guessed num_heads: 3" in str(report)
    assert (loaded.config.num_heads, loaded.config.gelu) == (3, "exact")  # the guesses, hence the warning
    assert not torch.allclose(logits(loaded), logits(model))


def test_caller_overrides_are_not_guesses(tmp_path):
    model = build(**dict(TINY, width=64, num_heads=4, mlp_dim=128, gelu="tanh"))
    path = bare_timm_file(tmp_path, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        loaded, report = load_model(path, return_report=True, num_heads=4, gelu="tanh")
    assert not report.guessed and sorted(report.from_caller) == ["gelu", "num_heads"]
    assert report.from_caller["num_heads"].startswith("num_heads: 4 (the caller's")
    assert loaded.config == model.config and torch.equal(logits(loaded), logits(model))

    with pytest.warns(UserWarning, match="guessed gelu: exact") as caught:
        _, report = load_model(path, return_report=True, num_heads=4)
    assert "num_heads" not in str(caught[0].message)
    assert list(report.guessed) == ["gelu"] and list(report.from_caller) == ["num_heads"]

    with warnings.catch_warnings():  # a model the caller built settles what the file leaves open
        warnings.simplefilter("error", UserWarning)
        report = load_pretrained(VisionTransformer(**dict(TINY, width=64, mlp_dim=128, gelu="tanh")), path)
    assert not report.guessed and report.from_caller["gelu"].startswith("gelu: tanh (the caller's")


# ------------------------------------------------------------------------------------------- detection
def test_timm_hf_and_vitkit_directories_are_told_apart(tmp_path):
    model = build(**TINY)
    vitkit_dir = save_pretrained(model, tmp_path / "vitkit")
    hf_dir = save_hf(model, tmp_path / "hf")
    convert(vitkit_dir, tmp_path / "timm", to="timm")
    for path, fmt in ((vitkit_dir, "vitkit"), (hf_dir, "hf"), (tmp_path / "timm", "timm")):
        assert detect_format(path) == fmt
        assert detect_format(path / "model.safetensors") == fmt
        assert torch.equal(logits(load_model(path, gelu="tanh") if fmt == "hf" else load_model(path)), logits(model))
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architecture": "vit_base_patch16_224", "model_type": "vit"}))
    assert detect_format(other) == "hf"  # an HF config is HF's whatever else it holds
    (other / "config.json").write_text(json.dumps({"name": "something else"}))
    with pytest.raises(UserError, match="unrecognised checkpoint"):
        detect_format(other)
    # a timm file beside a config.json that is not timm's reads as a bare state dict
    save_file(vitkit_to_timm(model), str(other / "vit.safetensors"))
    with pytest.warns(UserWarning, match="guessed num_heads: 1 .*; gelu: exact"):
        assert load_model(other / "vit.safetensors").config.num_heads == 1


def test_existing_outputs_need_force(tmp_path):
    src = save_pretrained(build(**TINY), tmp_path / "src")
    convert(src, tmp_path / "t", to="timm")
    with pytest.raises(UserError, match=r"model\.safetensors, .*config\.json: exists; pass --force"):
        convert(src, tmp_path / "t", to="timm")
    (tmp_path / "t" / "model.safetensors").unlink()  # config.json alone is an output too
    with pytest.raises(UserError, match=r"config\.json: exists"):
        convert(src, tmp_path / "t", to="timm")
    assert convert(src, tmp_path / "t", to="timm", force=True) == tmp_path / "t" / "model.safetensors"
    assert load_quietly(tmp_path / "t").config == load_model(src).config
