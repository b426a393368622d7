"""ONNX export (vitkit.export, `vitkit export --onnx`): a dynamic batch axis and the model's outputs, in fp32 and with
onnxruntime's int8 quantisation of the graph."""

from __future__ import annotations

import warnings

import pytest
import torch

from vitkit import VisionTransformer
from vitkit.checkpoint.native import save_pretrained
from vitkit.cli import main

TINY = dict(width=32, depth=2, num_heads=2, mlp_dim=64, num_classes=10, patch_size=8, img_size=32)


def tiny_vit() -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(**TINY).eval()
    torch.nn.init.normal_(model.head.weight, std=0.5)  # the zero head would make every output comparison trivial
    return model


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.argmax(-1) == b.argmax(-1)).float().mean())


def test_export_onnx_dynamic_batch_parity(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from vitkit.export import check_onnx, onnx_session

    model = tiny_vit()
    save_pretrained(model, tmp_path / "ckpt")
    out = tmp_path / "vit.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["export", str(tmp_path / "ckpt"), "--onnx", str(out)]) == 0
    assert "onnxruntime vs torch max |diff|" in capsys.readouterr().out
    session = onnx_session(out)
    assert isinstance(session.get_inputs()[0].shape[0], str)  # a symbolic batch axis
    assert check_onnx(out, model, batch_sizes=(2, 5)) <= 1e-4
    with torch.no_grad():
        model.head.bias += 1.0  # the exported graph no longer matches: the check must say so
    with pytest.raises(ValueError, match="differs from torch"):
        check_onnx(out, model, batch_sizes=(2,))


def test_export_int8_writes_a_loadable_onnx_that_agrees_with_fp32(tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from vitkit.export import onnx_session

    model = tiny_vit()
    save_pretrained(model, tmp_path / "ckpt")
    out = tmp_path / "onnx" / "vit-int8.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["export", str(tmp_path / "ckpt"), "--onnx", str(out), "--int8"]) == 0
    assert "(int8," in capsys.readouterr().out
    assert sorted(p.name for p in out.parent.iterdir()) == ["vit-int8.onnx"]  # no fp32 graph or temp file left

    session = onnx_session(out)
    assert isinstance(session.get_inputs()[0].shape[0], str)  # a symbolic batch axis
    ops = {node.op_type for node in __import__("onnx").load(str(out)).graph.node}
    assert "DynamicQuantizeLinear" in ops and ("MatMulInteger" in ops or "DynamicQuantizeMatMul" in ops)
    x = torch.randn(64, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    got = torch.from_numpy(session.run(None, {"pixel_values": x.numpy()})[0])
    with torch.no_grad():
        want = model(x)
    assert float((got - want).abs().max()) <= 0.1 * float(want.abs().max())  # per-call activation ranges: ~6% here
    assert agreement(got, want) >= 0.95

    assert main(["export", str(tmp_path / "ckpt"), "--onnx", str(out), "--int8"]) != 0  # exists: not replaced
    assert "exists" in capsys.readouterr().err
