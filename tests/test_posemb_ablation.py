"""The position-embedding ablation of the paper (Table 8, appendix D.4): relative position attention with 1-D
(raster order) and 2-D (row, column) offsets, and absolute tables added at the input, before every block, or
shared by every block."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import vitkit
from vitkit.checkpoint import save_pretrained
from vitkit.errors import ConfigError, UserError
from vitkit.models import VisionTransformer, ViTConfig, posemb
from vitkit.models.flops import vit_flops
from vitkit.models.posemb import relative_index, relative_table_shape, resample_relative

TINY = dict(img_size=32, patch_size=8, width=32, depth=2, num_heads=4, mlp_dim=64, num_classes=5)  # 4x4 grid
RELATIVE = [
    pytest.param(dict(pos_embed=pe, classifier=cl), id=f"{pe}-{cl}")
    for pe in ("relative", "relative_2d")
    for cl in ("token", "gap")
]
WHERE = [
    pytest.param(dict(pos_embed=pe, pos_embed_where=where), id=f"{pe}-{where}")
    for pe, where in (
        ("learned", "every_layer"),
        ("learned", "every_layer_shared"),
        ("learned_2d", "every_layer"),
        ("learned_2d", "every_layer_shared"),
        ("sincos_2d", "every_layer_shared"),
    )
]


def tiny(**overrides) -> VisionTransformer:
    """A tiny model whose head and relative tables are large enough that a wrong term would show."""
    torch.manual_seed(0)
    model = VisionTransformer(**{**TINY, **overrides}).eval()
    with torch.no_grad():
        if model.config.num_classes:
            model.head.weight.normal_(std=0.5)
        for blk in model.blocks:
            if blk.attn.rel_pos_embed is not None:
                blk.attn.rel_pos_embed.normal_(std=0.5)
    return model


def images(b: int = 2, size: tuple[int, int] = (32, 32)) -> torch.Tensor:
    return torch.randn(b, 3, *size, generator=torch.Generator().manual_seed(1))


# ------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(pos_embed_where="everywhere"), "pos_embed_where='everywhere': expected one of"),
        (dict(pos_embed="relative", pos_embed_where="every_layer"), "pos_embed_where='every_layer'.*use 'input'"),
        (dict(pos_embed="none", pos_embed_where="every_layer_shared"), "pos_embed='none' adds no table"),
        (dict(pos_embed="sincos_2d", pos_embed_where="every_layer"), "use 'every_layer_shared'"),
        (dict(pos_embed="relative_3d"), "pos_embed='relative_3d': expected one of"),
    ],
)
def test_config_rejects_combinations_that_mean_nothing(overrides, message):
    with pytest.raises(ConfigError, match=message):
        ViTConfig(**{**TINY, **overrides})


def test_config_relative_dims():
    assert [ViTConfig(pos_embed=p).relative_dims for p in ("relative", "relative_2d", "learned")] == [1, 2, 0]


# ------------------------------------------------------------------------------------ both attention paths
@pytest.mark.parametrize("overrides", RELATIVE + WHERE)
def test_fused_and_explicit_paths_agree_and_class_token_last_block_matches(overrides, device):
    model = tiny(**overrides).to(device)
    x = images().to(device)
    with torch.no_grad():
        fused = model.forward_features(x)
        explicit = model.forward_features(x, attn_impl="explicit")
        logits = model(x)  # a class-token model's last block computes the class token alone
        full = model.forward_head(fused)
        logits_explicit = model(x, attn_impl="explicit")
        inter = model.forward_intermediates(x, return_attention=True)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits_explicit, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(inter["encoded"], fused, atol=1e-5, rtol=1e-5)
    T = model.num_prefix_tokens + 16
    for probs in inter["attention"]:
        assert probs.shape == (2, 4, T, T)
        torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4, T, device=device))
    # the position term is really there: without it the outputs differ
    plain = tiny(**{**overrides, "pos_embed": "none", "pos_embed_where": "input"}).to(device)
    plain.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        assert (plain.forward_features(x) - fused).abs().max() > 1e-2


@pytest.mark.parametrize("pos_embed", ["relative", "relative_2d"])
@pytest.mark.parametrize("queries", [1, 2, 5])
def test_the_relative_logits_of_the_first_queries_are_the_first_rows(pos_embed, queries):
    # 1: the class token alone (no relative term); 2 and 5: the class token and some patches (a block computing its
    # first tokens only, as vitkit.accel.first_token's does, reads these rows)
    model = tiny(pos_embed=pos_embed)
    tokens = model.forward_intermediates(images())["tokens"]
    attn, (B, N, D) = model.blocks[0].attn, tokens.shape
    rel = posemb.relative_positions(model.grid, model.grid, model.config.relative_dims, 1, tokens.device)
    with torch.no_grad():
        q = attn.qkv(tokens)[..., :D].reshape(B, N, attn.num_heads, attn.head_dim).transpose(1, 2)
        full, part = attn.logit_bias(q, rel), attn.logit_bias(q[:, :, :queries], rel)
    assert full is not None and full.shape == (B, attn.num_heads, N, N)
    assert full[:, :, 0].abs().max() == 0 and full[:, :, :, 0].abs().max() == 0  # the class token: no relative term
    if queries == 1:
        assert part is None
    else:
        torch.testing.assert_close(part, full[:, :, :queries], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("overrides", [{}, {"representation_size": 24}, {"depth": 1}])
@pytest.mark.parametrize("pos_embed", ["relative", "relative_2d"])
def test_class_token_forward_has_the_same_gradients(pos_embed, overrides):
    model = tiny(pos_embed=pos_embed, **overrides).train()  # no dropout: both paths are deterministic
    x = images(3)
    params = list(model.parameters())
    grads = []
    for out in (model(x), model.forward_head(model.forward_features(x))):
        g = torch.autograd.grad(out.square().sum(), params, allow_unused=True)
        grads.append([torch.zeros_like(p) if gi is None else gi for p, gi in zip(params, g)])
    for (name, _), g_fast, g_full in zip(model.named_parameters(), *grads):
        scale = float(g_full.abs().max()) or 1.0
        torch.testing.assert_close(g_fast, g_full, atol=1e-5 * scale, rtol=1e-5, msg=name)


# ------------------------------------------------------------------------- an independent float64 reference
def reference_block(blk: torch.nn.Module, x: torch.Tensor, grid: tuple[int, int], dims: int, prefix: int):
    """One encoder block with relative position attention, in float64, written from appendix D.4 pair by pair:
    the logit of query i and key j is q_i . k_j plus q_i . r(offset of j from i), both over sqrt(head_dim); the
    offset is j - i in raster order (dims=1) or (row_j - row_i, col_j - col_i) (dims=2); a pair involving the
    class token has no relative term."""
    d = lambda t: t.detach().double()  # noqa: E731
    x = d(x)
    B, T, D = x.shape
    nh = blk.attn.num_heads
    hd = D // nh
    gh, gw = grid
    table = d(blk.attn.rel_pos_embed)

    def rel_embedding(i: int, j: int) -> torch.Tensor:
        pi, pj = i - prefix, j - prefix  # patch numbers in raster order
        if dims == 1:
            return table[(pj - pi) + (gh * gw - 1)]
        (ri, ci), (rj, cj) = divmod(pi, gw), divmod(pj, gw)
        return table[(rj - ri) + (gh - 1), (cj - ci) + (gw - 1)]

    def layer_norm(t, ln):
        mu = t.mean(-1, keepdim=True)
        var = ((t - mu) ** 2).mean(-1, keepdim=True)
        return (t - mu) / torch.sqrt(var + ln.eps) * d(ln.weight) + d(ln.bias)

    h = layer_norm(x, blk.norm1)
    w, b = d(blk.attn.qkv.weight), d(blk.attn.qkv.bias)
    q, k, v = (h @ w[s * D : (s + 1) * D].T + b[s * D : (s + 1) * D] for s in range(3))
    attn_out = torch.zeros(B, T, D, dtype=torch.float64)
    for bi in range(B):
        for head in range(nh):
            sl = slice(head * hd, (head + 1) * hd)
            for i in range(T):
                logits = torch.zeros(T, dtype=torch.float64)
                for j in range(T):
                    logit = q[bi, i, sl] @ k[bi, j, sl]
                    if i >= prefix and j >= prefix:
                        logit = logit + q[bi, i, sl] @ rel_embedding(i, j)[sl]
                    logits[j] = logit / math.sqrt(hd)
                p = torch.softmax(logits, 0)
                attn_out[bi, i, sl] = sum(p[j] * v[bi, j, sl] for j in range(T))
    x = x + attn_out @ d(blk.attn.proj.weight).T + d(blk.attn.proj.bias)
    h = layer_norm(x, blk.norm2)
    h = torch.nn.functional.gelu(h @ d(blk.mlp.fc1.weight).T + d(blk.mlp.fc1.bias), approximate="tanh")
    return x + h @ d(blk.mlp.fc2.weight).T + d(blk.mlp.fc2.bias)


@pytest.mark.parametrize("overrides", RELATIVE + [pytest.param(dict(pos_embed="relative_2d", img_size=(24, 40)))])
def test_one_block_matches_a_float64_pair_by_pair_reference(overrides):
    model = tiny(**overrides)
    dims, prefix = model.config.relative_dims, model.num_prefix_tokens
    x = images(2, model.config.img_size)
    for attn_impl in ("sdpa", "explicit"):
        with torch.no_grad():
            inter = model.forward_intermediates(x, attn_impl=attn_impl)
        want = reference_block(model.blocks[0], inter["tokens"], model.grid, dims, prefix)
        torch.testing.assert_close(inter["blocks"][0].double(), want, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------- the bias is by offset only
@pytest.mark.parametrize("pos_embed", ["relative", "relative_2d"])
def test_relative_logits_depend_on_the_offset_alone(pos_embed):
    # on a uniform image a GAP model without absolute positions gives every patch the same query and key, so the
    # first block's logits are a constant plus the relative bias: log p[i, j] - log p[i, i] is bias[i, j] -
    # bias[i, i], which must be the same for every pair (i, j) with the same offset (shifting both patches of a
    # pair together, on the grid, where both stay on it)
    model = tiny(pos_embed=pos_embed, classifier="gap").double()  # float64: the property holds to rounding
    x = torch.full((1, 3, 32, 32), 0.3, dtype=torch.float64)
    with torch.no_grad():
        probs = model.forward_intermediates(x, return_attention=True)["attention"][0][0]  # (nh, N, N)
    rel = probs.log() - probs.log().diagonal(dim1=-2, dim2=-1)[..., None]  # bias[i, j] - bias[i, i]
    gh, gw = model.grid
    if pos_embed == "relative":  # raster order: pairs (i, j) and (i + s, j + s)
        N = gh * gw
        for s in range(1, N):
            torch.testing.assert_close(rel[:, s:, s:], rel[:, : N - s, : N - s], atol=1e-12, rtol=0)
    else:  # (row, column) shifts (a, c): pairs stay on the grid
        r = rel.reshape(-1, gh, gw, gh, gw)
        for a in range(gh):
            for c in range(gw):
                torch.testing.assert_close(
                    r[:, a:, c:, a:, c:], r[:, : gh - a, : gw - c, : gh - a, : gw - c], atol=1e-12, rtol=0
                )
    assert rel.abs().max() > 0.1  # the offsets differ in their learned embeddings


def test_relative_index_by_hand():
    # 2x3 grid: 1-D offsets j - i in raster order, row (j - i) + 5 of an 11-row table
    idx1 = relative_index((2, 3), 1)
    assert idx1.shape == (6, 6) and idx1[0, 5] == 10 and idx1[5, 0] == 0 and idx1.diagonal().eq(5).all()
    # 2-D: patch 0 is (0, 0), patch 5 is (1, 2): offset (1, 2) -> row (1 + 1) * 5 + (2 + 2) = 14 of a 3x5 table
    idx2 = relative_index((2, 3), 2)
    assert relative_table_shape((2, 3), 2) == (3, 5) and idx2[0, 5] == 14 and idx2[5, 0] == 0
    assert idx2.diagonal().eq(1 * 5 + 2).all()  # offset (0, 0) is the middle of the table


# ------------------------------------------------------------------------------------------ parameter counts
def tiny_params_without_positions(cfg: ViTConfig) -> int:
    D, M, K, L = cfg.width, cfg.mlp_dim, cfg.num_classes, cfg.depth
    P = cfg.patch_size[0] * cfg.patch_size[1]
    patch = cfg.in_chans * P * D + D
    cls = D if cfg.classifier == "token" else 0
    block = 2 * 2 * D + (3 * D * D + 3 * D) + (D * D + D) + (D * M + M) + (M * D + D)
    return patch + cls + L * block + 2 * D + (D * K + K)


@pytest.mark.parametrize(
    "overrides, extra",
    [
        (dict(pos_embed="none"), lambda L, T, gh, gw, D: 0),
        (dict(pos_embed="learned"), lambda L, T, gh, gw, D: T * D),
        (dict(pos_embed="learned", pos_embed_where="every_layer"), lambda L, T, gh, gw, D: L * T * D),
        (dict(pos_embed="learned", pos_embed_where="every_layer_shared"), lambda L, T, gh, gw, D: T * D),
        (dict(pos_embed="learned_2d", pos_embed_where="every_layer"), lambda L, T, gh, gw, D: L * (gh + gw) * D // 2),
        (
            dict(pos_embed="learned_2d", pos_embed_where="every_layer_shared"),
            lambda L, T, gh, gw, D: (gh + gw) * D // 2,
        ),
        (dict(pos_embed="sincos_2d", pos_embed_where="every_layer_shared"), lambda L, T, gh, gw, D: 0),
        (dict(pos_embed="relative"), lambda L, T, gh, gw, D: L * (2 * gh * gw - 1) * D),
        (dict(pos_embed="relative_2d"), lambda L, T, gh, gw, D: L * (2 * gh - 1) * (2 * gw - 1) * D),
        (dict(pos_embed="relative", classifier="gap"), lambda L, T, gh, gw, D: L * (2 * gh * gw - 1) * D),
    ],
)
def test_parameter_counts_by_hand(overrides, extra):
    for shape in (dict(img_size=32, depth=2), dict(img_size=(24, 40), depth=3)):  # 4x4 and 3x5 grids
        model = VisionTransformer(**{**TINY, **overrides, **shape})
        cfg = model.config
        gh, gw = model.grid
        T = model.num_prefix_tokens + gh * gw
        assert model.num_params() == tiny_params_without_positions(cfg) + extra(cfg.depth, T, gh, gw, cfg.width)


# ------------------------------------------------------------------------------ names, init, weight decay
def test_parameter_names_shapes_init_and_weight_decay():
    model = VisionTransformer(**{**TINY, "pos_embed": "relative_2d", "classifier": "gap", "width": 256, "depth": 3})
    rel = {n: p for n, p in model.named_parameters() if "rel_pos_embed" in n}
    assert sorted(rel) == [f"blocks.{i}.attn.rel_pos_embed" for i in range(3)]
    assert all(p.shape == (7, 7, 256) for p in rel.values())
    assert model.no_weight_decay() == set(rel)
    for p in rel.values():  # N(0, 0.02), as the official position embedding
        assert abs(p.std().item() / 0.02 - 1) < 0.05 and p.abs().max() > 3 * 0.02

    model = VisionTransformer(**{**TINY, "pos_embed": "learned", "pos_embed_where": "every_layer", "width": 256})
    assert model.pos_embed.shape == (2, 17, 256) and model.no_weight_decay() == {"cls_token", "pos_embed"}
    assert abs(model.pos_embed.std().item() / 0.02 - 1) < 0.05
    model = VisionTransformer(**{**TINY, "pos_embed": "learned_2d", "pos_embed_where": "every_layer"})
    assert model.pos_embed_x.shape == model.pos_embed_y.shape == (2, 4, 16)
    assert model.no_weight_decay() == {"cls_token", "pos_embed_x", "pos_embed_y"}
    assert VisionTransformer(**{**TINY, "pos_embed_where": "every_layer_shared"}).pos_embed.shape == (1, 17, 32)


def test_init_weights_reinitialises_the_new_tables():
    for overrides in (dict(pos_embed="relative"), dict(pos_embed="learned", pos_embed_where="every_layer")):
        model = VisionTransformer(**{**TINY, **overrides, "width": 256})
        tables = [p for n, p in model.named_parameters() if "pos_embed" in n]
        with torch.no_grad():
            for p in tables:
                p.zero_()
        model.init_weights()
        assert all(abs(p.std().item() / 0.02 - 1) < 0.1 for p in tables)


# ------------------------------------------------------------------------------ where the table is added
def test_every_layer_adds_table_l_before_block_l():
    for overrides in (
        dict(pos_embed="learned", pos_embed_where="every_layer", depth=3),
        dict(pos_embed="learned_2d", pos_embed_where="every_layer_shared", depth=3),
        dict(pos_embed="sincos_2d", pos_embed_where="every_layer_shared", depth=3, classifier="gap"),
    ):
        model = tiny(**overrides)
        x = images()
        with torch.no_grad():
            tables = model._pos_embed_for(model.grid)  # (tables, T, D)
            z = model.forward_intermediates(x)["tokens"]  # patches + class token + table 0
            for i, blk in enumerate(model.blocks):
                if i:
                    z = z + tables[i if len(tables) > 1 else 0]
                z = blk(z)
            torch.testing.assert_close(model.forward_features(x), model.norm(z), atol=1e-6, rtol=1e-6)
            once = tiny(**{**overrides, "pos_embed_where": "input"})
            once.load_state_dict({k: v[:1] if "pos_embed" in k else v for k, v in model.state_dict().items()})
            assert (once.forward_features(x) - model.forward_features(x)).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------------ gradients
@pytest.mark.parametrize("overrides", RELATIVE + WHERE)
def test_every_parameter_gets_a_gradient(overrides):
    model = tiny(**overrides).train()
    # every token's output reaches this loss, so the last block's relative table does too (through the logits of
    # a class-token model it does not: the class token's query has no relative term)
    feats = model.forward_features(images())
    (model.forward_head(feats).square().mean() + feats.square().mean()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert p.grad.abs().sum() > 0, f"{name} got a zero gradient"
    if model.config.pos_embed_where == "every_layer":
        for name in ("pos_embed", "pos_embed_x", "pos_embed_y"):
            p = getattr(model, name)
            if p is not None:
                assert (p.grad.flatten(1).abs().sum(1) > 0).all(), f"a layer's {name} got no gradient"


@pytest.mark.parametrize("pos_embed", ["relative", "relative_2d"])
@pytest.mark.parametrize("classifier", ["token", "gap", "map", "first"])
def test_every_parameter_gets_a_gradient_from_the_logits(pos_embed, classifier):
    model = tiny(pos_embed=pos_embed, classifier=classifier, depth=3).train()
    F.cross_entropy(model(images(4)), torch.tensor([0, 1, 2, 3])).backward()
    missing = {n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0}
    # the one exception: the last block of a class-token model computes the class token alone (forward's
    # out_tokens), and the class token has no relative term
    assert missing == ({"blocks.2.attn.rel_pos_embed"} if classifier == "token" else set())


def test_the_last_relative_table_of_a_class_token_model_learns_from_masked_patch_prediction():
    from vitkit.train.mpp import MPPConfig, MPPModel

    model = tiny(pos_embed="relative", depth=2).train()
    mpp = MPPModel(model, MPPConfig())
    with torch.no_grad():
        mpp.mpp.head.weight.normal_()  # zero-initialised, it would pass no gradient back
    predictions, _ = mpp(images(4), torch.Generator().manual_seed(0))
    predictions.square().mean().backward()
    last = model.blocks[-1].attn.rel_pos_embed
    assert last.grad is not None and last.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("overrides", RELATIVE + WHERE)
def test_checkpoint_round_trip(tmp_path, overrides):
    model = tiny(**overrides)
    save_pretrained(model, tmp_path / "ckpt")
    loaded = vitkit.load_model(tmp_path / "ckpt").eval()
    assert loaded.config == model.config
    assert model.state_dict().keys() == loaded.state_dict().keys()
    x = images()
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))
        assert torch.equal(model.forward_features(x), loaded.forward_features(x))


# ------------------------------------------------------------------------------------- resolution changes
@pytest.mark.parametrize("overrides", RELATIVE + WHERE)
def test_set_image_size_equals_dynamic_forward_and_resizes_tables(overrides):
    model = tiny(**overrides)
    dynamic = tiny(**overrides, dynamic_img_size=True)
    x = images(2, (48, 40))  # a 6x5 grid
    with torch.no_grad():
        y_dynamic = dynamic.forward_features(x)
        y_dynamic_explicit = dynamic.forward_features(x, attn_impl="explicit")
        logits_dynamic = dynamic(x)
        model.set_image_size((48, 40))
        y = model.forward_features(x)
    assert model.grid == (6, 5) and torch.isfinite(y).all()
    torch.testing.assert_close(y, y_dynamic, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y_dynamic_explicit, y_dynamic, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model(x), logits_dynamic, atol=1e-5, rtol=1e-5)
    dims = model.config.relative_dims
    for blk in model.blocks:
        if dims:
            assert blk.attn.rel_pos_embed.shape == (*relative_table_shape((6, 5), dims), 32)
    if model.pos_embed is not None:
        layers = 2 if model.config.pos_embed_where == "every_layer" else 1
        assert model.pos_embed.shape == (layers, model.num_prefix_tokens + 30, 32)
    assert model.num_params() == VisionTransformer(**{**TINY, **overrides, "img_size": (48, 40)}).num_params()


def test_resample_relative_by_hand():
    table = torch.tensor([0.0, 2.0, 8.0])[:, None]  # offsets -1, 0, 1 (a 1x2 grid)
    out = resample_relative(table, (5,), (1, 2), (1, 3))  # offsets -2..2: the ends stay the ends, 0 stays 0
    torch.testing.assert_close(out[:, 0], torch.tensor([0.0, 1.0, 2.0, 5.0, 8.0]))
    assert resample_relative(table, (1,), (1, 2), (1, 1))[0, 0] == 2.0  # one patch: only offset 0 is left
    assert resample_relative(table, (3,), (1, 2), (1, 2)) is table
    with pytest.raises(UserError, match="not a square grid's"):
        resample_relative(table, (5,))  # 2 patches: which grid's raster offsets they are cannot be told
    grid = torch.arange(9.0).reshape(3, 3, 1)  # 2-D: bilinear, one axis at a time
    out2 = resample_relative(grid, (5, 3))
    torch.testing.assert_close(
        out2[..., 0], torch.tensor([[0, 1, 2], [1.5, 2.5, 3.5], [3, 4, 5], [4.5, 5.5, 6.5], [6, 7, 8.0]])
    )
    torch.testing.assert_close(out2[2], grid[1])  # the middle row (row offset 0) is kept


def raster_reference(table: torch.Tensor, old: tuple[int, int], new: tuple[int, int]) -> torch.Tensor:
    """A 1-D relative table resampled in float64, pair by pair: each patch pair (i, j) of the new grid reads the
    old table at its (row, column) offset scaled to the old grid (bilinear between the four integer offsets
    around it, each read from the old table at raster offset dy * gw + dx), and each raster offset of the new grid
    takes the mean over all the pairs that have it."""
    (gh, gw), (nh, nw) = old, new
    t = table.double()
    sy = (gh - 1) / (nh - 1) if nh > 1 else 0.0
    sx = (gw - 1) / (nw - 1) if nw > 1 else 0.0

    def at(y: float, x: float) -> torch.Tensor:
        y0, x0 = math.floor(y), math.floor(x)
        y1, x1 = min(y0 + 1, gh - 1), min(x0 + 1, gw - 1)
        fy, fx = y - y0, x - x0
        out = torch.zeros(t.shape[1], dtype=torch.float64)
        for yy, wy in ((y0, 1 - fy), (y1, fy)):
            for xx, wx in ((x0, 1 - fx), (x1, fx)):
                out += wy * wx * t[yy * gw + xx + gh * gw - 1]
        return out

    N = nh * nw
    sums = torch.zeros(2 * N - 1, t.shape[1], dtype=torch.float64)
    counts = torch.zeros(2 * N - 1, dtype=torch.float64)
    for i in range(N):
        for j in range(N):
            dy, dx = j // nw - i // nw, j % nw - i % nw
            sums[j - i + N - 1] += at(dy * sy, dx * sx)
            counts[j - i + N - 1] += 1
    return sums / counts[:, None]


@pytest.mark.parametrize(
    "old, new", [((4, 4), (8, 8)), ((8, 8), (4, 4)), ((4, 4), (6, 5)), ((3, 5), (5, 2)), ((2, 3), (1, 4))]
)
def test_a_1d_relative_table_resamples_through_row_and_column_offsets(old, new):
    table = torch.randn(2 * old[0] * old[1] - 1, 3, generator=torch.Generator().manual_seed(0))
    out = resample_relative(table, relative_table_shape(new, 1), old, new)
    assert out.shape == (2 * new[0] * new[1] - 1, 3)
    torch.testing.assert_close(out.double(), raster_reference(table, old, new), atol=1e-5, rtol=1e-5)


def test_one_row_down_stays_one_row_down_when_a_1d_table_is_stretched():
    table = torch.eye(31)  # a 4x4 grid's raster offsets -15..15: offset o's embedding is the one-hot of row o + 15
    out = resample_relative(table, (127,))  # to an 8x8 grid (the square grids the lengths imply, as a loader has)

    def mix(**weights: float) -> torch.Tensor:  # old raster offsets -> their weights, e.g. o4=3/7 for offset +4
        v = torch.zeros(31)
        for name, w in weights.items():
            v[int(name[1:].replace("m", "-")) + 15] = w
        return v

    # 8x8 offset +8 is (dy, dx) = (1, 0) alone; scaled to 3/7 of a row down the 4x4 grid: between "same patch"
    # (0) and "one row down" (+4), not between the right-hand neighbours +1 and +2 that raster order has there
    torch.testing.assert_close(out[8 + 63], mix(o0=4 / 7, o4=3 / 7))
    # 8x8 offset +1 is (0, 1) for 56 patch pairs and (1, -7) for 7: each scaled by 3/7, weighted by its pairs
    # (0, 3/7) -> 4/7 of offset 0 + 3/7 of +1; (3/7, -3) -> 4/7 of (0, -3) = -3 + 3/7 of (1, -3) = +1
    torch.testing.assert_close(out[1 + 63], mix(o0=32 / 63, o1=27 / 63, om3=4 / 63))
    torch.testing.assert_close(out[63], mix(o0=1.0))  # offset 0 stays offset 0


def test_the_loader_resamples_a_1d_table_of_a_non_square_grid(tmp_path):
    model = VisionTransformer(
        img_size=(16, 24), patch_size=4, width=32, depth=1, num_heads=2, mlp_dim=64, pos_embed="relative"
    )  # a 4x6 grid
    save_pretrained(model, tmp_path / "rel")
    tall = vitkit.load_model(tmp_path / "rel", img_size=(24, 16))  # 6x4: as many offsets (47), other geometry
    table = model.blocks[0].attn.rel_pos_embed.detach()
    want = raster_reference(table, (4, 6), (6, 4)).float()
    torch.testing.assert_close(tall.blocks[0].attn.rel_pos_embed.detach(), want, atol=1e-6, rtol=1e-6)
    assert (want - table).abs().max() > 1e-3  # the same shape, yet not the same table
    model.set_image_size((24, 16))
    torch.testing.assert_close(model.blocks[0].attn.rel_pos_embed, tall.blocks[0].attn.rel_pos_embed)


def test_the_loader_resamples_every_layer_tables_as_the_input_table(tmp_path):
    model = tiny(pos_embed="learned", pos_embed_where="every_layer")
    save_pretrained(model, tmp_path / "ckpt")
    big = vitkit.load_model(tmp_path / "ckpt", img_size=48)  # the per-block tables are resampled as the input's
    model.set_image_size(48)
    torch.testing.assert_close(big.pos_embed, model.pos_embed, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------- FLOPs
@pytest.mark.parametrize("overrides", RELATIVE + [pytest.param(dict(pos_embed="relative_2d", img_size=(24, 40)))])
def test_flops_count_the_relative_logits(overrides):
    with torch.device("meta"):
        model = VisionTransformer(**{**TINY, **overrides})
    size = model.config.img_size
    for logits_path, attn_impl in ((False, "explicit"), (True, "sdpa")):
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            x = torch.empty(1, 3, *size, device="meta")
            if logits_path:
                model(x, attn_impl=attn_impl)
            else:
                model.forward_head(model.forward_features(x, attn_impl=attn_impl))
        parts = vit_flops(model.config, size)  # forward() as built computes every token, as forward_features does
        assert parts["total"] == counter.get_total_flops()
        assert parts["relative"] > 0


def test_relative_checkpoints_load_at_another_size_and_never_export_to_fixed_layouts(tmp_path):
    from vitkit.checkpoint import save_pretrained
    from vitkit.checkpoint.hf import vitkit_to_hf
    from vitkit.checkpoint.official import vitkit_to_official
    from vitkit.checkpoint.timm import vitkit_to_timm

    torch.manual_seed(0)
    model = VisionTransformer(
        img_size=16, patch_size=4, width=32, depth=1, num_heads=2, mlp_dim=64, pos_embed="relative"
    )
    save_pretrained(model, tmp_path / "rel")
    big = vitkit.load_model(tmp_path / "rel", img_size=24)  # 4x4 -> 6x6 patches: 31 -> 71 offsets
    assert big.blocks[0].attn.rel_pos_embed.shape == (71, 32)
    same = VisionTransformer(model.config)
    same.load_state_dict(model.state_dict())
    same.set_image_size(24)
    torch.testing.assert_close(big.blocks[0].attn.rel_pos_embed, same.blocks[0].attn.rel_pos_embed)
    every = VisionTransformer(
        img_size=16, patch_size=4, width=32, depth=2, num_heads=2, mlp_dim=64, pos_embed_where="every_layer"
    )
    for export in (vitkit_to_official, vitkit_to_timm, vitkit_to_hf):
        for m in (model, every):
            with pytest.raises(ValueError, match="position embeddings"):
                export(m)
