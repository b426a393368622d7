"""Stochastic depth (drop_path) and per-block activation checkpointing (grad_checkpointing) in the ViT."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vitkit.errors import ConfigError
from vitkit.models.vit import Block, DropPath, VisionTransformer, ViTConfig, drop_path_rates

SMALL = dict(img_size=32, patch_size=8, width=64, depth=4, num_heads=4, mlp_dim=128, num_classes=10)


def small(**overrides) -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(**{**SMALL, **overrides})
    with torch.no_grad():  # the official head is zero-initialised, which would leave every other gradient zero
        model.head.weight.normal_(std=0.1)
    return model


# --------------------------------------------------------------------------------------------- config


def test_defaults_off_and_validated():
    cfg = ViTConfig()
    assert cfg.drop_path == 0.0 and cfg.grad_checkpointing is False
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ConfigError, match="drop_path"):
            ViTConfig(drop_path=bad)
    cfg = ViTConfig(drop_path=0.1, grad_checkpointing=True)
    assert ViTConfig(**{k: v for k, v in cfg.to_dict().items() if k != "arch"}) == cfg


def test_state_dict_unchanged_by_the_levers():
    plain = VisionTransformer(**SMALL).state_dict()
    both = VisionTransformer(**SMALL, drop_path=0.3, grad_checkpointing=True).state_dict()
    assert plain.keys() == both.keys()


def test_rates_linear_over_depth():
    assert drop_path_rates(0.2, 5) == pytest.approx([0.0, 0.05, 0.1, 0.15, 0.2])
    model = VisionTransformer(**{**SMALL, "depth": 12}, drop_path=0.1)
    for i, blk in enumerate(model.blocks):
        assert blk.drop_path1.p == pytest.approx(0.1 * i / 11)
        assert blk.drop_path2.p == blk.drop_path1.p
    assert model.blocks[0].drop_path1.p == 0.0 and model.blocks[-1].drop_path1.p == pytest.approx(0.1)


# --------------------------------------------------------------------------------------------- drop path


def test_drop_path_identity_in_eval():
    x = torch.randn(8, 5, 3)
    assert DropPath(0.7).eval()(x) is x
    assert DropPath(0.0).train()(x) is x
    ref = small().eval()
    dropped = small(drop_path=0.5, dropout=0.2, attn_dropout=0.2).eval()
    images = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        for impl in ("sdpa", "explicit"):
            assert torch.equal(ref(images, attn_impl=impl), dropped(images, attn_impl=impl))
            assert torch.equal(ref.forward_features(images, impl), dropped.forward_features(images, impl))


class _Const(nn.Module):
    """A residual branch whose output is known: value everywhere, whatever the input."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def forward(self, x, rel=None, explicit=False, attention=None):
        return torch.full(x.shape, self.value)


@pytest.mark.parametrize("path", ["sdpa", "explicit"])
def test_drop_path_drops_whole_samples_at_the_rate(path):
    p, B, N, D = 0.3, 20000, 3, SMALL["width"]
    blk = Block(ViTConfig(**SMALL), drop_path=p).train()
    blk.attn, blk.mlp = _Const(1.0), _Const(2.0)  # the MLP branch's value tells the two branches apart
    x = torch.zeros(B, N, D)
    torch.manual_seed(1)
    out = blk(x, explicit=path == "explicit")
    # a sample's branch is dropped or kept whole: every element of it has the same value
    assert torch.equal(out, out[:, :1, :1].expand_as(out))
    v = out[:, 0, 0]
    scale = 1 / (1 - p)
    attn_kept = torch.isclose(v, torch.tensor(scale)) | torch.isclose(v, torch.tensor(3 * scale))
    mlp_kept = torch.isclose(v, torch.tensor(2 * scale)) | torch.isclose(v, torch.tensor(3 * scale))
    # the only values: 0 (both dropped), 1/(1-p), 2/(1-p), 3/(1-p): kept branches are scaled by 1/(1-p)
    assert bool((attn_kept | mlp_kept | (v == 0)).all())
    se = math.sqrt(p * (1 - p) / B)
    assert abs((~attn_kept).float().mean().item() - p) < 4 * se
    assert abs((~mlp_kept).float().mean().item() - p) < 4 * se
    # the branches are dropped independently
    both = (~attn_kept & ~mlp_kept).float().mean().item()
    assert abs(both - p * p) < 4 * math.sqrt(p * p * (1 - p * p) / B)


def test_drop_path_keeps_the_expectation():
    torch.manual_seed(2)
    x = torch.ones(200000, 1)
    y = DropPath(0.25).train()(x)
    assert bool(((y == 0) | torch.isclose(y, torch.tensor(4 / 3))).all())
    assert abs(y.mean().item() - 1.0) < 4 * math.sqrt(0.25 * 0.75 / x.shape[0]) * 4 / 3


def test_drop_path_changes_training_outputs_only():
    model = small(drop_path=0.5).train()
    images = torch.randn(16, 3, 32, 32)
    torch.manual_seed(3)
    a = model(images)
    b = model(images)
    assert not torch.equal(a, b)  # different masks each call


# --------------------------------------------------------------------------------------------- checkpointing


def _loss_and_grads(model, images, labels, seed, impl):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = F.cross_entropy(model(images, attn_impl=impl), labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "regularise", [{}, {"dropout": 0.1, "attn_dropout": 0.1, "drop_path": 0.3}], ids=["plain", "dropout+droppath"]
)
@pytest.mark.parametrize("classifier", ["token", "gap"])
@pytest.mark.parametrize("impl", ["sdpa", "explicit"])
def test_checkpointing_gives_identical_loss_and_gradients(regularise, classifier, impl):
    plain = small(classifier=classifier, **regularise).train()
    ckpt = small(classifier=classifier, grad_checkpointing=True, **regularise).train()
    ckpt.load_state_dict(plain.state_dict())
    images, labels = torch.randn(6, 3, 32, 32), torch.randint(0, 10, (6,))
    loss_a, grads_a = _loss_and_grads(plain, images, labels, 7, impl)
    loss_b, grads_b = _loss_and_grads(ckpt, images, labels, 7, impl)
    assert torch.equal(loss_a, loss_b)
    for name, g in grads_a.items():
        torch.testing.assert_close(grads_b[name], g, rtol=0, atol=1e-6, msg=name)
    if regularise:  # the randomness mattered: another seed gives another loss
        loss_c, _ = _loss_and_grads(plain, images, labels, 8, impl)
        assert not torch.equal(loss_a, loss_c)


def test_checkpointing_recomputes_blocks_in_training_only():
    model = small(grad_checkpointing=True)
    calls = []
    for blk in model.blocks:
        blk.register_forward_pre_hook(lambda m, args: calls.append(m))
    images = torch.randn(2, 3, 32, 32)
    model.train()
    model(images).sum().backward()
    assert len(calls) == 2 * len(model.blocks)  # forward, then once more in the backward pass
    calls.clear()
    with torch.no_grad():
        model(images)
    model.eval()
    out = model(images)
    assert len(calls) == 2 * len(model.blocks)  # no recomputation without a backward pass or in eval
    ref = small().eval()
    assert torch.equal(out, ref(images))


def test_every_parameter_gets_a_gradient_with_both_levers():
    model = small(drop_path=0.1, dropout=0.1, attn_dropout=0.1, grad_checkpointing=True).train()
    images, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    torch.manual_seed(0)
    F.cross_entropy(model(images), labels).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
