"""Every exporter either writes files that read back as the same model (same config, same outputs on a random
input) or refuses the model in one line naming the field it cannot hold: model layouts x formats."""

from __future__ import annotations

import pytest
import torch

from vitkit import UserError
from vitkit.checkpoint.loader import convert, read_model
from vitkit.config_of import config_of
from vitkit.models.registry import model_from_config

TINY = dict(img_size=16, patch_size=4, width=32, depth=2, num_heads=2, mlp_dim=64, num_classes=5)
LAYOUTS: dict[str, dict] = {
    "token": {},
    "gap": dict(classifier="gap"),
    "map": dict(classifier="map"),
    "first": dict(classifier="first"),
    "pre_logits": dict(representation_size=24),
    "pre_logits_features": dict(representation_size=24, num_classes=0),
    "hybrid": dict(resnet_layers=(1,), resnet_width=0.5, patch_size=1),
    "sincos": dict(pos_embed="sincos_2d"),
    "learned_2d": dict(pos_embed="learned_2d"),
    "non_square_32x48": dict(img_size=(32, 48), patch_size=8),
    "gelu_exact": dict(gelu="exact"),
    "ln_eps_1e-12": dict(ln_eps=1e-12),
    "relative": dict(pos_embed="relative"),
    "bit": dict(arch="bit", layers=(1, 1), width_factor=0.5, num_classes=5, img_size=32),
}
# the fields of a config that are the function it computes (training switches such as dropout are not)
TRAINING = ("dropout", "attn_dropout", "drop_path", "grad_checkpointing", "attn_impl")

# what each format cannot hold: these must be refused; every other pair must round-trip
REFUSED = {
    "vitkit": set(),
    "hf": {"gap", "map", "first", "pre_logits", "hybrid", "sincos", "learned_2d", "relative", "bit"},
    "timm": {"map", "first", "sincos", "learned_2d", "relative", "bit"},
    "official": {
        *("first", "sincos", "learned_2d", "non_square_32x48", "gelu_exact", "ln_eps_1e-12", "relative"),
        "bit",
    },
}


def build(layout: str) -> torch.nn.Module:
    fields = dict(LAYOUTS[layout])
    config = fields if fields.get("arch") == "bit" else {**TINY, **fields}
    torch.manual_seed(0)
    model = model_from_config(config).eval()
    with torch.no_grad():  # no zero-initialised parameter: every weight is seen to travel
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def function_of(model: torch.nn.Module) -> dict:
    return {k: v for k, v in config_of(model).to_dict().items() if k not in TRAINING}


@pytest.mark.parametrize("to", sorted(REFUSED))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_export_reads_back_as_the_same_model_or_is_refused(layout, to, tmp_path):
    model = build(layout)
    src = tmp_path / "src"
    convert_from = _save(model, src)
    dst = tmp_path / "out"
    if layout in REFUSED[to]:
        with pytest.raises(UserError) as err:
            convert(convert_from, dst, to=to)
        assert "\n" not in str(err.value)
        assert not dst.exists() or not any(dst.iterdir()), "a refused export wrote something"
        return
    written = convert(convert_from, dst, to=to)
    back, _ = read_model(written)
    assert function_of(back) == function_of(model)
    cfg = config_of(model)
    h, w = cfg.img_size if isinstance(cfg.img_size, tuple) else (cfg.img_size, cfg.img_size)
    x = torch.randn(2, 3, h, w, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(x), model(x), atol=1e-5, rtol=0)


def _save(model, directory):
    from vitkit.checkpoint.native import save_pretrained

    return save_pretrained(model, directory)


def test_convert_to_timm_of_a_map_model_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys):
    from vitkit.cli import main

    src = _save(build("map"), tmp_path / "map")
    assert main(["convert", str(src), str(tmp_path / "out"), "--to", "timm"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "classifier='map'" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "layout, field",
    [("gelu_exact", "gelu='exact'"), ("ln_eps_1e-12", "ln_eps=1e-12"), ("sincos", "pos_embed='sincos_2d'")],
)
def test_the_official_format_refuses_what_it_would_silently_change(layout, field, tmp_path):
    with pytest.raises(UserError, match=f"official export: {field}"):
        convert(_save(build(layout), tmp_path / "src"), tmp_path / "out.npz", to="official")
    assert not (tmp_path / "out.npz").exists()


def test_a_directory_with_config_json_and_no_weights_names_the_missing_file(tmp_path):
    directory = _save(build("token"), tmp_path / "ckpt")
    (directory / "model.safetensors").unlink()
    with pytest.raises(UserError) as err:
        read_model(directory)
    assert str(err.value).startswith(f"{directory / 'model.safetensors'}: missing")


def test_onnx_export_refuses_a_size_of_zero_in_one_line(tmp_path):
    from vitkit.export import export_onnx

    with pytest.raises(UserError) as err:
        export_onnx(build("token"), tmp_path / "m.onnx", img_size=0)
    assert str(err.value) == "export: img_size=0; expected a positive number of pixels (or none: the model's)"
    assert not (tmp_path / "m.onnx").exists()


def test_a_non_square_onnx_export_carries_its_preprocessing_and_computes_the_model(tmp_path):
    from vitkit.export import check_onnx, export_onnx, read_onnx_preprocessing

    model = build("non_square_32x48")
    path = export_onnx(model, tmp_path / "m.onnx")
    assert read_onnx_preprocessing(path).img_size == (32, 48)  # before, a non-square export carried no record
    assert check_onnx(path, model, batch_sizes=(2,), atol=1e-5) <= 1e-5


def test_export_cli_with_img_size_0_is_one_line_and_writes_nothing(tmp_path, capsys):
    from vitkit.cli import main

    src = _save(build("token"), tmp_path / "ckpt")
    assert main(["export", str(src), "--onnx", str(tmp_path / "m.onnx"), "--img-size", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "img_size" in err  # before, 0 meant "the model's own size" and exited 0
    assert not (tmp_path / "m.onnx").exists()
