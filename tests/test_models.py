"""The model family: golden parameter counts, both attention paths, gradients, resolution changes, numerics."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

import vitkit
from vitkit import UserError
from vitkit.models import MODELS, ResNet, VisionTransformer, create_model, resample_pos_embed, sincos_2d
from vitkit.models.resnet import StdConv2d, group_norm, same_padding

# Parameter counts with a 1000-class head. vit_b16 and r50_vit_b16 are the official figures (vit_jax tests,
# PAPER.md); the others are what this implementation builds and pin the variant table.
GOLDEN_PARAMS = {
    "vit_ti16": 5_717_416,
    "vit_s16": 22_050_664,
    "vit_s32": 22_878_952,
    "vit_b8": 86_576_872,
    "vit_b16": 86_567_656,
    "vit_b32": 88_224_232,
    "vit_l16": 304_326_632,
    "vit_l32": 306_535_400,
    "vit_h14": 632_045_800,
    "vit_s16_gap": 22_049_896,
    "vit_b16_gap": 86_566_120,
    "vit_s32_gap": 22_878_184,
    "vit_b32_gap": 88_222_696,
    "r_vit_ti32": 6_337_704,
    "r50_vit_b16": 98_659_112,
    "r50_vit_l32": 328_994_856,
    "r26_vit_s32": 36_431_912,
    "r26_vit_b32": 101_383_976,
    "bit_r50x1": 25_549_352,  # BiT ResNet-v2: timm's resnetv2_*_bit counts (tests/test_bit.py)
    "bit_r50x3": 217_319_080,
    "bit_r101x1": 44_541_480,
    "bit_r101x3": 387_934_888,
    "bit_r152x2": 236_335_208,
    "bit_r152x4": 936_533_224,
    "hybrid_resnet_r26x1": 15_995_176,  # the hybrids' post-activation ResNet (named bit_r* before)
    "hybrid_resnet_r50x1": 25_557_032,
    "hybrid_resnet_r50x3": 217_342_120,
    "hybrid_resnet_r101x1": 44_549_160,
    "hybrid_resnet_r101x3": 387_957_928,
    "hybrid_resnet_r152x2": 236_350_568,
    "hybrid_resnet_r152x4": 936_563_944,
}

TINY = dict(img_size=32, patch_size=8, width=32, depth=2, num_heads=4, mlp_dim=64, num_classes=5)


def tiny(**overrides) -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(**{**TINY, **overrides}).eval()


def randomize_head(model: torch.nn.Module) -> None:
    """The head and each ResNet unit's last GroupNorm scale start at zero (as in the official code), which
    blocks gradients at init; tests that need signal through them make them random."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("head.") or name.endswith("norm3.weight"):
                p.normal_(std=0.5)


def test_every_registered_model_has_a_golden_count():
    assert set(MODELS) == set(GOLDEN_PARAMS), "add the new model's parameter count to GOLDEN_PARAMS"


@pytest.mark.parametrize("name", sorted(GOLDEN_PARAMS))
def test_golden_parameter_counts(name):
    with torch.device("meta"):
        model = create_model(name, num_classes=1000)
    assert model.num_params() == GOLDEN_PARAMS[name]


def test_token_grids_of_the_family():
    grids = {
        "vit_b16": (14, 14),
        "vit_b8": (28, 28),
        "vit_h14": (16, 16),
        "r50_vit_b16": (14, 14),
        "r50_vit_l32": (7, 7),
        "r_vit_ti32": (7, 7),
    }
    with torch.device("meta"):
        for name, grid in grids.items():
            assert create_model(name).grid == grid, name


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"classifier": "gap"},
        {"representation_size": 16},
        {"pos_embed": "learned_2d"},
        {"pos_embed": "sincos_2d"},
        {"pos_embed": "none"},
        {"gelu": "exact", "ln_eps": 1e-12},
        {"resnet_layers": (1,), "patch_size": 1, "img_size": 32},
    ],
    ids=["token", "gap", "pre_logits", "learned_2d", "sincos_2d", "no_posemb", "exact_gelu", "hybrid"],
)
def test_fused_and_explicit_attention_agree_and_every_parameter_gets_a_gradient(overrides, device):
    model = tiny(**overrides)
    randomize_head(model)
    model.to(device)
    x = torch.randn(2, 3, 32, 32).to(device)
    with torch.no_grad():
        fused = model.forward_features(x)
        explicit = model.forward_features(x, attn_impl="explicit")
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)

    inter = model.forward_intermediates(x, return_attention=True)
    torch.testing.assert_close(inter["encoded"], fused, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(inter["logits"], model(x), atol=1e-5, rtol=1e-5)
    n_tokens = model.num_prefix_tokens + model.grid[0] * model.grid[1]
    assert len(inter["attention"]) == TINY["depth"]
    for probs in inter["attention"]:
        assert probs.shape == (2, TINY["num_heads"], n_tokens, n_tokens)
        torch.testing.assert_close(probs.sum(-1), torch.ones(2, TINY["num_heads"], n_tokens, device=device))

    model.train()
    model(x).square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert p.grad.abs().sum() > 0, f"{name} got a zero gradient"


def test_gap_pre_logits_and_output_shapes():
    x = torch.randn(3, 3, 32, 32)
    gap = tiny(classifier="gap")
    assert gap.cls_token is None and gap.pos_embed.shape == (1, 16, 32)
    feats = gap.forward_features(x)
    assert feats.shape == (3, 16, 32)
    torch.testing.assert_close(gap.forward_head(feats, pre_logits=True), feats.mean(1))

    rep = tiny(representation_size=24)
    pre = rep.forward_head(rep.forward_features(x), pre_logits=True)
    assert pre.shape == (3, 24) and pre.abs().max() <= 1  # Dense + tanh
    assert rep(x).shape == (3, 5)
    assert torch.count_nonzero(rep(x)) == 0  # the head starts at zero


def test_reset_classifier_gives_a_zero_head_and_drops_pre_logits():
    model = tiny(representation_size=24)
    randomize_head(model)
    model.reset_classifier(7)
    assert model.pre_logits is None and model.config.representation_size is None
    assert model.config.num_classes == 7 and model.head.weight.shape == (7, 32)
    assert torch.count_nonzero(model.head.weight) == 0 and torch.count_nonzero(model.head.bias) == 0
    model.reset_classifier(0)
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 32)


def test_no_weight_decay_names_embeddings():
    assert tiny().no_weight_decay() == {"cls_token", "pos_embed"}
    assert tiny(classifier="gap", pos_embed="learned_2d").no_weight_decay() == {"pos_embed_x", "pos_embed_y"}


def test_official_initialisation():
    torch.manual_seed(0)
    model = VisionTransformer(img_size=64, patch_size=8, width=256, depth=1, num_heads=4, mlp_dim=512)
    assert torch.count_nonzero(model.cls_token) == 0
    assert torch.count_nonzero(model.head.weight) == 0
    assert abs(model.pos_embed.std().item() - 0.02) < 0.002
    mlp = model.blocks[0].mlp
    assert mlp.fc1.bias.abs().max() < 1e-5 and mlp.fc1.bias.abs().max() > 0  # N(0, 1e-6)
    # xavier_uniform bound on each D x D piece of the fused qkv kernel
    bound = math.sqrt(6 / (256 + 256))
    qkv = model.blocks[0].attn.qkv.weight
    assert qkv.abs().max() <= bound and qkv.abs().max() > 0.95 * bound
    # patch embedding: lecun normal truncated at 2 std; std sqrt(1 / fan_in) after truncation
    w = model.patch_embed.proj.weight
    fan_in = 3 * 8 * 8
    assert abs(w.std().item() - math.sqrt(1 / fan_in)) < 0.05 * math.sqrt(1 / fan_in)
    assert w.abs().max() <= 2 * math.sqrt(1 / fan_in) / 0.87962566103423978 + 1e-6


def test_resample_pos_embed_hand_computed():
    # a 2x2 grid of 1-D embeddings resampled to 3x3 with align_corners=True: corners kept, edges and centre
    # are the means of their neighbours
    grid = torch.tensor([[0.0, 2.0], [4.0, 6.0]]).reshape(1, 4, 1)
    posemb = torch.cat([torch.full((1, 1, 1), 9.0), grid], dim=1)
    out = resample_pos_embed(posemb, (3, 3))
    expected = torch.tensor([9.0, 0, 1, 2, 2, 3, 4, 4, 5, 6]).reshape(1, 10, 1)
    torch.testing.assert_close(out, expected)


def test_resample_pos_embed_matches_the_official_scipy_zoom():
    scipy_ndimage = pytest.importorskip("scipy.ndimage")
    rng = np.random.default_rng(0)
    posemb = rng.normal(size=(1, 1 + 7 * 7, 6)).astype(np.float32)
    grid = posemb[0, 1:].reshape(7, 7, 6)
    zoomed = scipy_ndimage.zoom(grid, (12 / 7, 12 / 7, 1), order=1)
    expected = np.concatenate([posemb[:, :1], zoomed.reshape(1, 144, 6)], axis=1)
    out = resample_pos_embed(torch.from_numpy(posemb), 12)
    np.testing.assert_allclose(out.numpy(), expected, atol=1e-5)


def test_resample_pos_embed_non_square_and_errors():
    posemb = torch.randn(1, 1 + 2 * 3, 4)
    out = resample_pos_embed(posemb, (4, 6), old_grid=(2, 3))
    assert out.shape == (1, 25, 4)
    assert torch.equal(out[:, 0], posemb[:, 0])
    bicubic = resample_pos_embed(posemb, (4, 6), old_grid=(2, 3), mode="bicubic")
    assert bicubic.shape == out.shape and not torch.allclose(bicubic, out)
    with pytest.raises(ValueError, match="not a square"):
        resample_pos_embed(posemb, 4)
    with pytest.raises(ValueError, match="does not match"):
        resample_pos_embed(posemb, 4, old_grid=(2, 2))


@pytest.mark.parametrize("pos_embed", ["learned", "learned_2d", "sincos_2d"])
def test_set_image_size_equals_dynamic_forward(pos_embed, device):
    model = tiny(pos_embed=pos_embed).to(device)
    dynamic = tiny(pos_embed=pos_embed, dynamic_img_size=True).to(device)
    x = torch.randn(2, 3, 48, 40).to(device)
    with torch.no_grad():
        y_dynamic = dynamic.forward_features(x)
        model.set_image_size((48, 40))
        y_fixed = model.forward_features(x)
    assert model.grid == (6, 5) and model.config.img_size == (48, 40)
    torch.testing.assert_close(y_fixed, y_dynamic)
    if pos_embed == "learned":
        assert model.pos_embed.shape == (1, 1 + 30, 32)


def test_wrong_input_size_is_a_clear_error():
    with pytest.raises(ValueError, match="set_image_size"):
        tiny()(torch.randn(1, 3, 48, 48))


def test_sincos_2d_table():
    table = sincos_2d((3, 4), 8)
    assert table.shape == (12, 8)
    # token (row 0, col 0): sin(0) = 0 and cos(0) = 1 for both axes
    torch.testing.assert_close(table[0], torch.tensor([0.0, 0, 1, 1, 0, 0, 1, 1]))
    # token (row 1, col 2): x = 2, y = 1 with frequencies 1 and 1 / 10000
    x, y = 2.0, 1.0
    expected = [math.sin(x), math.sin(x / 1e4), math.cos(x), math.cos(x / 1e4)]
    expected += [math.sin(y), math.sin(y / 1e4), math.cos(y), math.cos(y / 1e4)]
    torch.testing.assert_close(table[1 * 4 + 2], torch.tensor(expected))


def test_tf_same_padding_is_asymmetric_for_strided_layers():
    assert same_padding(224, 7, 2) == (2, 3)  # root conv
    assert same_padding(112, 3, 2) == (0, 1)  # root max-pool and strided 3x3 convs
    assert same_padding(56, 3, 1) == (1, 1)
    assert same_padding(7, 3, 2) == (1, 1)


def test_std_conv_standardises_per_output_channel():
    torch.manual_seed(0)
    conv = StdConv2d(4, 6, 3)
    w = conv.weight.detach().numpy()  # (O, I, H, W)
    flat = w.reshape(6, -1)
    expected = (flat - flat.mean(1, keepdims=True)) / (flat.std(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(conv.standardized_weight().detach().numpy().reshape(6, -1), expected, atol=1e-5)
    # stride 1, kernel 3: 'SAME' keeps the size
    assert conv(torch.randn(1, 4, 9, 9)).shape == (1, 6, 9, 9)


def test_group_norm_is_accurate_on_channels_last_inputs():
    # NHWC data permuted to NCHW (how official-layout inputs arrive) has channels-last strides; torch's fused
    # kernel loses ~1e-4 there on activations far from zero. Ours must stay at float32 precision.
    torch.manual_seed(0)
    x = (3 * torch.randn(2, 56, 56, 64) + 10 * torch.randn(64)).permute(0, 3, 1, 2)
    gn = group_norm(64).requires_grad_(False)
    exact = torch.nn.functional.group_norm(x.double(), 32, gn.weight.double(), gn.bias.double(), 1e-6)
    assert (gn(x).double() - exact).abs().max() < 2e-6
    assert (gn(x.contiguous()).double() - exact).abs().max() < 2e-6


def test_hybrid_tokens_two_stage_r50_at_224():
    torch.manual_seed(0)
    model = VisionTransformer(
        img_size=224, patch_size=1, resnet_layers=(3, 4), width=32, depth=1, num_heads=2, mlp_dim=64
    ).eval()
    with torch.no_grad():
        inter = model.forward_intermediates(torch.randn(1, 3, 224, 224))
    assert inter["stem"].shape == (1, 512, 28, 28)  # /8 with 2 stages, 4 x 128 channels
    assert inter["encoded"].shape == (1, 785, 32)  # 28 * 28 patches + class token


def test_hybrid_root_only_and_odd_sizes():
    model = tiny(resnet_layers=(), patch_size=2, img_size=30)
    assert model.grid == (4, 4)  # 30 -> 15 (conv, SAME) -> 8 (max-pool, SAME) -> 4 (2x2 patches)
    assert model(torch.randn(1, 3, 30, 30)).shape == (1, 5)


def test_bit_resnet_classifier():
    torch.manual_seed(0)
    model = ResNet(layers=(1, 1), num_classes=3).eval()
    x = torch.randn(2, 3, 64, 64)
    feats = model.forward_features(x)
    assert feats.shape == (2, 512, 8, 8)
    assert model.forward_head(feats, pre_logits=True).shape == (2, 512)
    assert torch.count_nonzero(model(x)) == 0
    model.reset_classifier(4)
    assert model(x).shape == (2, 4)


def test_create_model_overrides_and_errors():
    model = create_model("vit_ti16", num_classes=3, depth=1, img_size=64)
    assert model.config.depth == 1 and model.grid == (4, 4)
    with pytest.raises(UserError, match="unknown model 'vit_q16'; did you mean vit_s16"):
        create_model("vit_q16")
    with pytest.raises(TypeError, match="no field"):
        create_model("vit_ti16", widht=10)
    with pytest.raises(ValueError, match="classifier"):
        create_model("vit_ti16", classifier="mapx")
    assert "vit_b16" in vitkit.list_models("b16")


def test_renamed_rows_name_their_new_names():
    """r_vit_ti32 is the official R+Ti/16 (root /4, 8x8 patches: tokens are 1/32); the old name says so."""
    assert create_model("r_vit_ti32", num_classes=2, img_size=64).grid == (2, 2)
    with pytest.raises(UserError, match=r"'r_vit_ti16': it is now 'r_vit_ti32' \(R\+Ti/16 .* 1/32"):
        create_model("r_vit_ti16")


@pytest.mark.parametrize("pos_embed", ["learned", "sincos_2d", "relative", "none"])
@pytest.mark.parametrize("classifier", ["token", "gap", "map"])
def test_under_autocast_the_residual_stream_is_in_the_parameters_dtype(pos_embed, classifier):
    """The patch embedding gives bf16 under autocast; the tokens are cast to the parameters' dtype, so that every
    position embedding and head trains with the same precision (with relative positions or none and a GAP or MAP
    head, nothing of fp32 was added, and every block and LayerNorm ran in bf16)."""
    model = tiny(pos_embed=pos_embed, classifier=classifier).train()
    seen: list[torch.dtype] = []
    for block in model.blocks:
        block.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    model.norm.register_forward_hook(lambda m, args, out: seen.append(args[0].dtype))
    with torch.autocast("cpu", torch.bfloat16):
        model(torch.randn(2, 3, 32, 32)).float().sum().backward()
    assert seen == [torch.float32] * (len(model.blocks) + 1)


def test_under_autocast_a_relative_position_models_gradients_are_float64s_to_bf16_rounding():
    """The final LayerNorm's bias gradient sums a batch's gradients that nearly cancel: computed in bf16, as the
    residual stream was with relative positions and a GAP head, it came out 39-84% off float64's."""
    torch.manual_seed(0)
    cfg = dict(TINY, img_size=32, patch_size=4, width=128, num_heads=2, mlp_dim=512, num_classes=5)
    model = VisionTransformer(**cfg, pos_embed="relative", classifier="gap").train()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    wide = copy.deepcopy(model).double()
    x, y = torch.randn(32, 3, 32, 32), torch.arange(32) % 5
    with torch.autocast("cpu", torch.bfloat16):
        torch.nn.functional.cross_entropy(model(x).float(), y).backward()
    torch.nn.functional.cross_entropy(wide(x.double()), y).backward()
    for (name, p), p64 in zip(model.named_parameters(), wide.parameters(), strict=True):
        assert (p.grad.double() - p64.grad).norm() <= 0.05 * p64.grad.norm(), name


def test_a_hybrids_patch_projection_with_a_hook_runs_by_its_call():
    """On a hybrid's feature map the patch projection is computed as the matmul it is (more accurate than the CPU
    conv kernel), which would not run the conv's hooks; with a hook of its own the conv is called, to rounding the
    same output."""
    model = tiny(resnet_layers=(), patch_size=2, classifier="gap")
    randomize_head(model)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = model(x)
    seen: list[tuple[int, ...]] = []
    model.patch_embed.proj.register_forward_hook(lambda m, args, out: seen.append(tuple(out.shape)))
    with torch.no_grad():
        got = model(x)
    assert seen == [(2, TINY["width"], 4, 4)]
    torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=1e-5)


EMPTY_BATCH_MODELS = {
    "vit-sdpa": dict(attn_impl="sdpa"),
    "vit-explicit": dict(attn_impl="explicit"),
    "vit-onednn-wide": dict(width=128),  # the Dense layers' oneDNN sizes
    "hybrid": dict(resnet_layers=(1,), patch_size=1),  # the ResNet stem's GroupNorm
}


@pytest.mark.parametrize("overrides", EMPTY_BATCH_MODELS.values(), ids=EMPTY_BATCH_MODELS.keys())
def test_an_empty_batch_gives_empty_logits(overrides: dict) -> None:
    """A batch of no images (the last shard of an empty split, a filter that kept nothing): (0, classes) logits in
    eval and training mode, fp32 and bf16, where the attention output's and GroupNorm's reshapes once could not
    infer a size from no elements."""
    model = tiny(**overrides)
    for dtype in (torch.float32, torch.bfloat16):
        model = model.to(dtype)
        for train in (False, True):
            model.train(train)
            with torch.set_grad_enabled(train):
                logits = model(torch.zeros(0, 3, 32, 32, dtype=dtype))
            assert logits.shape == (0, 5) and logits.dtype == dtype
