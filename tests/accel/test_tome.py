"""Token merging (ToMe, vitkit.accel.tome): the matching against a loop over the paper's description, the exactness
that proportional attention gives when identical tokens merge, the conservation of size-weighted sums, the patch
applied to a built model (create_model(token_merge=r), apply_token_merging) and what it refuses."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import vitkit
from vitkit.accel import optimize_for_training
from vitkit.accel.tome import ToMeViT, apply_token_merging, merge_tokens
from vitkit.errors import ConfigError
from vitkit.models import VisionTransformer
from vitkit.models.flops import model_flops, vit_flops
from vitkit.models.vit import Block


def reference_merge(
    x: torch.Tensor, sizes: torch.Tensor, keys: torch.Tensor, r: int, protected: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One image (N, D), written from the paper (Bolya et al. 2023, sec. 3): tokens alternate between sets A and B;
    each A token draws an edge to its most similar B token (cosine of keys); the r most similar edges are merged,
    each B token becoming the size-weighted mean of itself and the A tokens merged into it; protected tokens take
    no part. Output: the unmerged A tokens in order, then every B token."""
    N = x.shape[0]
    a_ids, b_ids = list(range(0, N, 2)), list(range(1, N, 2))
    cos = lambda i, j: float(keys[i] @ keys[j] / (keys[i].norm() * keys[j].norm()))  # noqa: E731
    edges = []  # (similarity, a, best b)
    for i in a_ids:
        if i < protected:
            continue
        candidates = [j for j in b_ids if j >= protected]
        j = max(candidates, key=lambda j: cos(i, j))
        edges.append((cos(i, j), i, j))
    edges.sort(reverse=True)
    merged = {i: j for _, i, j in edges[:r]}
    out, out_sizes = [], []
    for i in a_ids:
        if i not in merged:
            out.append(x[i])
            out_sizes.append(sizes[i])
    for j in b_ids:
        members = [j] + [i for i, b in merged.items() if b == j]
        total = sum(sizes[m] for m in members)
        out.append(sum(x[m] * sizes[m] for m in members) / total)
        out_sizes.append(total)
    return torch.stack(out), torch.stack(out_sizes)


@pytest.mark.parametrize(("N", "r", "protected"), [(17, 3, 1), (17, 8, 1), (16, 5, 0), (10, 4, 1)])
def test_merge_tokens_matches_a_loop_over_the_papers_description(N: int, r: int, protected: int) -> None:
    g = torch.Generator().manual_seed(N + r)
    B, D, d = 3, 6, 5
    x = torch.randn(B, N, D, generator=g, dtype=torch.float64)
    keys = torch.randn(B, N, d, generator=g, dtype=torch.float64)
    sizes = torch.randint(1, 4, (B, N, 1), generator=g).double()
    got, got_sizes = merge_tokens(x, sizes, keys, r, protected)
    assert got_sizes is not None
    assert got.shape == (B, N - r, D)
    for b in range(B):
        want, want_sizes = reference_merge(x[b], sizes[b], keys[b], r, protected)
        torch.testing.assert_close(got[b], want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got_sizes[b], want_sizes, rtol=0, atol=0)


def test_merging_conserves_the_size_weighted_sum_and_the_patch_count() -> None:
    g = torch.Generator().manual_seed(0)
    x, keys = torch.randn(2, 33, 8, generator=g, dtype=torch.float64), torch.randn(2, 33, 4, generator=g)
    sizes = None
    total = x.sum(1)
    for r in (8, 6, 4):  # three merges in a row, sizes carried along
        x, sizes = merge_tokens(x, sizes, keys[:, : x.shape[1]].double(), r)
        assert sizes is not None
        torch.testing.assert_close((x * sizes).sum(1), total, rtol=1e-12, atol=1e-12)
        assert sizes.sum(1).flatten().tolist() == [33.0, 33.0]
    assert x.shape[1] == 33 - 18


def test_the_protected_token_stays_first_unmerged_even_when_another_token_is_identical_to_it() -> None:
    g = torch.Generator().manual_seed(1)
    x, keys = torch.randn(1, 9, 4, generator=g), torch.randn(1, 9, 4, generator=g)
    keys[0, 1] = keys[0, 0]  # token 1 (set B) is the class token's perfect match
    keys[0, 2] = keys[0, 0]  # and token 2 (set A) is one for token 1
    out, sizes = merge_tokens(x, None, keys, 4, protected=1)
    assert sizes is not None
    torch.testing.assert_close(out[0, 0], x[0, 0])
    assert sizes[0, 0].item() == 1.0
    assert out.shape[1] == 5
    out, _ = merge_tokens(x, None, keys, 100, protected=1)  # r is capped at half the other tokens
    assert out.shape[1] == 9 - 4


def duplicated_patch_images(n: int, size: int, patch: int, generator: torch.Generator) -> torch.Tensor:
    """Images whose patches come in identical pairs along each row: patches 2j and 2j + 1 of the raster order,
    which are tokens 2j + 1 (set B) and 2j + 2 (set A) behind the class token."""
    half = torch.randn(n, 3, size, size // 2, generator=generator, dtype=torch.float64)
    g = size // patch
    tiles = half.reshape(n, 3, size, g // 2, patch)
    return torch.stack([tiles, tiles], dim=4).reshape(n, 3, size, size)


@pytest.mark.parametrize("attn_impl", ["sdpa", "explicit"])
@pytest.mark.parametrize("r", [3, 8])
def test_merging_identical_tokens_changes_neither_logits_nor_gradients(attn_impl: str, r: int) -> None:
    """Two identical tokens merged into one of size 2 give, with proportional attention, exactly what the two
    gave: the same logits and the same gradients. No position embedding, so that equal patches are equal tokens."""
    cfg = dict(img_size=32, patch_size=8, width=16, depth=2, num_heads=2, mlp_dim=32, num_classes=5)
    plain = vitkit.create_model("vit_ti16", pos_embed="none", attn_impl=attn_impl, **cfg).double()
    merging = vitkit.create_model("vit_ti16", pos_embed="none", attn_impl=attn_impl, token_merge=r, **cfg).double()
    g = torch.Generator().manual_seed(r)
    with torch.no_grad():
        for p in plain.parameters():
            p.normal_(0, 0.3, generator=g)
    merging.load_state_dict(plain.state_dict())
    x = duplicated_patch_images(3, 32, 8, g)
    want, got = plain(x), merging(x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    want.square().sum().backward()
    got.square().sum().backward()
    for (name, p), q in zip(plain.named_parameters(), merging.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-9, atol=1e-10, msg=name)
    # and merging did happen: the second block saw 17 - r tokens
    seen: list[int] = []
    merging.blocks[1].attn.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[1]))
    merging(x)
    assert seen == [17 - r]


def test_merging_differs_from_the_plain_forward_on_ordinary_images() -> None:
    cfg = dict(img_size=32, patch_size=8, width=16, depth=3, num_heads=2, mlp_dim=32, num_classes=5)
    plain, merging = vitkit.create_model("vit_ti16", **cfg), vitkit.create_model("vit_ti16", token_merge=4, **cfg)
    torch.nn.init.normal_(plain.head.weight)
    merging.load_state_dict(plain.state_dict())
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert not torch.allclose(plain(x), merging(x), atol=1e-3)
        # features give every token, merged or not
        torch.testing.assert_close(merging.forward_features(x), plain.forward_features(x))


@pytest.mark.parametrize(
    "overrides",
    [
        {"classifier": "gap"},
        {"classifier": "map"},
        {"pos_embed": "relative"},
        {"pos_embed_where": "every_layer"},
        {"grad_checkpointing": True},
    ],
)
def test_token_merging_is_refused_where_merged_tokens_have_no_meaning(overrides: dict) -> None:
    with pytest.raises(ConfigError, match="token_merge=4"):
        vitkit.create_model("vit_ti16", token_merge=4, **overrides)
    with pytest.raises(ConfigError, match="token_merge=4"):
        apply_token_merging(VisionTransformer(**{**CFG, **overrides}), 4)
    with pytest.raises(ConfigError, match="token_merge=-1"):
        vitkit.create_model("vit_ti16", token_merge=-1)


CFG = dict(img_size=32, patch_size=8, width=16, depth=2, num_heads=2, mlp_dim=32, num_classes=5)


def test_the_patch_keeps_the_state_dict_and_is_switched_by_r() -> None:
    plain = VisionTransformer(**CFG)
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    model = apply_token_merging(plain, 3)
    assert model is plain and type(model) is ToMeViT and model.token_merge == 3
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    seen: list[int] = []
    model.blocks[1].attn.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[1]))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        merged = model(x)
        assert apply_token_merging(model, 0) is model and model.token_merge == 0  # off again: the plain forward
        torch.testing.assert_close(model(x), model.forward_head(model.forward_features(x)))
        apply_token_merging(model, 3)
        torch.testing.assert_close(model(x), merged)
    assert seen == [17 - 3, 17, 17, 17 - 3]  # merged, plain forward(), forward_features, merged again

    class Custom(VisionTransformer):
        pass

    with pytest.raises(ConfigError, match="patched already"):
        apply_token_merging(Custom(**CFG), 2)
    assert vitkit.create_model("vit_ti16", token_merge=0, **CFG).__class__ is VisionTransformer
    assert all(type(b) is Block for b in vitkit.create_model("vit_ti16", **CFG).blocks)


@pytest.mark.parametrize("r", [3, 40])
@pytest.mark.parametrize("classifier", ["token", "first"])
def test_flops_of_a_merging_model_are_counted_with_token_merge(r: int, classifier: str) -> None:
    """Each block's attention runs on the tokens it receives, its MLP and every later block on r fewer (r capped at
    half the unprotected tokens); the key similarities are counted too. forward_features merges nothing."""
    with torch.device("meta"):
        model = apply_token_merging(VisionTransformer(**{**CFG, "classifier": classifier}), r)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.empty(1, 3, 32, 32, device="meta"))
    assert counter.get_total_flops() == model_flops(model, 32, token_merge=r) < model_flops(model, 32)
    assert vit_flops(model.config, token_merge=r)["merge"] > 0 and vit_flops(model.config)["merge"] == 0


@pytest.mark.parametrize("pos_embed", ["learned", "none"])
def test_both_attention_paths_add_the_size_bias(pos_embed: str) -> None:
    """Proportional attention's bias reaches SDPA as it reaches the written-out path: merging models that differ in
    their attention path alone give the same logits and gradients (float64), on ordinary images."""
    models = {}
    for attn_impl in ("sdpa", "explicit"):
        model = vitkit.create_model("vit_ti16", pos_embed=pos_embed, attn_impl=attn_impl, token_merge=4, **CFG)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.double().parameters():
                p.normal_(0, 0.3, generator=g)
        models[attn_impl] = model
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    fused, written = models["sdpa"](x), models["explicit"](x)
    torch.testing.assert_close(fused, written, rtol=1e-10, atol=1e-10)
    fused.square().sum().backward()
    written.square().sum().backward()
    for (name, p), q in zip(models["sdpa"].named_parameters(), models["explicit"].parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-10, msg=name)
    with torch.no_grad():  # and the size bias is there: merging changes the logits
        apply_token_merging(models["sdpa"], 0)
        assert not torch.allclose(models["sdpa"](x), written)


def test_optimize_for_training_keeps_a_merging_model_merging() -> None:
    """The training swaps leave the merging patch as it is (and add no first-token patch, which it excludes)."""
    merging = vitkit.create_model("vit_ti16", token_merge=3, **CFG)
    torch.nn.init.normal_(merging.head.weight)
    model = optimize_for_training(copy.deepcopy(merging))
    assert type(model) is ToMeViT and model.token_merge == 3
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(model(x), merging(x), atol=1e-5, rtol=1e-5)
