"""The written-out attention's products for a one-row query (the class-token-only last block) in fp32 training on a
CPU: b's gradient formed as a broadcast product, the numbers of the batched gemm bit for bit and of float64 within
fp32 rounding, in a model too, and only where it is meant to run."""

from __future__ import annotations

import pytest
import torch

import vitkit.models.attention as attention
from vitkit.models import VisionTransformer

TINY = dict(img_size=32, patch_size=8, width=32, depth=2, num_heads=4, mlp_dim=64, num_classes=5)


def _grads(fn, a: torch.Tensor, b: torch.Tensor, go: torch.Tensor) -> list[torch.Tensor]:
    a, b = (t.detach().clone().requires_grad_() for t in (a, b))
    out = fn(a, b)
    out.backward(go)
    return [out.detach(), a.grad, b.grad]


@pytest.mark.parametrize("shape", [(8, 4, 17, 16), (3, 6, 197, 64), (2, 3, 5, 1)])  # (B, heads, N, K)
def test_the_one_row_product_is_the_batched_gemm_bit_for_bit_and_float64_within_rounding(shape):
    B, nh, N, K = shape
    g = torch.Generator().manual_seed(0)
    a = torch.randn(B, nh, 1, K, generator=g)
    b = torch.randn(B, nh, N, K, generator=g).transpose(-2, -1)  # a transposed view, as k^T is
    go = torch.randn(B, nh, 1, N, generator=g)
    ours = _grads(attention._product, a, b, go)
    plain = _grads(torch.matmul, a, b, go)
    wide = _grads(torch.matmul, a.double(), b.double(), go.double())
    for x, y, z in zip(ours, plain, wide):
        assert x.shape == y.shape and torch.equal(x, y)
        assert torch.allclose(x.double(), z, rtol=1e-5, atol=1e-5)


def _train_step(monkeypatch, one_row: bool) -> tuple[list[torch.Tensor], int]:
    """One fp32 training step of a tiny ViT on the written-out path: logits and every gradient, and how many
    products went through the one-row function."""
    calls = []
    apply = attention._OneRowProduct.apply
    monkeypatch.setattr(attention._OneRowProduct, "apply", lambda *t: calls.append(1) or apply(*t))
    if not one_row:
        monkeypatch.setattr(attention, "_product", torch.matmul)
    torch.manual_seed(0)
    model = VisionTransformer(**TINY, attn_impl="explicit").train()
    with torch.no_grad():
        model.head.weight.normal_(std=0.5)
    x, y = torch.randn(8, 3, 32, 32), torch.arange(8) % 5
    logits = model(x)
    torch.nn.functional.cross_entropy(logits, y).backward()
    monkeypatch.undo()
    return [logits.detach(), *(p.grad for p in model.parameters())], len(calls)


def test_a_training_step_is_the_batched_gemms_step_bit_for_bit(monkeypatch):
    ours, used = _train_step(monkeypatch, one_row=True)
    plain, unused = _train_step(monkeypatch, one_row=False)
    assert (used, unused) == (2, 0)  # the last block's two products: its class query's logits and output
    for a, b in zip(ours, plain):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["no grad", "bf16 autocast", "two rows", "float64"])
def test_the_cases_it_does_not_cover_keep_the_plain_product(monkeypatch, case):
    calls = []
    monkeypatch.setattr(attention._OneRowProduct, "apply", lambda *t: calls.append(1))
    n, dtype = (2 if case == "two rows" else 1), (torch.float64 if case == "float64" else torch.float32)
    a = torch.randn(2, 3, n, 4, dtype=dtype, requires_grad=True)
    b = torch.randn(2, 3, 4, 5, dtype=dtype, requires_grad=True)
    if case == "no grad":
        with torch.no_grad():
            out = attention._product(a, b)
    elif case == "bf16 autocast":
        with torch.autocast("cpu", torch.bfloat16):
            out = attention._product(a, b)
    else:
        out = attention._product(a, b)
    assert calls == [] and out.shape == (2, 3, n, 5)


def test_a_gradient_of_the_gradient_is_the_batched_gemms():
    """Its backward pass is torch's ops, recorded where autograd builds a graph: a gradient penalty's gradients are
    those of the plain product."""
    g = torch.Generator().manual_seed(0)
    a0, b0 = torch.randn(2, 3, 1, 16, generator=g), torch.randn(2, 3, 16, 17, generator=g)

    def second(fn) -> list[torch.Tensor]:
        a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
        out = fn(a, b)
        assert (type(out.grad_fn).__name__ == "_OneRowProductBackward") == (fn is attention._product)
        ga, gb = torch.autograd.grad(out.square().sum(), (a, b), create_graph=True)
        return list(torch.autograd.grad(ga.square().sum() + gb.square().sum(), (a, b)))

    for x, y in zip(second(attention._product), second(torch.matmul), strict=True):
        assert (x - y).abs().max() <= 1e-6 * y.abs().max()  # another order of summation
