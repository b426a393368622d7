"""int8 inference (vitkit.accel.int8): every nn.Linear of a frozen copy in int8, per-token activations with exact
integer products (Int8Linear, where the CPU has VNNI) or fbgemm's dynamic kernels; attention in bf16 where bf16 is
native (Bf16Attention); the precisions optimize_for_inference accepts, and `vitkit predict --int8`."""

from __future__ import annotations

import copy
import json
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from vitkit import VisionTransformer, optimize_for_inference
from vitkit.accel import inference, int8
from vitkit.accel.int8 import Bf16Attention, Int8Linear, quantize_int8
from vitkit.accel.tome import ToMeAttention, apply_token_merging
from vitkit.checkpoint.native import save_pretrained
from vitkit.cli import main
from vitkit.errors import UserError
from vitkit.models.vit import Attention

TINY = dict(width=32, depth=2, num_heads=2, mlp_dim=64, num_classes=10, patch_size=8, img_size=32)
# Int8Linear computes exactly only where the CPU multiplies bytes with VNNI (it refuses elsewhere); its numerics are
# tested on such CPUs, read here before any test pretends otherwise
VNNI = int8.cpu_has_vnni()
needs_vnni = pytest.mark.skipif(not VNNI, reason="Int8Linear's oneDNN products need VNNI (they saturate without it)")
COMPILES = pytest.mark.skipif(not inference.can_compile(torch.device("cpu")), reason="inductor needs a C++ compiler")


def tiny_vit(**overrides) -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(**{**TINY, **overrides}).eval()
    torch.nn.init.normal_(model.head.weight, std=0.5)  # the zero head would make every output comparison trivial
    return model


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.argmax(-1) == b.argmax(-1)).float().mean())


def int8_reference(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The per-token int8 linear written out in float64: symmetric int8 weights per output channel, symmetric int8
    activations per token, an exact integer product, rescaled, plus the bias."""
    w, b, x = linear.weight.double(), linear.bias.double(), x.double().reshape(-1, linear.in_features)
    ws = w.abs().amax(1) / 127
    xs = x.abs().amax(1, keepdim=True) / 127
    xs = torch.where(xs > 0, xs, 1.0)  # an all-zero token quantises to zeros at any scale
    wq, xq = torch.round(w / ws[:, None]), torch.round(x / xs)
    assert wq.abs().max() <= 127 and xq.abs().max() <= 127
    return (xq @ wq.T) * xs * ws + b


@needs_vnni
def test_int8_linear_is_per_token_int8_with_an_exact_integer_product():
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 24)
    x = torch.randn(2, 7, 48) * torch.logspace(-2, 1, 7)[:, None]  # tokens of very different ranges
    x[1, 3] = 0  # an all-zero token: scale clamped, output is the bias
    q = Int8Linear(linear)
    assert q.packed_weight.is_mkldnn and set(q.state_dict()) == {"weight_scale", "bias"}  # packed once, not saved
    with torch.no_grad():
        got = q(x)
    assert got.shape == (2, 7, 24) and got.dtype == torch.float32
    want = int8_reference(linear, x).reshape(2, 7, 24)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1, 3], linear.bias.detach())
    # per-token scales: the small tokens keep their relative precision (a per-tensor scale would zero them)
    with torch.no_grad():
        exact = linear(x)
    small = (got[:, 0] - exact[:, 0]).abs().max() / (exact[:, 0] - linear.bias).abs().max()
    assert small < 0.05


@pytest.mark.parametrize("kernel", [pytest.param("onednn", marks=needs_vnni), "fbgemm"])
def test_int8_agrees_with_fp32_and_leaves_the_model_untouched(monkeypatch, kernel):
    monkeypatch.setattr(int8, "cpu_has_vnni", lambda: kernel == "onednn")
    model = tiny_vit().train()
    config = model.config
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(64, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.eval()(x)
    model.train()
    fast = optimize_for_inference(model, precision="int8", compile="none")

    # the model: same config object and values, same weights, still training, still trainable, still nn.Linear
    assert model.config is config and model.config == config and model.training
    assert all(p.requires_grad for p in model.parameters())
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert type(model.blocks[0].attn.qkv) is torch.nn.Linear
    # the copy: every Linear in int8, int8 weights per output channel
    qkv = fast.model.blocks[0].attn.qkv
    assert not any(type(m) is torch.nn.Linear for m in fast.model.modules())
    if kernel == "onednn":
        assert isinstance(qkv, Int8Linear) and qkv.weight_scale.shape == (qkv.out_features,)
    else:
        assert qkv.weight().dtype == torch.qint8 and qkv.weight().qscheme() == torch.per_channel_affine
    assert fast.precision == "int8" and fast.dtype == torch.float32 and not fast.model.training

    got = fast(x)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert float((got - want).abs().max()) <= 0.1 * float(want.abs().max())  # per-call activation ranges: ~6% here
    assert agreement(got, want) >= 0.95


@needs_vnni
def test_per_token_int8_is_closer_to_fp32_than_fbgemms_per_tensor_seven_bits():
    model = tiny_vit()
    x = torch.randn(64, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x)
        err = {k: float((quantize_int8(model, k)(x) - want).abs().mean()) for k in ("onednn", "fbgemm")}
    assert err["onednn"] < 0.75 * err["fbgemm"]


def test_the_vnni_layer_is_refused_where_its_byte_products_would_saturate(monkeypatch):
    monkeypatch.setattr(int8, "cpu_has_vnni", lambda: False)
    with pytest.raises(UserError, match="no VNNI"):
        quantize_int8(tiny_vit(), "onednn")
    with pytest.raises(UserError, match="no VNNI"):
        Int8Linear(torch.nn.Linear(4, 3))
    assert int8.int8_kernel() == "fbgemm"


@needs_vnni
def test_the_byte_products_are_exact_at_their_extremes():
    """Unsigned x signed byte products at their largest (q(x) = 127, shifted to 255; weights +-127), summed in
    int32: with vpmaddubsw instead of VNNI each pair would saturate at 32767."""
    layer = Int8Linear(torch.nn.Linear(512, 3))
    with torch.no_grad():
        layer.weight_scale.fill_(1.0)
        w = torch.full((3, 512), 127, dtype=torch.int8)
        w[1] = -127
        layer.packed_weight = torch.ops.onednn.qlinear_prepack(w, None)
        layer.bias.zero_()
        y = layer(torch.full((2, 512), 5.0))  # every token at its own maximum: q(x) = 127
    want = torch.tensor([127.0 * 127 * 512, -127.0 * 127 * 512, 127.0 * 127 * 512]) * (5.0 / 127)
    torch.testing.assert_close(y, want.expand(2, 3), rtol=1e-6, atol=0)


def test_int8_compiles_where_the_cpu_has_vnni_and_runs_eagerly_elsewhere(monkeypatch):
    monkeypatch.setattr(int8, "cpu_has_vnni", lambda: False)
    with pytest.warns(UserWarning, match="without VNNI: torch.compile does not trace"):
        fast = optimize_for_inference(tiny_vit(), precision="int8", compile=True)
    assert fast.compile_mode == "none"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "auto" chooses eager for fbgemm's int8 without a word
        assert optimize_for_inference(tiny_vit(), precision="int8").compile_mode == "none"
    monkeypatch.setattr(int8, "cpu_has_vnni", lambda: True)
    want = "default" if inference.can_compile(torch.device("cpu")) else "none"
    assert optimize_for_inference(tiny_vit(), precision="int8").compile_mode == want


@needs_vnni
@COMPILES
def test_compiled_int8_computes_what_the_eager_layers_compute(monkeypatch):
    monkeypatch.setattr(int8, "cpu_has_vnni", lambda: True)
    # attention in fp32 here: bf16 attention rounds its logits and probabilities where each graph does, and a last
    # bit there moves an int8 rounding downstream (each is as close to fp32 as the other, tested below)
    monkeypatch.setattr(int8, "bf16_is_fast", lambda device: False)
    # exact GELU: a compiled graph computes the tanh GELU in another form (vitkit.accel.kernels), whose last-bit
    # differences can move a rounding to int8; here the layers' own fusions are compared
    model = tiny_vit(gelu="exact")
    eager = optimize_for_inference(model, precision="int8", compile="none")
    compiled = optimize_for_inference(model, precision="int8", compile="default")
    assert compiled.compile_mode == "default"
    assert not any(isinstance(m, Bf16Attention) for m in compiled.model.modules())
    for n in (5, 2):  # a second batch size: recompiled for its shape, same results
        x = torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(n))
        torch.testing.assert_close(compiled(x), eager(x), atol=1e-4, rtol=1e-4)


@needs_vnni
@COMPILES
def test_compiled_int8_with_bf16_attention_is_as_close_to_fp32_as_eager(monkeypatch):
    monkeypatch.setattr(int8, "cpu_has_vnni", lambda: True)
    monkeypatch.setattr(int8, "bf16_is_fast", lambda device: True)
    model = tiny_vit()
    x = torch.randn(32, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(x)
    errors = {}
    for mode in ("none", "default"):
        fast = optimize_for_inference(model, precision="int8", compile=mode)
        assert type(fast.model.blocks[0].attn) is Bf16Attention
        got = fast(x)
        errors[mode] = float((got - want).abs().mean())
        assert float((got - want).abs().max()) <= 0.1 * float(want.abs().max()) and agreement(got, want) >= 0.95
    assert errors["default"] <= 1.5 * errors["none"]


@pytest.mark.parametrize("native", [True, False])
def test_int8_attends_in_bf16_where_bf16_is_native_and_in_fp32_elsewhere(monkeypatch, native):
    monkeypatch.setattr(int8, "bf16_is_fast", lambda device: native)
    monkeypatch.setattr(int8, "cpu_has_vnni", lambda: True)  # the layers are built, never run
    model = tiny_vit()
    for kernel in ("onednn", "fbgemm"):
        attends = {type(m) for m in quantize_int8(model, kernel).modules() if isinstance(m, Attention)}
        assert attends == ({Bf16Attention} if native and kernel == "onednn" else {Attention})
    assert all(type(m) is Attention for m in model.modules() if isinstance(m, Attention))  # the model untouched
    # a token-merging model's attention adds its size bias: it stays as it is, in fp32
    merging = quantize_int8(apply_token_merging(tiny_vit(), 2), "onednn")
    assert {type(m) for m in merging.modules() if isinstance(m, Attention)} == {ToMeAttention}


def attention_reference(attn: Attention, x: torch.Tensor, round_to: torch.dtype | None) -> torch.Tensor:
    """Multi-head attention written out in float64 from the layer's weights, q, k and v first rounded to round_to."""
    w, b = attn.qkv.weight.double(), attn.qkv.bias.double()
    B, N, C = x.shape
    q, k, v = (x.double() @ w.T + b).reshape(B, N, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    if round_to is not None:
        q, k, v = (t.to(round_to).double() for t in (q, k, v))
    probs = (q @ k.transpose(-2, -1) / attn.head_dim**0.5).softmax(-1)
    out = (probs @ v).transpose(1, 2).reshape(B, N, C)
    return out @ attn.proj.weight.double().T + attn.proj.bias.double()


def test_bf16_attention_computes_the_attention_of_bf16_rounded_q_k_v_whatever_path_is_asked():
    torch.manual_seed(0)
    attn = Attention(32, 4).eval()
    x = torch.randn(3, 9, 32) * 2
    with torch.no_grad():
        fp32 = attn(x)
        attn16 = copy.deepcopy(attn)
        attn16.__class__ = Bf16Attention
        assert attn16.state_dict().keys() == attn.state_dict().keys()
        got = attn16(x)  # SDPA asked for: the written-out bf16 path runs
        assert got.dtype == torch.float32
        torch.testing.assert_close(attn16(x, explicit=True), got, rtol=0, atol=0)
        probs: list[torch.Tensor] = []
        out = attn16(x, explicit=True, attention=probs)
        assert len(probs) == 1 and probs[0].shape == (3, 4, 9, 9) and probs[0].dtype == torch.float32
        torch.testing.assert_close(out, got, rtol=0, atol=0)
    with torch.no_grad():
        want, exact = attention_reference(attn, x, torch.bfloat16), attention_reference(attn, x, None)
    err = float((got.double() - want).abs().max())
    assert err < 0.02 * float(want.abs().max())  # logits and probabilities rounded to bf16 on the way
    assert float((fp32.double() - exact).abs().max()) < 1e-5  # fp32 as it was
    assert not torch.allclose(got, fp32, atol=1e-4)  # and the bf16 path did run


def test_bf16_attention_runs_with_relative_positions():
    torch.manual_seed(0)
    model = VisionTransformer(**{**TINY, "depth": 3, "pos_embed": "relative_2d"}).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(x)
        for m in model.modules():
            if type(m) is Attention:
                m.__class__ = Bf16Attention
        got = model(x)
    assert got.dtype == torch.float32
    assert 0 < float((got - want).abs().max()) < 0.03 * float(want.abs().max())


@pytest.mark.parametrize("native", [True, False])
def test_auto_precision_is_bf16_where_native_and_never_int8(monkeypatch, native):
    monkeypatch.setattr(inference, "bf16_is_fast", lambda device: native)
    fast = optimize_for_inference(tiny_vit(), compile="none")
    assert fast.precision == ("bf16" if native else "fp32")
    assert fast.dtype == (torch.bfloat16 if native else torch.float32)


def test_precision_and_dtype_spellings(monkeypatch):
    monkeypatch.setattr(inference, "bf16_is_fast", lambda device: True)
    assert optimize_for_inference(tiny_vit(), torch.float32, compile="none").precision == "fp32"
    assert optimize_for_inference(tiny_vit(), dtype="bf16", compile="none").precision == "bf16"
    with pytest.raises(ValueError, match="precision 'int4'"):
        optimize_for_inference(tiny_vit(), precision="int4")
    with pytest.raises(ValueError, match="not both"):
        optimize_for_inference(tiny_vit(), precision="int8", dtype="fp32")
    with pytest.raises(ValueError, match="fp32 model"):
        optimize_for_inference(tiny_vit().to(torch.bfloat16), precision="int8")


def test_cli_predict_int8_runs_and_agrees_with_fp32(tmp_path, capsys):
    meta = {"class_names": [f"c{i}" for i in range(10)], "img_size": 32, "mean": [0.5] * 3, "std": [0.5] * 3}
    ckpt = save_pretrained(tiny_vit(), tmp_path / "ckpt", metadata=meta)
    rng = np.random.default_rng(0)
    files = []
    for i in range(4):
        files.append(str(tmp_path / f"img{i}.png"))
        Image.fromarray(rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)).save(files[-1])
    results = {}
    for flags in ([], ["--int8"]):
        assert main(["predict", str(ckpt), *files, "--json", "--top-k", "3", *flags]) == 0
        results[bool(flags)] = json.loads(capsys.readouterr().out)
    for fp32, int8_ in zip(results[False], results[True]):
        assert fp32["file"] == int8_["file"]
        p32, p8 = fp32["predictions"][0], int8_["predictions"][0]
        assert abs(p32["probability"] - p8["probability"]) < 0.05
