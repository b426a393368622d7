"""accel.first_token: a first-token ViT's forward() running its last block for the first token alone, applied by
first_token_forward and optimize_for_training: the plain model's logits and gradients, the plain model's layers
called as they are (wrapped, hooked), every token still in forward_features, and where it does not apply."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from vitkit.accel import optimize_for_training
from vitkit.accel.first_token import FirstTokenBlock, FirstTokenViT, first_token_forward
from vitkit.accel.tome import apply_token_merging
from vitkit.models import VisionTransformer, ViTConfig
from vitkit.models.flops import model_flops, vit_flops
from vitkit.models.vit import Block

TINY = dict(img_size=32, patch_size=8, width=32, depth=2, num_heads=4, mlp_dim=64, num_classes=5)
PATCHES = 16  # a 4 x 4 grid
PATCHERS = {"first_token_forward": first_token_forward, "optimize_for_training": optimize_for_training}


def tiny(**overrides) -> VisionTransformer:
    """A tiny ViT whose every parameter is random (the zero head and zero class token would hide differences)."""
    torch.manual_seed(0)
    model = VisionTransformer(**{**TINY, **overrides})
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def grads(model: nn.Module, out: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of the squared outputs; zeros for one the outputs do not reach (the last block's
    relative table, which the class token does not read, is not in the first-token path's graph at all)."""
    params = dict(model.named_parameters())
    got = torch.autograd.grad(out.square().sum(), list(params.values()), allow_unused=True, materialize_grads=True)
    return dict(zip(params, got, strict=True))


def assert_same_function(patched: nn.Module, plain: nn.Module, x: torch.Tensor, **kwargs) -> None:
    """Logits, and every parameter's gradient of their squares, as the plain model's to 1e-5 relative."""
    want, got = plain(x, **kwargs), patched(x, **kwargs)
    torch.testing.assert_close(got, want, atol=1e-5 * float(want.detach().abs().max()), rtol=1e-5)
    want_grads, got_grads = grads(plain, want), grads(patched, got)
    assert got_grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        scale = float(g.abs().max())  # large: the squared logits of a random head
        torch.testing.assert_close(got_grads[name], g, atol=1e-5 * scale, rtol=1e-5, msg=name)


def last_mlp_rows(model: VisionTransformer) -> list[tuple[int, ...]]:
    """The shapes the last block's MLP receives from now on."""
    seen: list[tuple[int, ...]] = []
    model.blocks[-1].mlp.fc1.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    return seen


@pytest.mark.parametrize("patch", PATCHERS)
@pytest.mark.parametrize("attn_impl", ["sdpa", "explicit"])
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"representation_size": 24},
        {"depth": 1},
        {"pos_embed": "relative"},
        {"pos_embed": "relative_2d"},
        {"pos_embed_where": "every_layer"},
        {"classifier": "first"},
        {"classifier": "first", "pos_embed": "relative_2d"},
    ],
    ids=["token", "pre_logits", "depth1", "relative", "relative_2d", "every_layer", "first", "first_relative_2d"],
)
def test_forward_runs_the_last_block_on_the_first_token_alone_with_the_plain_logits_and_gradients(
    overrides, attn_impl, patch, device
):
    plain = tiny(**overrides).to(device).train()  # no dropout: both are deterministic
    model = copy.deepcopy(plain)
    applied = PATCHERS[patch](model)
    assert applied is (model if patch == "optimize_for_training" else True)
    assert type(model) is FirstTokenViT and type(model.blocks[-1]) is FirstTokenBlock
    assert all(type(b) is Block for b in model.blocks[:-1]) and type(plain.blocks[-1]) is Block
    seen = last_mlp_rows(model)
    x = torch.randn(3, 3, 32, 32).to(device)
    assert_same_function(model, plain, x, attn_impl=attn_impl)
    assert seen == [(3, 1, TINY["width"])]  # forward(): the first token alone
    tokens = model.num_prefix_tokens + PATCHES
    features = model.forward_features(x, attn_impl=attn_impl)
    assert seen[-1] == (3, tokens, TINY["width"]) and features.shape == (3, tokens, TINY["width"])
    torch.testing.assert_close(features, plain.forward_features(x, attn_impl=attn_impl))
    inter = model.forward_intermediates(x, attn_impl=attn_impl)
    assert inter["encoded"].shape == (3, tokens, TINY["width"])
    assert model.state_dict().keys() == plain.state_dict().keys()


class _Delta(nn.Module):
    """A wrapped projection, as adapters (LoRA) make: the base Linear plus a learned correction."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base, self.delta = base, nn.Linear(base.in_features, base.out_features, bias=False)
        nn.init.normal_(self.delta.weight, std=0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.delta(x)


def test_a_wrapped_qkv_projection_runs_as_it_is():
    plain = tiny()
    plain.blocks[-1].attn.qkv = _Delta(plain.blocks[-1].attn.qkv)
    model = copy.deepcopy(plain)
    first_token_forward(model)
    seen: list[tuple[int, ...]] = []
    model.blocks[-1].attn.qkv.delta.register_forward_hook(lambda m, args, out: seen.append(tuple(out.shape)))
    assert_same_function(model, plain, torch.randn(2, 3, 32, 32))
    assert seen == [(2, 1 + PATCHES, 3 * TINY["width"])]  # called on every token, its queries then sliced


def test_a_hooked_qkv_projection_runs_by_its_call():
    """Hooks on every block's Dense layers fire in the last block too: its qkv layer, whose weight the first-token
    path otherwise splits by rows, is called as it is where it has a hook, with the same output."""
    plain = tiny()
    model = copy.deepcopy(plain)
    first_token_forward(model)
    seen: list[tuple[int, tuple[int, ...]]] = []
    for i, block in enumerate(model.blocks):
        block.attn.qkv.register_forward_hook(lambda m, args, out, i=i: seen.append((i, tuple(out.shape))))
    assert_same_function(model, plain, torch.randn(2, 3, 32, 32))
    assert seen == [(i, (2, 1 + PATCHES, 3 * TINY["width"])) for i in range(TINY["depth"])]
    assert [tuple(b.attn.qkv._forward_hooks) for b in plain.blocks] == [(), ()]  # the plain copy has none


def test_with_dropout_the_last_block_draws_masks_for_the_first_token_alone():
    """In training with dropout the blocks before the last draw the plain model's masks (the same RNG draws in the
    same order); the last block draws its masks for the first token alone, (B, 1, .), so from there on the two runs
    differ, as two draws of the masks do. In eval mode dropout is off and the logits are the plain model's."""
    plain = tiny(dropout=0.2, attn_dropout=0.2, drop_path=0.2).train()
    model = copy.deepcopy(plain)
    optimize_for_training(model)
    x = torch.randn(3, 3, 32, 32)
    inputs: dict[str, list[torch.Tensor]] = {"plain": [], "patched": []}
    masked: list[tuple[int, ...]] = []
    for name, m in (("plain", plain), ("patched", model)):
        m.blocks[-1].register_forward_pre_hook(lambda mod, args, name=name: inputs[name].append(args[0]))
    for drop in (model.blocks[-1].attn.proj_drop, model.blocks[-1].mlp.drop):
        drop.register_forward_hook(lambda mod, args, out: masked.append(tuple(args[0].shape)))
    torch.manual_seed(1)
    want = plain(x)
    torch.manual_seed(1)
    got = model(x)
    assert torch.equal(inputs["patched"][0], inputs["plain"][0])  # every mask before the last block the same
    assert masked == [(3, 1, TINY["width"]), (3, 1, TINY["mlp_dim"]), (3, 1, TINY["width"])]
    assert not torch.allclose(got, want)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), plain.eval()(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "overrides", [{"grad_checkpointing": True}, {"classifier": "gap"}, {"classifier": "map"}], ids=lambda o: str(o)
)
def test_it_does_not_apply_with_checkpointing_or_a_head_that_reads_every_token(overrides):
    """Gradient checkpointing recomputes the last block after forward() has returned (with every token); a 'gap'
    or 'map' head reads every token of the last block."""
    plain = tiny(**overrides).train()
    model = copy.deepcopy(plain)
    assert first_token_forward(model) is False
    optimize_for_training(model)
    assert type(model) is VisionTransformer and all(type(b) is Block for b in model.blocks)
    seen = last_mlp_rows(model)
    assert_same_function(model, plain, torch.randn(2, 3, 32, 32))
    assert seen[0] == (2, model.num_prefix_tokens + PATCHES, TINY["width"])


def test_it_does_not_apply_to_a_token_merging_model_or_a_subclass():
    model = apply_token_merging(tiny(), 2)
    merging = type(model)
    assert first_token_forward(model) is False
    optimize_for_training(model)
    assert type(model) is merging and not any(isinstance(b, FirstTokenBlock) for b in model.blocks)

    class Custom(VisionTransformer):
        pass

    custom = Custom(**TINY)
    assert first_token_forward(custom) is False and type(custom.blocks[-1]) is Block


def test_always_gives_the_first_token_alone_in_every_call():
    """optimize_for_inference's copy: the last block always computes the first token alone, forward_features' too;
    the model's class stays (no state switched per call)."""
    plain = tiny().eval()
    model = copy.deepcopy(plain)
    assert first_token_forward(model, always=True)
    assert type(model) is VisionTransformer and type(model.blocks[-1]) is FirstTokenBlock
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), atol=1e-5, rtol=1e-5)
        assert model.forward_features(x).shape == (2, 1, TINY["width"])


def test_patching_twice_changes_nothing_more():
    plain = tiny()
    model = copy.deepcopy(plain)
    optimize_for_training(model)
    optimize_for_training(model)
    assert first_token_forward(model) is True and type(model) is FirstTokenViT
    assert_same_function(model, plain, torch.randn(2, 3, 32, 32))


def counted_flops(model: nn.Module, img_size: int) -> int:
    """FlopCounterMode's count for one image's forward(), on the meta device (shapes only)."""
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.empty(1, 3, img_size, img_size, device="meta"))
    return counter.get_total_flops()


def test_vit_b16_flops_with_first_token_golden():
    # the last block keeps keys and values of all 197 tokens; query, projection and MLP of the class token only
    assert vit_flops(ViTConfig(), first_token=True)["total"] == 32_696_930_304
    assert vit_flops(ViTConfig(classifier="gap"), first_token=True) == vit_flops(ViTConfig(classifier="gap"))


@pytest.mark.parametrize(
    "overrides",
    [
        {"representation_size": 24},
        {"classifier": "first"},
        {"pos_embed": "relative_2d"},
        {"classifier": "first", "pos_embed": "relative_2d"},  # its one query is a patch: it reads the table
    ],
    ids=["pre_logits", "first", "relative_2d", "first_relative_2d"],
)
def test_flops_of_the_patched_forward_are_counted_with_first_token(overrides):
    with torch.device("meta"):
        model = VisionTransformer(**{**TINY, **overrides})
    assert counted_flops(model, 32) == model_flops(model, 32)  # as built: every token
    first_token_forward(model)
    assert counted_flops(model, 32) == model_flops(model, 32, first_token=True) < model_flops(model, 32)
