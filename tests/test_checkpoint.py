"""Checkpoint formats: official .npz layouts, Hugging Face parity, timm, vitkit's own, and load adaptations."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import vitkit
from vitkit import UserError, VisionTransformer
from vitkit.checkpoint import LoadReport, native, save_pretrained
from vitkit.checkpoint.config_from_weights import default_heads
from vitkit.checkpoint.hf import save_hf, to_hf_model, vitkit_to_hf
from vitkit.checkpoint.official import infer_official_config, vitkit_to_official
from vitkit.checkpoint.timm import vitkit_to_timm
from vitkit.cli import main as cli_main
from vitkit.hub import load_model, load_pretrained
from vitkit.models import ResNet, resample_pos_embed

TINY = dict(img_size=32, patch_size=8, width=32, depth=2, num_heads=4, mlp_dim=64, num_classes=5)
HYBRID = dict(TINY, patch_size=1, resnet_layers=(1, 1), resnet_width=0.5)  # 32 px -> /8 -> 4x4 tokens
ROOT_ONLY = dict(TINY, patch_size=2, resnet_layers=(), resnet_width=0.5)  # root /4, then 2x2 patches


def randomized(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Noise on every parameter, so zero-initialised tensors (head, cls, biases) are tested too."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model.eval()


def tiny(seed: int = 0, **overrides) -> VisionTransformer:
    return randomized(VisionTransformer(**{**TINY, **overrides}), seed)


def images(size: int = 32, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))


def assert_same_model(a: torch.nn.Module, b: torch.nn.Module, size: int = 32) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, msg=k)
    x = images(size)
    with torch.no_grad():
        torch.testing.assert_close(a(x), b(x), rtol=0, atol=1e-6)


def save_npz(path: Path, params: dict[str, np.ndarray]) -> Path:
    np.savez(path, **params)
    return path


# ------------------------------------------------------------------------------------------ official .npz
def scanned(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Stack encoderblock_i/... into encoderblock/... with a leading depth axis (big_vision scan=True)."""
    out, stacks = {}, {}
    for k, v in params.items():
        m = re.match(r"Transformer/encoderblock_(\d+)/(.*)$", k)
        if m:
            stacks.setdefault(m.group(2), {})[int(m.group(1))] = v
        else:
            out[k] = v
    for name, per_block in stacks.items():
        out[f"Transformer/encoderblock/{name}"] = np.stack([per_block[i] for i in sorted(per_block)])
    return out


def big_vision(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """big_vision layout: top-level pos_embedding without the class row."""
    out = dict(params)
    pe = out.pop("Transformer/posembed_input/pos_embedding")
    out["pos_embedding"] = pe[:, 1:] if "cls" in out else pe
    return out


def gn_as_4d(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Older hybrid files store GroupNorm scale/bias as (1, 1, 1, C)."""
    return {k: v.reshape(1, 1, 1, -1) if re.search(r"gn\w*/(scale|bias)$", k) else v for k, v in params.items()}


CASES = {
    "released": (TINY, lambda m: vitkit_to_official(m, "released")),
    "linen": (TINY, lambda m: vitkit_to_official(m, "linen")),
    "opt_target_prefix": (TINY, lambda m: vitkit_to_official(m, prefix="opt/target/")),
    "params_prefix": (TINY, lambda m: vitkit_to_official(m, "linen", prefix="params/")),
    "big_vision_gap": (dict(TINY, classifier="gap"), lambda m: big_vision(vitkit_to_official(m, "linen"))),
    "scanned": (TINY, lambda m: scanned(vitkit_to_official(m, "linen"))),
    "pre_logits": (dict(TINY, representation_size=16), lambda m: vitkit_to_official(m)),
    "gap": (dict(TINY, classifier="gap"), lambda m: vitkit_to_official(m)),
    "hybrid_gn_4d": (HYBRID, lambda m: gn_as_4d(vitkit_to_official(m))),
    "root_only": (ROOT_ONLY, lambda m: vitkit_to_official(m)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_official_round_trip_infers_exact_config(tmp_path, case):
    fields, write = CASES[case]
    model = tiny(**fields)
    path = save_npz(tmp_path / "ckpt.npz", write(model))
    loaded = load_model(path)
    assert loaded.config.to_dict() == model.config.to_dict()
    assert_same_model(model, loaded)


def test_official_names_and_shapes(tmp_path):
    p = vitkit_to_official(tiny(representation_size=16), "released")
    blk = "Transformer/encoderblock_1/MultiHeadDotProductAttention_1"
    assert p["embedding/kernel"].shape == (8, 8, 3, 32)
    assert p["cls"].shape == (1, 1, 32)
    assert p["Transformer/posembed_input/pos_embedding"].shape == (1, 17, 32)
    assert p[f"{blk}/query/kernel"].shape == (32, 4, 8) and p[f"{blk}/query/bias"].shape == (4, 8)
    assert p[f"{blk}/out/kernel"].shape == (4, 8, 32)
    assert p["Transformer/encoderblock_0/MlpBlock_3/Dense_0/kernel"].shape == (32, 64)
    assert p["Transformer/encoderblock_0/LayerNorm_2/scale"].shape == (32,)
    assert p["pre_logits/kernel"].shape == (32, 16) and p["head/kernel"].shape == (16, 5)
    assert "cls" not in vitkit_to_official(tiny(classifier="gap"))
    h = vitkit_to_official(tiny(**HYBRID))
    assert h["conv_root/kernel"].shape == (7, 7, 3, 32) and h["embedding/kernel"].shape == (1, 1, 256, 32)
    assert h["block2/unit1/conv_proj/kernel"].shape == (1, 1, 128, 256) and "block2/unit2/conv1/kernel" not in h


def test_big_vision_token_model_gets_zero_class_position(tmp_path):
    """big_vision adds no position embedding to the class token: loaded as a zero row."""
    model = tiny()
    with torch.no_grad():
        model.pos_embed[:, 0] = 0
    path = save_npz(tmp_path / "bv.npz", big_vision(vitkit_to_official(model, "linen")))
    assert_same_model(model, load_model(path))


def test_unknown_official_structures_are_errors(tmp_path):
    p = vitkit_to_official(tiny(), "linen")
    with pytest.raises(ValueError, match="map"):
        infer_official_config({**p, "MAPHead_0/probe": np.zeros((1, 1, 32), np.float32)})
    with pytest.raises(ValueError, match="embedding/kernel"):
        infer_official_config({k: v for k, v in p.items() if k != "embedding/kernel"})


def test_pickled_npz_is_refused(tmp_path):
    path = tmp_path / "evil.npz"
    np.savez(path, head=np.array([{"x": 1}], dtype=object))
    with pytest.raises(ValueError, match="pickled"):
        load_model(path)
    whole = tmp_path / "whole.npz"  # a pickle with an .npz name
    np.save(whole.with_suffix(".npy"), np.array([{"x": 1}], dtype=object), allow_pickle=True)
    whole.with_suffix(".npy").rename(whole)
    with pytest.raises(ValueError, match="pickled"):
        load_model(whole)


# ------------------------------------------------------------------------------------------ load adaptations
def test_resolution_change_resamples_pos_embed(tmp_path):
    model = tiny()
    path = save_npz(tmp_path / "m.npz", vitkit_to_official(model))
    big = load_model(path, img_size=48)  # grid 4x4 -> 6x6
    expected = resample_pos_embed(model.pos_embed.detach(), (6, 6), (4, 4))
    torch.testing.assert_close(big.pos_embed.detach(), expected, rtol=0, atol=0)
    target = VisionTransformer(**{**TINY, "img_size": 48})
    report = load_pretrained(target, path)
    assert report.resampled == ["pos_embed"] and report.ok
    assert "resampled: pos_embed" in str(report)
    assert big(images(48)).shape == (2, 5)


def test_class_count_change_gives_zero_head(tmp_path):
    path = save_npz(tmp_path / "m.npz", vitkit_to_official(tiny()))
    model = load_model(path, num_classes=7)
    assert model.head.weight.shape == (7, 32)
    assert not model.head.weight.any() and not model.head.bias.any()
    report = load_pretrained(VisionTransformer(**{**TINY, "num_classes": 7}), path)
    assert report.reinitialised == ["head.weight", "head.bias"] and report.ok
    features = save_npz(tmp_path / "f.npz", vitkit_to_official(tiny(num_classes=0)))  # no head stored
    report = load_pretrained(VisionTransformer(**TINY), features, strict=True)
    assert report.reinitialised == ["head.weight", "head.bias"] and not report.missing
    report = load_pretrained(VisionTransformer(**{**TINY, "num_classes": 0}), path)
    assert report.dropped == ["head.weight", "head.bias"] and report.ok


def test_dropping_pre_logits_also_resets_head(tmp_path):
    src = tiny(representation_size=32)  # same width: the head's shape alone would not reveal the change
    path = save_npz(tmp_path / "m.npz", vitkit_to_official(src))
    model = VisionTransformer(**TINY)
    report = load_pretrained(model, path)
    assert report.dropped == ["pre_logits.weight", "pre_logits.bias"]
    assert report.reinitialised == ["head.weight", "head.bias"] and not model.head.weight.any()
    torch.testing.assert_close(model.blocks[1].mlp.fc2.weight, src.blocks[1].mlp.fc2.weight, rtol=0, atol=0)


def test_shape_mismatch_names_key_and_shapes(tmp_path):
    path = save_npz(tmp_path / "m.npz", vitkit_to_official(tiny()))
    with pytest.raises(ValueError, match=r"'blocks\.0\.mlp\.fc1\.weight' has shape \(64, 32\).*\(48, 32\)"):
        load_pretrained(VisionTransformer(**{**TINY, "mlp_dim": 48}), path)


def test_missing_and_unexpected_keys_are_reported(tmp_path):
    params = vitkit_to_official(tiny())
    params.pop("Transformer/encoder_norm/bias")
    params["extra/thing"] = np.zeros(3, np.float32)
    path = save_npz(tmp_path / "m.npz", params)
    model = VisionTransformer(**TINY)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UserError, match=r"missing norm\.bias; unexpected extra/thing"):
        load_pretrained(model, path)  # strict by default: a partial load is an error, and loads nothing
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    with pytest.raises(UserError, match=r"m\.npz: the weights do not fit the model; missing norm\.bias"):
        load_model(path)
    report = load_pretrained(model, path, strict=False)  # asked for: load what fits, report the rest
    assert isinstance(report, LoadReport) and not report.ok
    assert report.missing == ["norm.bias"] and report.unexpected == ["extra/thing"]


def test_create_model_pretrained(tmp_path):
    fields = dict(depth=1, img_size=32, num_classes=5)
    src = randomized(vitkit.create_model("vit_ti16", **fields))
    path = save_npz(tmp_path / "ti.npz", vitkit_to_official(src))
    assert_same_model(src, vitkit.create_model("vit_ti16", pretrained=str(path), **fields).eval())


# ------------------------------------------------------------------------------------------ Hugging Face
@pytest.mark.parametrize("gelu,eps", [("tanh", 1e-6), ("exact", 1e-12)])
def test_vitkit_to_hf_parity(gelu, eps):
    model = tiny(gelu=gelu, ln_eps=eps)
    hf = to_hf_model(model)
    x = images()
    with torch.no_grad():
        out = hf(pixel_values=x)
        hidden = hf.vit(pixel_values=x).last_hidden_state
        torch.testing.assert_close(out.logits, model(x), rtol=0, atol=1e-5)
        torch.testing.assert_close(hidden, model.forward_features(x), rtol=0, atol=1e-5)


def hf_random(cls_name: str, **config):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=32,
        patch_size=8,
        **config,
    )
    return randomized(getattr(transformers, cls_name)(cfg))


def test_hf_to_vitkit_parity_with_hf_defaults(tmp_path):
    """HF's defaults (exact GELU, eps 1e-12) are read from config.json; outputs match."""
    hf = hf_random("ViTForImageClassification", num_labels=5)
    hf.save_pretrained(tmp_path / "hf")
    model = load_model(tmp_path / "hf")
    assert (model.config.gelu, model.config.ln_eps, model.config.num_classes) == ("exact", 1e-12, 5)
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(pixel_values=x).logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(model.forward_features(x), hf.vit(x).last_hidden_state, rtol=0, atol=1e-5)


def test_hf_vitmodel_pooler_is_pre_logits(tmp_path):
    hf = hf_random("ViTModel", hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, pooler_output_size=16)
    hf.save_pretrained(tmp_path / "hf")
    model = load_model(tmp_path / "hf")
    assert (model.config.gelu, model.config.representation_size, model.config.num_classes) == ("tanh", 16, 0)
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(pixel_values=x).pooler_output, rtol=0, atol=1e-5)


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
def test_hf_legacy_files_round_trip(tmp_path, weights):
    """The published key layout (encoder.layer.i.attention.attention.query, ...) in both weight files."""
    model = tiny()
    directory = save_hf(model, tmp_path / "hf")
    if weights == "pytorch_model.bin":
        _, state = vitkit_to_hf(model, layout="legacy")
        (directory / "model.safetensors").unlink()
        torch.save(state, directory / weights)
    assert_same_model(model, load_model(directory))


def test_hf_reads_our_export(tmp_path):
    import transformers

    model, names = tiny(), ["cat", "dog", "emu", "fox", "gnu"]
    directory = save_hf(model, tmp_path / "hf", class_names=names)
    hf = transformers.ViTForImageClassification.from_pretrained(directory).eval()
    assert [hf.config.id2label[i] for i in range(5)] == names
    with torch.no_grad():
        torch.testing.assert_close(hf(pixel_values=images()).logits, model(images()), rtol=0, atol=1e-5)
    # the classes from id2label, the preprocessing from the preprocessor_config.json written beside it
    half = [0.5] * 3
    said = {"class_names": names, "img_size": 32, "mean": half, "std": half, "interpolation": "bilinear"}
    assert load_model(directory, return_metadata=True)[1] == said


def test_a_grey_model_exported_to_hf_works_in_the_transformers_pipeline(tmp_path):
    """transformers' pipelines give RGB pixels: the 1-channel model is written with its luma weights folded into
    the patch embedding, so the pipeline's scores are vitkit's, exactly on a grey image, within PIL's rounding of
    the luma on a colour one."""
    import transformers
    from PIL import Image

    model, names = tiny(in_chans=1, img_size=16), ["cat", "dog", "emu", "fox", "gnu"]
    directory = save_hf(model, tmp_path / "hf", class_names=names)
    classify = transformers.pipeline("image-classification", model=str(directory), top_k=5)
    pixels = np.random.default_rng(0).integers(0, 256, (16, 16, 3), dtype=np.uint8)
    for image, tolerance in [(Image.fromarray(pixels[..., 0], "L"), 1e-5), (Image.fromarray(pixels, "RGB"), 2e-3)]:
        with torch.no_grad():
            ours = model(vitkit.preprocess(model, [image])).softmax(-1)[0]
        theirs = {row["label"]: row["score"] for row in classify(image)}
        torch.testing.assert_close(torch.tensor([theirs[n] for n in names]), ours, rtol=0, atol=tolerance)


def test_hf_export_refuses_what_hf_cannot_express():
    with pytest.raises(ValueError, match="class token only, not classifier=.gap."):
        vitkit_to_hf(tiny(classifier="gap"))
    with pytest.raises(ValueError, match="ResNet stem"):
        vitkit_to_hf(tiny(**HYBRID))
    with pytest.raises(ValueError, match="pre-logits"):
        to_hf_model(tiny(representation_size=16))


# ------------------------------------------------------------------------------------------ timm
@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_timm_round_trip(tmp_path, suffix):
    model = tiny(**HYBRID) if suffix == ".pth" else tiny(representation_size=16)
    state = vitkit_to_timm(model)
    path = tmp_path / f"timm{suffix}"
    if suffix == ".pth":  # as a DDP training script saves it: wrapped, with 'module.' prefixes
        torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}, "epoch": 3}, path)
    else:
        save_file(state, str(path))
    loaded = load_model(path, num_heads=4, gelu="tanh")
    assert loaded.config.to_dict() == model.config.to_dict()
    assert_same_model(model, loaded)


def test_timm_defaults_and_fc_norm(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file(vitkit_to_timm(tiny()), str(path))
    assert load_model(path).config.gelu == "exact"  # timm's numerics unless told otherwise
    assert (default_heads(192), default_heads(384), default_heads(1024), default_heads(512)) == (3, 6, 16, 8)
    bad = tmp_path / "fc.safetensors"
    save_file({**vitkit_to_timm(tiny()), "fc_norm.weight": torch.ones(32)}, str(bad))
    with pytest.raises(ValueError, match="fc_norm"):
        load_model(bad)


# ------------------------------------------------------------------------------------------ vitkit format
def test_vitkit_round_trip_with_metadata(tmp_path):
    model = tiny(**HYBRID)
    meta = {"class_names": ["a", "b", "c", "d", "e"], "step": 10}
    save_pretrained(model, tmp_path / "ck", metadata=meta)
    loaded, got = load_model(tmp_path / "ck", return_metadata=True)
    assert got == meta and load_pretrained(tiny(**HYBRID), tmp_path / "ck").metadata == meta
    assert "pretrained_metadata" not in vars(loaded)  # the report is its home, not an attribute set on the model
    assert_same_model(model, loaded)
    assert_same_model(model, vitkit.load_model(tmp_path / "ck" / "model.safetensors"))


def test_resnet_vitkit_round_trip(tmp_path):
    model = randomized(ResNet(layers=(1,), width_factor=0.5, num_classes=3))
    save_pretrained(model, tmp_path / "r")
    assert_same_model(model, load_model(tmp_path / "r"))
    with pytest.raises(ValueError, match="'resnet' model"):
        load_pretrained(VisionTransformer(**TINY), tmp_path / "r")


# ------------------------------------------------------------------------------------------ CLI
@pytest.mark.parametrize("to", ["vitkit", "hf", "timm", "official"])
def test_cli_convert(tmp_path, to, capsys):
    model = tiny()
    src = save_npz(tmp_path / "src.npz", vitkit_to_official(model))
    assert cli_main(["convert", str(src), str(tmp_path / "out"), "--to", to, "num_classes=5"]) == 0
    written = Path(capsys.readouterr().out.split()[1])
    extra = {"num_heads": 4, "gelu": "tanh"} if to == "timm" else {}
    assert_same_model(model, load_model(written, **extra))


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert cli_main(["convert", str(tmp_path / "none.npz"), str(tmp_path / "o")]) == 2
    assert "no such file" in capsys.readouterr().err
    src = save_npz(tmp_path / "src.npz", vitkit_to_official(tiny()))
    assert cli_main(["convert", str(src), str(tmp_path / "o"), "widht=3"]) == 2
    assert "widht" in capsys.readouterr().err


def test_atomic_writes_get_the_usual_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        native.atomic_write_text(tmp_path / "a.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644
    assert not list(tmp_path.glob(".a.json.*"))  # no temp file left behind


def test_weights_that_do_not_fit_never_load_quietly(tmp_path, capsys):
    """The probe's cases: a config.json that says fewer blocks than the weights hold, and a timm state dict that
    lost a whole block; both used to load (one evaluated at a fraction of its accuracy, one converted with a
    block left at random init)."""
    import json

    from PIL import Image

    model = tiny(depth=4)
    Image.new("RGB", (32, 32)).save(tmp_path / "x.png")
    save_pretrained(model, tmp_path / "run")
    doc = json.loads((tmp_path / "run" / "config.json").read_text())
    doc["model"]["depth"] = 2
    (tmp_path / "run" / "config.json").write_text(json.dumps(doc))
    with pytest.raises(UserError, match=r"do not fit the model; unexpected blocks\.2\..*\(24 in all\)"):
        load_model(tmp_path / "run")
    for command in (["eval", "--data", "synthetic"], ["predict"], ["fewshot", "--data", "synthetic"]):
        extra = [str(tmp_path / "x.png")] if command == ["predict"] else []
        assert cli_main([command[0], str(tmp_path / "run"), *extra, *command[1:]]) == 2
        assert "do not fit the model" in capsys.readouterr().err

    state = vitkit_to_timm(model)
    lost = {k: v for k, v in state.items() if not k.startswith("blocks.1.")}
    save_file(lost, str(tmp_path / "lost.safetensors"))
    assert cli_main(["convert", str(tmp_path / "lost.safetensors"), str(tmp_path / "out"), "num_heads=4"]) == 2
    err = capsys.readouterr().err
    assert "missing blocks.1." in err and not (tmp_path / "out").exists()


def test_a_config_an_older_vitkit_saved_with_token_merge_still_loads(tmp_path):
    """token_merge was a ViTConfig field; it is now a speed patch applied from outside. A saved 0 is dropped, a
    saved r leaves the model config and comes back to load_model, which applies the patch (unless told not to)."""
    import json

    from vitkit.checkpoint import read_checkpoint

    saved = tiny().eval()
    save_pretrained(saved, tmp_path / "run")
    path = tmp_path / "run" / "config.json"
    doc = json.loads(path.read_text())
    for r in (0, 3):
        doc["model"]["token_merge"] = r
        path.write_text(json.dumps(doc))
        ckpt = read_checkpoint(tmp_path / "run")
        assert "token_merge" not in ckpt.config and ckpt.token_merge == r
        model, report = load_model(tmp_path / "run", return_report=True)
        assert report.token_merge == r and getattr(model, "token_merge", 0) == r
        assert model.state_dict().keys() == saved.state_dict().keys()
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path / "run", token_merge=0).eval()(images()), saved(images()))
    doc["model"]["token_merge"] = -1
    path.write_text(json.dumps(doc))
    with pytest.raises(UserError, match="model.token_merge=-1"):
        read_checkpoint(tmp_path / "run")


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_writers_refuse_a_model_whose_layers_hold_their_weights_elsewhere(tmp_path, precision):
    """optimize_for_inference's model has its Linear layers packed (the weights out of its state dict) or quantised
    (other keys): written, the file would lack them. Every writer refuses it, naming the keys; nothing is written."""
    fast = vitkit.optimize_for_inference(tiny(), precision, compile="none")
    writers = {
        "save_pretrained": lambda m: save_pretrained(m, tmp_path / "packed"),
        "vitkit_to_official": vitkit_to_official,
        "vitkit_to_timm": vitkit_to_timm,
        "vitkit_to_hf": vitkit_to_hf,
    }
    for name, write in writers.items():
        with pytest.raises(UserError, match=rf"{name}: .*missing \d+ \(blocks\.0\.attn\.qkv\.weight, .*made from"):
            write(fast.model)
    assert not (tmp_path / "packed").exists()
    save_pretrained(tiny(), tmp_path / "plain")  # the model itself saves
    assert load_model(tmp_path / "plain").config == tiny().config


def test_a_file_with_a_heads_bias_but_not_its_weight_is_an_error_listing_it(tmp_path):
    save_pretrained(tiny(), tmp_path / "m")
    path = tmp_path / "m" / native.WEIGHTS_NAME
    state = load_file(path)
    del state["head.weight"]
    save_file(state, path)
    with pytest.raises(UserError, match=r"the weights do not fit the model; missing head\.weight"):
        load_model(tmp_path / "m")
