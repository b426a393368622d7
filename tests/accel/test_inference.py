"""optimize_for_inference (vitkit.accel.inference): a frozen copy sharing the model's tensors, its Linear weights
packed for oneDNN with each MLP's GELU in its first matmul, the first token alone in the last block; its precisions,
deep copies, the refusal once the model's weights change, hooks and compilation."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vitkit import VisionTransformer, optimize_for_inference
from vitkit.accel import cpu, inference, int8
from vitkit.accel.cpu import MIN_SIDE, PackedLinear
from vitkit.accel.first_token import FirstTokenBlock
from vitkit.accel.tome import apply_token_merging
from vitkit.errors import UserError
from vitkit.models.vit import Block, Mlp

TINY = dict(width=32, depth=2, num_heads=2, mlp_dim=64, num_classes=10, patch_size=8, img_size=32)
ONEDNN = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
COMPILES = pytest.mark.skipif(not inference.can_compile(torch.device("cpu")), reason="inductor needs a C++ compiler")


def tiny_vit(**kw) -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(**{**TINY, **kw}).eval()
    torch.nn.init.normal_(model.head.weight, std=0.5)  # the zero head would make every output comparison trivial
    return model


def shares_only_model_tensors(fast: nn.Module, model: nn.Module) -> bool:
    own = {id(t) for t in (*model.parameters(), *model.buffers())}
    return {id(t) for t in (*fast.parameters(), *fast.buffers())} <= own


def test_optimize_for_inference_fp32_matches_eager(device):
    model = tiny_vit(attn_impl="explicit").to(device)
    x = torch.randn(3, 3, 32, 32).to(device)
    with torch.no_grad():
        want = model(x)
    fast = optimize_for_inference(model, dtype="fp32", compile="none")
    assert model.config.attn_impl == "explicit" and fast.call_kwargs == {"attn_impl": "auto"} and not model.training
    assert not any(p.requires_grad for p in fast.parameters())
    # the first-token patch is on the copy the fast model runs; the model keeps its class and its blocks'
    assert type(fast.model.blocks[-1]) is FirstTokenBlock and fast.model is not model
    assert type(model) is VisionTransformer and all(type(b) is Block for b in model.blocks)
    got = fast(x)
    assert got.dtype == torch.float32 and not got.requires_grad
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        torch.testing.assert_close(fast(x), want, atol=1e-5, rtol=1e-5)


def test_optimize_for_inference_bf16_close_to_fp32(monkeypatch, device):
    monkeypatch.setattr(inference, "bf16_is_fast", lambda device: True)
    model = tiny_vit().to(device)
    x = torch.randn(3, 3, 32, 32).to(device)
    with torch.no_grad():
        want = model(x)
    fast = optimize_for_inference(model, dtype=torch.bfloat16, compile=False)
    assert next(fast.parameters()).dtype == torch.bfloat16
    assert fast.call_kwargs == {"attn_impl": "auto"}  # bf16 on a CPU: the written-out attention; on CUDA: SDPA
    got = fast(x)
    assert got.dtype == torch.float32
    assert float((got - want).abs().max()) <= 5e-2 * max(1.0, float(want.abs().max()))
    with torch.no_grad():  # and it is the function SDPA computes, to bf16's rounding
        fused = model(x.bfloat16(), attn_impl="sdpa").float()
    assert float((got - fused).abs().max()) <= 2e-2 * max(1.0, float(want.abs().max()))


def test_optimize_for_inference_falls_back_to_fp32_where_bf16_is_emulated(monkeypatch):
    monkeypatch.setattr(inference, "bf16_is_fast", lambda device: False)
    model = tiny_vit()
    with pytest.warns(UserWarning, match="keeping fp32"):
        fast = optimize_for_inference(model, dtype="bf16", compile="none")
    assert fast.dtype == torch.float32 and next(fast.parameters()).dtype == torch.float32
    with pytest.raises(ValueError, match="compile='fastest'"):
        optimize_for_inference(tiny_vit(), dtype="fp32", compile="fastest")


def test_where_onednn_multiplies_no_bf16_a_bf16_fast_model_keeps_torchs_layers(monkeypatch):
    """AVX2-only CPUs: oneDNN's bf16 weight reorder and matmul refuse to run there, so a bf16 fast model (bf16
    forced native here) runs a copy with torch's nn.Linear layers, the model's function to bf16's rounding."""
    monkeypatch.setattr(inference, "bf16_is_fast", lambda device: True)
    monkeypatch.setattr(cpu, "onednn_bf16", lambda: False)
    assert not cpu.can_pack_linears(torch.device("cpu"), torch.bfloat16)
    assert cpu.can_pack_linears(torch.device("cpu"), torch.float32) == torch.backends.mkldnn.is_available()
    model = tiny_vit()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        want = model(x)
    fast = optimize_for_inference(model, "bf16", compile="none")
    assert fast.precision == "bf16" and not any(isinstance(m, PackedLinear) for m in fast.model.modules())
    assert shares_only_model_tensors(fast, model) and type(fast.model.blocks[-1]) is FirstTokenBlock
    assert float((fast(x) - want).abs().max()) <= 5e-2 * max(1.0, float(want.abs().max()))


@ONEDNN
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.onednn_bf16)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("gelu", [None, "none", "tanh"])
def test_packed_linear_computes_the_linear_layer(dtype, bias, gelu):
    torch.manual_seed(0)
    linear = nn.Linear(24, 40, bias=bias).to(dtype).requires_grad_(False)
    packed = PackedLinear(linear, None if gelu is None else nn.GELU(approximate=gelu))
    x = torch.randn(3, 9, 24, dtype=dtype)
    for inp in (x, x[0], x[:, :2], x.transpose(0, 1)):  # 3-D, 2-D and strided views
        want = inp.double() @ linear.weight.double().t() + (linear.bias.double() if bias else 0)
        if gelu == "none":  # the exact GELU, x Phi(x), from the error function
            want = want * 0.5 * (1 + torch.erf(want / 2**0.5))
        elif gelu == "tanh":  # and its tanh approximation
            want = 0.5 * want * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (want + 0.044715 * want**3)))
        tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 1e-2}
        torch.testing.assert_close(packed(inp), want.to(dtype), **tol)
    # the packed weight is oneDNN's opaque copy, not saved: the state is the linear layer's bias alone
    assert list(packed.state_dict()) == (["bias"] if bias else []) and packed.bias is linear.bias


@ONEDNN
def test_optimize_for_inference_runs_a_packed_copy_sharing_the_models_tensors():
    model = tiny_vit()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        want = model(x)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    fast = optimize_for_inference(model, "fp32", compile="none")
    # the model keeps its layers; the copy it runs has every nn.Linear packed and no tensor of its own besides
    assert sum(type(m) is nn.Linear for m in model.modules()) == linears > 0
    assert sum(isinstance(m, PackedLinear) for m in fast.model.modules()) == linears
    assert not any(type(m) is nn.Linear for m in fast.model.modules())
    for block in fast.model.blocks:  # each MLP's GELU runs in its first layer
        assert block.mlp.fc1.post_op == "gelu" and isinstance(block.mlp.act, nn.Identity)
    assert all(type(block.mlp.act) is nn.GELU for block in model.blocks)
    assert shares_only_model_tensors(fast, model)
    torch.testing.assert_close(fast(x), want, atol=1e-5, rtol=1e-5)
    # where torch has no oneDNN: a copy sharing the model's tensors, its layers torch's, the model untouched
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(inference, "can_pack_linears", lambda device, dtype: False)
        plain = optimize_for_inference(model, "fp32", compile="none")
    assert plain.model is not model and shares_only_model_tensors(plain, model)
    assert sum(type(m) is nn.Linear for m in plain.model.modules()) == linears
    assert type(plain.model.blocks[-1]) is FirstTokenBlock and type(model.blocks[-1]) is Block
    torch.testing.assert_close(plain(x), want, atol=1e-5, rtol=1e-5)


def count_gelu_matmuls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The GELU algorithm of every oneDNN matmul that applies one ("none" for erf, "tanh")."""
    calls: list[str] = []
    op = torch.ops.mkldnn._linear_pointwise

    class Counted:
        def __call__(self, x, w, b, post_op, scalars, algorithm):
            if post_op == "gelu":
                calls.append(algorithm)
            return op(x, w, b, post_op, scalars, algorithm)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", Counted())
    return calls


def inference_vit(dtype: torch.dtype, **overrides) -> nn.Module:
    cfg = dict(img_size=32, patch_size=4, width=MIN_SIDE, depth=2, num_heads=2, mlp_dim=2 * MIN_SIDE, num_classes=5)
    torch.manual_seed(0)
    model = VisionTransformer(**{**cfg, **overrides}).eval()
    with torch.no_grad():
        model.head.weight.normal_(std=0.1)  # the zero head would make every logit the bias
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):  # not the identity: errors through them would be the same either way
                m.weight.normal_(1, 0.2), m.bias.normal_(0, 0.2)
    return model.to(dtype)


@ONEDNN
@pytest.mark.parametrize("gelu", ["tanh", "exact"])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.onednn_bf16)])
def test_the_fast_model_applies_each_gelu_inside_its_first_matmul(gelu: str, dtype, monkeypatch) -> None:
    """Logits (class-token block included) against the float64 model's: fp32 to its rounding, bf16 about as far off
    as the model itself in bf16, its layers nn.Linear and nn.GELU (over 20 logits bf16's roundings are noise; the
    layer's own test bounds them)."""
    monkeypatch.setattr(inference, "bf16_is_fast", lambda device: True)
    gelus = count_gelu_matmuls(monkeypatch)
    model = inference_vit(torch.float32, gelu=gelu)
    reference = inference_vit(torch.float64, gelu=gelu)
    images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(images.double())
    fast = optimize_for_inference(model, "fp32" if dtype == torch.float32 else "bf16", compile="none")
    got = fast(images).double()
    assert gelus == ["none" if gelu == "exact" else "tanh"] * 2  # one MLP a block
    with torch.no_grad():
        got_apart = model(images.to(dtype)).double()  # the model itself, cast as the fast model's
    scale = want.abs().max()
    if dtype == torch.float32:
        assert (got - want).abs().max() <= 1e-5 * scale
    else:
        assert (got - want).abs().mean() <= 2 * (got_apart - want).abs().mean()
        assert (got - want).abs().max() <= 0.05 * scale


@pytest.mark.onednn_bf16
@pytest.mark.parametrize("gelu", ["tanh", "none"])
def test_in_bf16_the_packed_gelu_rounds_once(gelu: str) -> None:
    """The GELU applied to the matmul's fp32 sums, then rounded to bf16 once: every output within a bf16 step of
    float64's GELU of the same bf16 operands, where nn.Linear then nn.GELU rounds the sums first (further off)."""
    torch.manual_seed(0)
    fc1, act = nn.Linear(MIN_SIDE, 4 * MIN_SIDE).bfloat16().requires_grad_(False), nn.GELU(approximate=gelu)
    x = torch.randn(8, 197, MIN_SIDE).bfloat16()
    want = F.gelu(F.linear(x.double(), fc1.weight.double(), fc1.bias.double()), approximate=gelu)
    got = PackedLinear(fc1, act)(x)
    assert got.dtype == torch.bfloat16
    err = (got.double() - want).abs()
    assert (err <= 2**-8 * want.abs() + 1e-6).all()  # one bf16 step: 8 bits of significand
    assert err.mean() < (act(fc1(x)).double() - want).abs().mean()


@ONEDNN
def test_where_the_packed_mlp_keeps_its_gelu_apart() -> None:
    """A hook on the first layer or the GELU: neither is replaced by a fused matmul, whose call would skip it."""
    for part in ("fc1", "act"):
        mlp = Mlp(MIN_SIDE, 2 * MIN_SIDE).eval()
        seen: list[int] = []
        getattr(mlp, part).register_forward_hook(lambda *args, seen=seen: seen.append(1))
        packed = cpu.pack_linears(mlp.requires_grad_(False))
        assert type(packed.act) is nn.GELU and packed.fc1.__class__ is (nn.Linear if part == "fc1" else PackedLinear)
        x = torch.randn(2, 9, MIN_SIDE)
        with torch.no_grad():
            torch.testing.assert_close(packed(x), mlp(x), atol=1e-5, rtol=1e-5)
        assert seen == [1, 1], part  # the hook's module is called, and runs its hook, in the copy as in the model
    exact = cpu.pack_linears(Mlp(MIN_SIDE, 2 * MIN_SIDE, gelu="exact").eval())
    assert exact.fc1.post_op == "gelu" and exact.fc1.algorithm == "none" and type(exact.act) is nn.Identity


@pytest.mark.filterwarnings("ignore:bf16 is not native")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_an_optimised_model_deep_copies_sharing_only_its_packed_weights(precision):
    """copy.deepcopy of an optimised model (EMA copies, ensembles, frameworks that copy modules): a model of its
    own, computing the same outputs; only the packed oneDNN weights, which cannot be copied and are never written,
    are shared."""
    fast = optimize_for_inference(tiny_vit(), precision, compile="none")
    x = torch.randn(3, 3, 32, 32)
    copied = copy.deepcopy(fast)
    assert type(copied) is type(fast) and copied.model is not fast.model and copied._run is copied.model
    assert (copied.precision, copied.dtype, copied.compile_mode) == (fast.precision, fast.dtype, fast.compile_mode)
    torch.testing.assert_close(copied(x), fast(x), atol=0, rtol=0)
    packed = {id(m.packed_weight) for m in fast.model.modules() if hasattr(m, "packed_weight")}
    assert packed == {id(m.packed_weight) for m in copied.model.modules() if hasattr(m, "packed_weight")}
    if precision != "int8" or int8.int8_kernel() == "onednn":
        assert packed  # where vitkit's packed layers run
    tensors = {id(t) for t in (*fast.parameters(), *fast.buffers())}
    assert tensors and not tensors & {id(t) for t in (*copied.parameters(), *copied.buffers())}


@pytest.mark.parametrize("change", ["load_state_dict", "in place", "cast", "replaced"])
def test_a_fast_model_refuses_a_call_once_its_models_weights_have_changed(change):
    """It computes with the weights as they were (Linear layers packed; compiled, every weight a constant): after the
    model's weights change, a call is an error naming one, not outputs of old weights or of old and new mixed (the
    packed Linear weights old, the shared biases and norms new). A model optimised again computes with the new."""
    model = tiny_vit()
    fast = optimize_for_inference(model, "fp32", compile="none")
    x = torch.randn(3, 3, 32, 32)
    fast(x)
    other = tiny_vit()
    nn.init.normal_(other.blocks[0].attn.qkv.weight)
    if change == "load_state_dict":
        model.load_state_dict(other.state_dict())
    elif change == "in place":
        with torch.no_grad():
            model.blocks[0].attn.qkv.weight.mul_(2)
    elif change == "cast":
        model.double()
    else:
        model.blocks[0].norm1.weight.data = torch.ones(TINY["width"])
    with pytest.raises(UserError, match=r"the model's [\w.]+ has changed since this fast model was made"):
        fast(x)
    with pytest.raises(UserError, match="call optimize_for_inference on the model again"):
        copy.deepcopy(fast)
    model.float()
    again = optimize_for_inference(model, "fp32", compile="none")
    with torch.no_grad():
        torch.testing.assert_close(again(x), model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "int8"])
def test_a_model_made_under_inference_mode_is_optimised_and_its_later_changes_are_seen(precision, monkeypatch):
    """Everything under torch.inference_mode (the model built, optimised, loaded, called), whose tensors keep no
    version counter: the fast model computes the model's function, and a later load_state_dict, in or out of
    inference mode, is refused rather than answered with the old weights."""
    monkeypatch.setattr(inference, "bf16_is_fast", lambda device: True)  # bf16's own path, emulated or not
    x = torch.randn(3, 3, 32, 32)
    want = tiny_vit()(x).detach()
    other = tiny_vit()
    nn.init.normal_(other.head.weight)
    tol = {"fp32": 1e-5, "bf16": 5e-2, "int8": 1e-1}[precision] * max(1.0, float(want.abs().max()))
    for load_inside in (True, False):
        with torch.inference_mode():
            model = tiny_vit()
            fast = optimize_for_inference(model, precision, compile="none")
            torch.testing.assert_close(fast(x), want, atol=tol, rtol=0)
            torch.testing.assert_close(copy.deepcopy(fast)(x), fast(x), atol=0, rtol=0)
        if precision == "int8":  # a copy: the model's later changes leave it alone
            continue
        with torch.inference_mode(load_inside):
            model.load_state_dict(other.state_dict())
            with pytest.raises(UserError, match="the model's [\\w.]+ has changed since this fast model was made"):
                fast(x)


HOOKED = ("blocks.0.mlp.fc2", "blocks.1.mlp.fc1")


def hooked_tiny_vit() -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    """tiny_vit with a hook on each layer in HOOKED (the first MLP's branch switched off, the second's input
    doubled), an input, and the model's outputs on it before and after the hooks."""
    model = tiny_vit()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        unhooked = model(x)
    layers = dict(model.named_modules())
    layers[HOOKED[0]].register_forward_hook(lambda m, args, out: out * 0)
    layers[HOOKED[1]].register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    with torch.no_grad():
        hooked = model(x)
    return model, x, unhooked, hooked


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_a_fast_model_keeps_the_layers_that_have_hooks_and_runs_them(precision):
    """A Linear layer with a hook (an adapter, a mask, a probe) is not packed, quantised or fused with its GELU: the
    replacement would not run the hook. The fast model computes what the model with its hooks computes."""
    model, x, unhooked, hooked = hooked_tiny_vit()
    fast = optimize_for_inference(model, precision, compile="none")
    blocks = fast.model.blocks
    assert type(blocks[0].mlp.fc2) is nn.Linear and type(blocks[1].mlp.fc1) is nn.Linear
    if precision == "fp32" or int8.int8_kernel() == "onednn":  # vitkit's layers replace the others
        assert type(blocks[0].mlp.fc1) is not nn.Linear
    got = fast(x)
    if precision == "fp32":
        torch.testing.assert_close(got, hooked, atol=1e-5, rtol=1e-5)
    else:  # int8's own error is far below what the hooks change
        assert (got - hooked).abs().max() < 0.1 * (unhooked - hooked).abs().max()


def test_fbgemms_int8_keeps_the_layers_that_have_hooks_and_runs_them():
    """The kernel int8 runs on CPUs without VNNI, asked for by name on any CPU: torch's dynamic quantisation
    replaces the plain Linear layers alone; a hooked layer stays an fp32 nn.Linear, and its hook runs."""
    model, x, unhooked, hooked = hooked_tiny_vit()
    quantised = int8.quantize_int8(model, "fbgemm")
    layers = dict(quantised.named_modules())
    linears = {name: type(layers[name]) for name, m in model.named_modules() if type(m) is nn.Linear}
    assert all(linears.pop(name) is nn.Linear for name in HOOKED)
    assert len(linears) == 7 and set(linears.values()) == {torch.ao.nn.quantized.dynamic.Linear}  # the others
    with torch.no_grad():
        got = quantised(x)
    assert (got - hooked).abs().max() < 0.1 * (unhooked - hooked).abs().max()


def test_an_int8_model_is_a_copy_the_models_later_changes_leave_alone():
    model = tiny_vit()
    fast = optimize_for_inference(model, "int8", compile="none")
    assert type(fast.model.blocks[-1]) is FirstTokenBlock and type(model.blocks[-1]) is Block
    x = torch.randn(3, 3, 32, 32)
    before = fast(x)
    with torch.no_grad():
        model.blocks[0].attn.qkv.weight.mul_(2)
    torch.testing.assert_close(fast(x), before, atol=0, rtol=0)  # quantised from a copy: the weights as they were


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_a_token_merging_model_merges_in_its_fast_copy(precision):
    """Token merging is part of the model's function: the fast copy merges as the model does (and computes every
    token of its last block: the first-token patch does not apply to a merging model)."""
    model = apply_token_merging(tiny_vit(), 3)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        want, unmerged = model(x), model.forward_head(model.forward_features(x))
    fast = optimize_for_inference(model, precision, compile="none")
    assert type(fast.model) is type(model) and not isinstance(fast.model.blocks[-1], FirstTokenBlock)
    got = fast(x)
    if precision == "fp32":
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:  # int8's own error is far below what merging changes
        assert (got - want).abs().max() < 0.2 * (unmerged - want).abs().max()


@ONEDNN
@COMPILES
def test_packed_copy_compiles_to_the_models_function():
    model = tiny_vit()
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        want = model(x)
    fast = optimize_for_inference(model, "fp32", compile="default")
    assert isinstance(fast.model.blocks[0].attn.qkv, PackedLinear)
    torch.testing.assert_close(fast(x), want, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------------- CUDA
def test_on_cuda_the_defaults_are_bf16_compiled_and_close_to_fp32(device):
    """The switch's defaults on a CUDA model: bf16 and torch.compile; outputs within the CPU tests' bf16 bound."""
    if device.type != "cuda":
        pytest.skip("needs CUDA")
    model = tiny_vit().to(device)
    x = torch.randn(3, 3, 32, 32).to(device)
    with torch.no_grad():
        want = model(x)
    fast = optimize_for_inference(model)
    assert fast.precision == "bf16" and fast.dtype == torch.bfloat16 and fast.compile_mode != "none"
    assert next(fast.parameters()).dtype == torch.bfloat16
    got = fast(x)
    assert got.dtype == torch.float32 and got.device == x.device
    assert float((got - want).abs().max()) <= 5e-2 * max(1.0, float(want.abs().max()))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_on_cuda_reduce_overhead_results_survive_the_next_call(precision, device):
    """compile="reduce-overhead" replays CUDA graphs, whose output buffer the next replay overwrites: each call's
    result stays its own, in fp32 (returned as computed) as in bf16 (cast back to fp32)."""
    if device.type != "cuda":
        pytest.skip("needs CUDA")
    model = tiny_vit().to(device)
    x1, x2 = torch.randn(2, 3, 3, 32, 32).to(device)
    with torch.no_grad():
        want1, want2 = model(x1), model(x2)
    fast = optimize_for_inference(model, precision, compile="reduce-overhead")
    for _ in range(3):  # warm-up, then the graph is recorded and replayed
        fast(x1)
    got1 = fast(x1)
    got2 = fast(x2)
    tol = 1e-4 if precision == "fp32" else 5e-2
    assert torch.allclose(got1, want1, atol=tol * max(1.0, float(want1.abs().max())), rtol=0)
    assert torch.allclose(got2, want2, atol=tol * max(1.0, float(want2.abs().max())), rtol=0)
