"""vitkit.accel's own autograd functions (oneDNN Dense layers, the fused MLP, tanh-GELU kernels) give way to torch's
ops under torch.func transforms and forward-mode AD, and their backward passes under batched gradients' vmap: a
training-mode ViT optimised for training, at the sizes where all of them run, gives the float64 plain model's
gradients and tangents there, to fp32 rounding, and a loop's gradients."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.func import functional_call, grad, jvp

from vitkit.accel import cpu, kernels, optimize_for_training
from vitkit.accel.first_token import FirstTokenViT
from vitkit.accel.kernels import transformed
from vitkit.models import VisionTransformer

pytestmark = pytest.mark.skipif(not cpu.has_onednn(), reason="oneDNN on x86 only")

# 32 images of 65 tokens of width 128: 2,080 rows, 1.06M hidden activations (oneDNN's and the fp32 kernels' sizes)
CFG = dict(img_size=32, patch_size=4, width=128, depth=2, num_heads=2, mlp_dim=512, num_classes=5, attn_impl="explicit")


def model_and_batch(optimised: bool = True) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The model (optimised for training, or the plain one) and a batch."""
    torch.manual_seed(0)
    model = VisionTransformer(**CFG).train()
    with torch.no_grad():
        model.head.weight.normal_(std=0.1)
    if optimised:
        optimize_for_training(model)
    return model, torch.randn(32, 3, 32, 32), torch.arange(32) % 5


def own_functions(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of vitkit's autograd functions applied from now on."""
    applied: list[str] = []
    for fn in (cpu._OneDnnLinear, cpu._OneDnnLinearAutocast, cpu._GeluLinear, kernels._GeluTanh):
        apply = fn.apply
        monkeypatch.setattr(fn, "apply", lambda *a, _f=fn, _apply=apply: applied.append(_f.__name__) or _apply(*a))
    return applied


def close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    return bool((a.double() - b.double()).abs().max() <= rel * b.double().abs().max())


def test_the_model_runs_them_outside_the_transforms(monkeypatch):
    applied = own_functions(monkeypatch)
    model, x, y = model_and_batch()
    assert isinstance(model, FirstTokenViT)
    F.cross_entropy(model(x), y).backward()
    assert {"_OneDnnLinear", "_GeluLinear"} <= set(applied)
    assert not transformed()


def test_func_grad_gives_float64s_gradients(monkeypatch):
    model, x, y = model_and_batch()
    wide = model_and_batch(optimised=False)[0].double()
    F.cross_entropy(wide(x.double()), y).backward()
    applied = own_functions(monkeypatch)
    params = dict(model.named_parameters())
    grads = grad(lambda p: F.cross_entropy(functional_call(model, p, (x,)), y))(params)
    assert applied == []
    for name, p in wide.named_parameters():
        assert close(grads[name], p.grad), name


def test_forward_mode_ad_gives_func_jvps_tangent_and_float64s(monkeypatch):
    model, x, _ = model_and_batch()
    tangent = torch.randn_like(x)
    _, ref = jvp(model_and_batch(optimised=False)[0].double(), (x.double(),), (tangent.double(),))
    applied = own_functions(monkeypatch)
    with fwAD.dual_level():
        assert transformed()
        out = fwAD.unpack_dual(model(fwAD.make_dual(x, tangent))).tangent
    assert applied == [] and not transformed()
    _, via_func = jvp(model, (x,), (tangent,))
    assert close(out, ref) and close(via_func, ref)


def test_the_bf16_gelu_kernel_gives_way_under_func_grad(monkeypatch):
    applied = own_functions(monkeypatch)
    x = torch.randn(4, 1000, dtype=torch.bfloat16)
    act = kernels.TanhGELU(approximate="tanh")
    got = grad(lambda t: act(t).float().sum())(x)
    assert applied == []
    x64 = x.double().requires_grad_()
    F.gelu(x64, approximate="tanh").sum().backward()
    assert close(got, x64.grad, rel=1e-2)


@pytest.mark.parametrize(
    "autocast", [False, pytest.param(True, marks=pytest.mark.onednn_bf16)], ids=["fp32", "bf16-autocast"]
)
def test_batched_gradients_are_the_loops(monkeypatch, autocast):
    """torch.autograd.grad(..., is_grads_batched=True) runs the backward pass under a vmap (as jacobian(...,
    vectorize=True) does): vitkit's functions' backward passes (here every one of them: the oneDNN layers, the
    GELU kernels and the fused MLP) then compute with torch's ops, and give what a loop over the gradients gives."""
    applied = own_functions(monkeypatch)
    model, x, _ = model_and_batch()
    x.requires_grad_()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        out = model(x).float()
    assert {"_GeluLinear", "_OneDnnLinearAutocast" if autocast else "_OneDnnLinear"} <= set(applied)
    assert ("_GeluTanh" in applied) == autocast  # the first-token block's bf16 GELU (in fp32 below the kernels' size)
    grads = torch.randn(3, *out.shape)
    (batched,) = torch.autograd.grad(out, x, grads, is_grads_batched=True, retain_graph=True)
    loop = torch.stack([torch.autograd.grad(out, x, g, retain_graph=True)[0] for g in grads])
    assert close(batched, loop, rel=1e-5 if not autocast else 2e-2)
