"""big_vision checkpoints load as big_vision runs them.

Each checkpoint here is written in big_vision's own layout: the names and shapes its models/vit.py creates
(``_Model`` with posemb 'learn' / 'sincos2d', pool_type 'gap' / 'map' / 'tok' / '0', ``Encoder`` with or without
scan, ``MAPHead``), flattened with '/' as its utils.tree_flatten_with_names does. The expected outputs come from
``BigVisionReference``: big_vision's forward transcribed in float64 numpy from that same file, sharing nothing
with vitkit. The older layouts are those big_vision's ``load`` / ``fix_old_checkpoints`` / utils.load_params
accept, each built from the layout's description there.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from vitkit import UserError, VisionTransformer
from vitkit.checkpoint import read_checkpoint
from vitkit.checkpoint.official import vitkit_to_official
from vitkit.cli import main as cli_main
from vitkit.hub import load_model, load_pretrained
from vitkit.inspect import probe_attention, query_attention, record_attention, rollout_map
from vitkit.models.posemb import sincos_2d

D, HEADS, MLP, PATCH, DEPTH, CLASSES = 32, 4, 64, 8, 2, 5
HD = D // HEADS


# ------------------------------------------------------------------------------ big_vision's forward, in numpy
def posemb_sincos_2d(h: int, w: int, width: int, temperature: float = 10_000.0) -> np.ndarray:
    """big_vision models/vit.py posemb_sincos_2d ("follows the MoCo v3 logic"), line by line, in float64."""
    y, x = np.mgrid[:h, :w]
    assert width % 4 == 0
    omega = np.arange(width // 4) / (width // 4 - 1)
    omega = 1.0 / (temperature**omega)
    y = np.einsum("m,d->md", y.flatten(), omega)
    x = np.einsum("m,d->md", x.flatten(), omega)
    pe = np.concatenate([np.sin(x), np.cos(x), np.sin(y), np.cos(y)], axis=1)
    return pe[None, :, :]


def layer_norm(x: np.ndarray, p: dict, name: str) -> np.ndarray:
    """flax.linen.LayerNorm (epsilon 1e-6, scale and bias)."""
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-6) * p[f"{name}/scale"] + p[f"{name}/bias"]


def gelu(x: np.ndarray) -> np.ndarray:
    """flax.linen.gelu: approximate=True (tanh) by default."""
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def mlp_block(x: np.ndarray, p: dict, name: str) -> np.ndarray:
    """big_vision MlpBlock: Dense_0 (mlp_dim), gelu, Dense_1 (back to d)."""
    x = gelu(x @ p[f"{name}/Dense_0/kernel"] + p[f"{name}/Dense_0/bias"])
    return x @ p[f"{name}/Dense_1/kernel"] + p[f"{name}/Dense_1/bias"]


def mhdpa(q_in: np.ndarray, kv_in: np.ndarray, p: dict, name: str) -> tuple[np.ndarray, np.ndarray]:
    """flax.linen.MultiHeadDotProductAttention(q_in, kv_in): DenseGeneral q/k/v to (heads, hd), the query scaled by
    1/sqrt(hd), softmax over keys, DenseGeneral out over (heads, hd). Also returns the weights (n, h, q, k)."""

    def proj(x: np.ndarray, which: str) -> np.ndarray:
        return np.einsum("nld,dhk->nlhk", x, p[f"{name}/{which}/kernel"]) + p[f"{name}/{which}/bias"]

    q, k, v = proj(q_in, "query"), proj(kv_in, "key"), proj(kv_in, "value")
    q = q / np.sqrt(q.shape[-1])
    logits = np.einsum("nqhd,nkhd->nhqk", q, k)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w = w / w.sum(-1, keepdims=True)
    out = np.einsum("nhqk,nkhd->nqhd", w, v)
    return np.einsum("nqhd,hdo->nqo", out, p[f"{name}/out/kernel"]) + p[f"{name}/out/bias"], w


@dataclass
class BigVisionReference:
    """big_vision models/vit.py _Model.__call__ (eval: no dropout) in float64 numpy, on flat big_vision params."""

    posemb: str = "learn"
    pool_type: str = "gap"
    rep_size: int = 0
    scan: bool = False

    def __call__(self, params: dict[str, np.ndarray], image: np.ndarray) -> dict[str, np.ndarray]:
        p = {k: np.asarray(v, np.float64) for k, v in params.items()}
        out = {}
        # Patch extraction: nn.Conv(width, patch, strides=patch, padding="VALID", name="embedding") on NHWC
        kernel = p["embedding/kernel"]  # (ph, pw, c, d)
        ph, pw = kernel.shape[:2]
        n, H, W, C = image.shape
        h, w = H // ph, W // pw
        patches = image[:, : h * ph, : w * pw].reshape(n, h, ph, w, pw, C).transpose(0, 1, 3, 2, 4, 5)
        x = np.einsum("nhwijc,ijcd->nhwd", patches, kernel) + p["embedding/bias"]
        x = x.reshape(n, h * w, -1)
        # "Add posemb before adding extra token."
        pe = p["pos_embedding"] if self.posemb == "learn" else posemb_sincos_2d(h, w, x.shape[-1])
        x = x + pe
        if self.pool_type == "tok":
            x = np.concatenate([np.tile(p["cls"], [n, 1, 1]), x], axis=1)
        # Encoder: encoderblock_{i} (or one scanned encoderblock with a leading depth axis), then encoder_norm
        blocks = self._blocks(p)
        for b in blocks:
            y = layer_norm(x, b, "LayerNorm_0")
            y, _ = mhdpa(y, y, b, "MultiHeadDotProductAttention_0")
            x = x + y
            y = layer_norm(x, b, "LayerNorm_1")
            x = x + mlp_block(y, b, "MlpBlock_0")
        x = out["encoded"] = layer_norm(x, p, "Transformer/encoder_norm")
        if self.pool_type == "map":  # MAPHead(num_heads, mlp_dim)(encoded)
            probe = np.tile(p["MAPHead_0/probe"], [n, 1, 1])
            y, out["map_attention"] = mhdpa(probe, x, p, "MAPHead_0/MultiHeadDotProductAttention_0")
            y = y + mlp_block(layer_norm(y, p, "MAPHead_0/LayerNorm_0"), p, "MAPHead_0/MlpBlock_0")
            x = y[:, 0]
        elif self.pool_type == "gap":
            x = x.mean(axis=1)
        elif self.pool_type in ("0", "tok"):
            x = x[:, 0]
        out["head_input"] = x
        if self.rep_size:
            x = np.tanh(x @ p["pre_logits/kernel"] + p["pre_logits/bias"])
        out["pre_logits"] = x
        out["logits"] = x @ p["head/kernel"] + p["head/bias"]
        return out

    def _blocks(self, p: dict) -> list[dict]:
        if self.scan:
            stacked = {k[len("Transformer/encoderblock/") :]: v for k, v in p.items() if "encoderblock/" in k}
            depth = len(stacked["LayerNorm_0/scale"])
            return [{k: v[i] for k, v in stacked.items()} for i in range(depth)]
        depth = 1 + max(int(m.group(1)) for k in p if (m := re.match(r"Transformer/encoderblock_(\d+)/", k)))
        pre = "Transformer/encoderblock_{}/"
        return [{k[len(pre.format(i)) :]: v for k, v in p.items() if k.startswith(pre.format(i))} for i in range(depth)]


# ----------------------------------------------------------------------- checkpoints in big_vision's layout
def big_vision_params(
    posemb: str = "learn",
    pool_type: str = "gap",
    rep_size: int = 0,
    scan: bool = False,
    grid: tuple[int, int] = (4, 4),
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Random float32 params with the names and shapes big_vision's _Model(num_classes=CLASSES, width=D,
    depth=DEPTH, mlp_dim=MLP, num_heads=HEADS, patch_size=(PATCH, PATCH), ...) creates."""
    rng = np.random.default_rng(seed)

    def normal(*shape: int, std: float = 1.0) -> np.ndarray:
        return (std * rng.standard_normal(shape)).astype(np.float32)

    def dense(i: int, o: int) -> dict[str, np.ndarray]:
        return {"kernel": normal(i, o, std=i**-0.5), "bias": normal(o, std=0.1)}

    def ln() -> dict[str, np.ndarray]:
        return {"scale": 1 + normal(D, std=0.1), "bias": normal(D, std=0.1)}

    def mha() -> dict[str, np.ndarray]:
        out = {}
        for n in ("query", "key", "value"):
            out[f"{n}/kernel"], out[f"{n}/bias"] = normal(D, HEADS, HD, std=D**-0.5), normal(HEADS, HD, std=0.1)
        out["out/kernel"], out["out/bias"] = normal(HEADS, HD, D, std=D**-0.5), normal(D, std=0.1)
        return out

    def sub(prefix: str, tree: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {f"{prefix}/{k}": v for k, v in tree.items()}

    def mlp() -> dict[str, np.ndarray]:
        return {**sub("Dense_0", dense(D, MLP)), **sub("Dense_1", dense(MLP, D))}

    p = {"embedding/kernel": normal(PATCH, PATCH, 3, D, std=(3 * PATCH * PATCH) ** -0.5), "embedding/bias": normal(D)}
    if posemb == "learn":
        p["pos_embedding"] = normal(1, grid[0] * grid[1], D, std=D**-0.5)
    if pool_type == "tok":
        p["cls"] = normal(1, 1, D, std=0.5)
    blocks = [
        {**sub("LayerNorm_0", ln()), **sub("MultiHeadDotProductAttention_0", mha()), **sub("LayerNorm_1", ln())}
        | sub("MlpBlock_0", mlp())
        for _ in range(DEPTH)
    ]
    if scan:  # nn.scan(variable_axes={"params": 0}): one encoderblock, every array with a leading depth axis
        p |= {f"Transformer/encoderblock/{k}": np.stack([b[k] for b in blocks]) for k in blocks[0]}
    else:
        for i, b in enumerate(blocks):
            p |= sub(f"Transformer/encoderblock_{i}", b)
    p |= sub("Transformer/encoder_norm", ln())
    if pool_type == "map":
        p |= sub("MAPHead_0", {"probe": normal(1, 1, D), **sub("MultiHeadDotProductAttention_0", mha())})
        p |= sub("MAPHead_0/LayerNorm_0", ln()) | sub("MAPHead_0/MlpBlock_0", mlp())
    if rep_size:
        p |= sub("pre_logits", dense(D, rep_size))
    p |= sub("head", dense(rep_size or D, CLASSES))
    return p


def save_npz(path: Path, params: dict[str, np.ndarray]) -> Path:
    np.savez(path, **params)
    return path


def images(size: tuple[int, int] = (32, 32), batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(1))


def nhwc(x: torch.Tensor) -> np.ndarray:
    return x.permute(0, 2, 3, 1).double().numpy()


def vitkit_logits(model: torch.nn.Module, x: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(x).double().numpy()


TOL = dict(rtol=1e-5, atol=1e-5)

# (posemb, pool_type, rep_size, scan): the forms big_vision trains, each loaded and run against its forward
FORMS = {
    "sincos2d_gap": ("sincos2d", "gap", 0, False),  # "better plain ViT baselines" (i1k-s16-*)
    "map": ("learn", "map", 0, False),  # SigLIP's image tower head
    "map_sincos2d_scanned": ("sincos2d", "map", 0, True),
    "tok_scanned_pre_logits": ("learn", "tok", 16, True),
    "tok_sincos2d": ("sincos2d", "tok", 0, False),
    "gap_scanned": ("learn", "gap", 0, True),
}


def overrides_for(posemb: str, pool_type: str, size: tuple[int, int] = (32, 32)) -> dict:
    """What the caller tells load_model that a big_vision file does not say."""
    out = {"pos_embed": "sincos_2d", "img_size": size} if posemb == "sincos2d" else {}
    return out | ({"classifier": "first"} if pool_type == "0" else {})


@pytest.mark.parametrize("form", list(FORMS))
def test_big_vision_forms_match_its_forward(tmp_path, form):
    posemb, pool, rep, scan = FORMS[form]
    params = big_vision_params(posemb, pool, rep, scan)
    path = save_npz(tmp_path / "bv.npz", params)
    model, report = load_model(path, return_report=True, **overrides_for(posemb, pool))
    expected = BigVisionReference(posemb, pool, rep, scan)(params, nhwc(images()))
    np.testing.assert_allclose(vitkit_logits(model, images()), expected["logits"], **TOL)
    assert report.ok and not report.guessed
    assert model.config.classifier == {"gap": "gap", "map": "map", "tok": "token"}[pool]
    assert model.config.pos_embed == ("sincos_2d" if posemb == "sincos2d" else "learned")
    # both attention paths, and the representation the head reads (what few-shot evaluation uses)
    with torch.no_grad():
        x = images()
        np.testing.assert_allclose(model(x, attn_impl="explicit").double().numpy(), expected["logits"], **TOL)
        feats = model.forward_head(model.forward_features(x), pre_logits=True).double().numpy()
        np.testing.assert_allclose(feats, expected["pre_logits"], **TOL)
        np.testing.assert_allclose(model.forward_features(x).double().numpy(), expected["encoded"], **TOL)


def test_sincos2d_non_square_image(tmp_path):
    """The table is built for the caller's grid (4x6 here), as big_vision builds it from the stem's output."""
    params = big_vision_params("sincos2d", "gap")
    model = load_model(save_npz(tmp_path / "bv.npz", params), pos_embed="sincos_2d", img_size=(32, 48))
    x = images((32, 48))
    expected = BigVisionReference("sincos2d", "gap")(params, nhwc(x))["logits"]
    np.testing.assert_allclose(vitkit_logits(model, x), expected, **TOL)


@pytest.mark.parametrize("grid,width", [((4, 4), 32), ((3, 5), 8), ((14, 14), 384), ((1, 7), 16)])
def test_sincos_2d_table_is_big_vision_posemb_sincos_2d(grid, width):
    """Temperature 1e4, omega over width // 4 - 1, [sin x, cos x, sin y, cos y], rows in raster order; float32."""
    table = sincos_2d(grid, width)
    assert table.dtype == torch.float32 and table.shape == (grid[0] * grid[1], width)
    np.testing.assert_allclose(table.double().numpy(), posemb_sincos_2d(*grid, width)[0], rtol=0, atol=2e-6)
    model = VisionTransformer(
        img_size=(grid[0] * 2, grid[1] * 2), patch_size=2, width=width, depth=1, num_heads=1, mlp_dim=4,
        pos_embed="sincos_2d", classifier="gap",
    )  # fmt: skip
    np.testing.assert_allclose(model.pos_embed_fixed[0].double().numpy(), posemb_sincos_2d(*grid, width)[0], atol=2e-6)


# --------------------------------------------------------------------------------- what the file cannot say
def test_sincos2d_file_needs_img_size_and_pos_embed(tmp_path):
    path = save_npz(tmp_path / "bv.npz", big_vision_params("sincos2d", "gap"))
    for given in ({}, {"pos_embed": "sincos_2d"}, {"img_size": 32}, {"img_size": 32, "pos_embed": "learned"}):
        with pytest.raises(UserError, match=r"img_size=.*pos_embed='sincos_2d'") as e:
            load_model(path, **given)
        assert "\n" not in str(e.value)


def test_overrides_reach_the_report(tmp_path):
    path = save_npz(tmp_path / "bv.npz", big_vision_params("sincos2d", "gap"))
    model, report = load_model(path, return_report=True, pos_embed="sincos_2d", img_size=32)
    assert set(report.from_caller) == {"img_size", "pos_embed"}
    assert "the caller's" in report.from_caller["img_size"] and "(32, 32)" in report.from_caller["img_size"]
    assert "sincos_2d" in str(report)
    # a read checkpoint carries the caller's settings to load_pretrained as well
    ckpt = read_checkpoint(path, overrides={"pos_embed": "sincos_2d", "img_size": 32})
    other = VisionTransformer(**{k: v for k, v in ckpt.config.items() if k != "arch"})
    assert set(load_pretrained(other, ckpt).from_caller) == {"img_size", "pos_embed"}
    torch.testing.assert_close(other(images()), model(images()))


def test_pool_type_0_only_with_an_override(tmp_path):
    """pool_type '0' (first token, no class token) stores what 'gap' stores: the caller says which."""
    params = big_vision_params("learn", "0")
    path = save_npz(tmp_path / "bv.npz", params)
    expected = BigVisionReference("learn", "0")(params, nhwc(images()))["logits"]
    first, report = load_model(path, return_report=True, classifier="first")
    np.testing.assert_allclose(vitkit_logits(first, images()), expected, **TOL)
    assert "classifier" in report.from_caller and "first" in report.from_caller["classifier"]
    gap, report = load_model(path, return_report=True)  # what the file alone reads as: big_vision's default
    assert gap.config.classifier == "gap" and not report.from_caller
    assert not np.allclose(vitkit_logits(gap, images()), expected, atol=1e-3)


def test_cli_key_value_overrides(tmp_path):
    params = big_vision_params("sincos2d", "gap")
    src = save_npz(tmp_path / "bv.npz", params)
    assert cli_main(["convert", str(src), str(tmp_path / "out"), "pos_embed=sincos_2d", "img_size=32"]) == 0
    expected = BigVisionReference("sincos2d", "gap")(params, nhwc(images()))["logits"]
    np.testing.assert_allclose(vitkit_logits(load_model(tmp_path / "out"), images()), expected, **TOL)


# ------------------------------------------------------------------------------------------------ MAP head
def test_map_head_outputs_and_attention(tmp_path):
    params = big_vision_params("learn", "map")
    model = load_model(save_npz(tmp_path / "bv.npz", params))
    expected = BigVisionReference("learn", "map")(params, nhwc(images()))
    with torch.no_grad():
        out = model.forward_intermediates(images(), return_attention=True)
    np.testing.assert_allclose(out["logits"].double().numpy(), expected["logits"], **TOL)
    np.testing.assert_allclose(out["pooled"].double().numpy(), expected["head_input"], **TOL)
    np.testing.assert_allclose(out["map_attention"].double().numpy(), expected["map_attention"], **TOL)
    assert len(out["attention"]) == DEPTH
    # inspection shows what the head reads: the probe's attention, and the rollout carried through it
    rec = record_attention(model, images())
    maps = probe_attention(rec)
    assert maps.shape == (2, HEADS, 4, 4)
    np.testing.assert_allclose(maps.double().numpy().reshape(2, HEADS, 16), expected["map_attention"][:, :, 0], **TOL)
    roll = rollout_map(rec)
    torch.testing.assert_close(roll.sum(dim=(1, 2)), torch.ones(2), rtol=0, atol=1e-5)  # no class token to keep mass
    assert query_attention(rec).shape == (DEPTH, 2, HEADS, 4, 4)


def test_map_head_inspection_figures(tmp_path):
    from vitkit.inspect import InspectionImage, write_inspection

    model = load_model(save_npz(tmp_path / "bv.npz", big_vision_params("learn", "map")))
    x = images(batch=1)[0]
    display = ((x.permute(1, 2, 0) - x.min()) / (x.max() - x.min())).numpy()
    write_inspection(model, tmp_path / "inspect", [InspectionImage("im", x, display)])
    assert (tmp_path / "inspect" / "map_attention_00_im.png").is_file()


def test_map_head_init_and_every_new_parameter_gets_a_gradient():
    model = VisionTransformer(img_size=32, patch_size=8, width=D, depth=DEPTH, num_heads=HEADS, mlp_dim=MLP,
                              num_classes=CLASSES, classifier="map")  # fmt: skip
    pool = model.attn_pool
    bound = math.sqrt(6 / (1 + D))  # Flax xavier_uniform of a (1, 1, D) probe
    assert 0 < float(pool.latent.detach().abs().max()) <= bound and float(pool.q.bias.detach().abs().max()) == 0
    with torch.no_grad():
        model.head.weight.normal_()  # a zero head passes no gradient back
    model(images()).square().sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert "attn_pool.latent" in model.no_weight_decay()
    first = VisionTransformer(img_size=32, patch_size=8, width=D, depth=DEPTH, num_heads=HEADS, mlp_dim=MLP,
                              num_classes=CLASSES, classifier="first")  # fmt: skip
    with torch.no_grad():
        first.head.weight.normal_()
    first(images()).square().sum().backward()
    assert all(p.grad is not None for p in first.parameters())


def test_map_model_exports_to_big_vision_layout(tmp_path):
    params = big_vision_params("learn", "map")
    model = load_model(save_npz(tmp_path / "bv.npz", params))
    written = vitkit_to_official(model, "linen")
    assert {k for k in written if k.startswith("MAPHead_0/")} == {k for k in params if k.startswith("MAPHead_0/")}
    for k in (k for k in params if k.startswith("MAPHead_0/")):
        np.testing.assert_array_equal(written[k], params[k], err_msg=k)
    again = load_model(save_npz(tmp_path / "again.npz", written))
    torch.testing.assert_close(again(images()), model(images()), rtol=0, atol=0)


def test_sincos2d_model_exports_without_a_table(tmp_path):
    params = big_vision_params("sincos2d", "gap")
    model = load_model(save_npz(tmp_path / "bv.npz", params), pos_embed="sincos_2d", img_size=32)
    written = vitkit_to_official(model, "linen")
    assert not any("pos_embedding" in k for k in written)
    again = load_model(save_npz(tmp_path / "again.npz", written), pos_embed="sincos_2d", img_size=32)
    torch.testing.assert_close(again(images()), model(images()), rtol=0, atol=0)


# ------------------------------------------------------------------------ layouts big_vision's loader accepts
PRE_LINEN = {  # flax.training.checkpoints.convert_pre_linen undoes one counter shared across module types
    "LayerNorm_0": "LayerNorm_0",
    "MultiHeadDotProductAttention_0": "MultiHeadDotProductAttention_1",
    "LayerNorm_1": "LayerNorm_2",
    "MlpBlock_0": "MlpBlock_3",
}


def pre_linen(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {}
    for k, v in params.items():
        if m := re.match(r"(Transformer/encoderblock_\d+)/(\w+)/(.*)$", k):
            k = f"{m.group(1)}/{PRE_LINEN[m.group(2)]}/{m.group(3)}"
        out[k] = v
    return out


def combined_cls_posemb(params: dict[str, np.ndarray], where: str) -> dict[str, np.ndarray]:
    """Old big_vision: the class token was prepended, then the table added, so it holds N + 1 rows; big_vision's
    fix_old_checkpoints adds the first row to cls. Here the file holds cls - row, so the fixed model is the same."""
    out = dict(params)
    pe = out.pop("pos_embedding")
    row = np.random.default_rng(5).standard_normal((1, 1, D)).astype(np.float32)
    out["cls"] = out["cls"] - row
    out[where] = np.concatenate([row, pe], axis=1)
    return out


def moved(params: dict[str, np.ndarray], where: str) -> dict[str, np.ndarray]:
    out = dict(params)
    out[where] = out.pop("pos_embedding")
    return out


def inline_map_head(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """ViT-G's development runs had the MAP head's parameters at the top level (fix_old_checkpoints moves them)."""
    return {k[len("MAPHead_0/") :] if k.startswith("MAPHead_0/") else k: v for k, v in params.items()}


def bfloat16_as_void(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """numpy saves bfloat16 as 2-byte void (utils.recover_dtype reads it back): the top 16 bits of float32."""
    return {k: (v.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view("V2") for k, v in params.items()}


def as_bfloat16(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: (v.astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32) for k, v in params.items()}


OPT_STATE = {"opt/state/step": np.array(3), "opt/state/param_states/0/grad_ema": np.zeros(4, np.float32)}

# name: (form of FORMS, layout as a function of the params, the params big_vision's forward then sees)
LAYOUTS = {
    "pre_linen_block_names": ("tok_pre_logits", pre_linen, None),
    "posembed_input_in_encoder": ("map", lambda p: moved(p, "Transformer/posembed_input/pos_embedding"), None),
    "pos_embedding_in_encoder": ("map", lambda p: moved(p, "Transformer/pos_embedding"), None),
    "combined_cls_posemb": ("tok", lambda p: combined_cls_posemb(p, "pos_embedding"), None),
    "combined_cls_posemb_in_encoder": ("tok", lambda p: combined_cls_posemb(p, "Transformer/pos_embedding"), None),
    "params_prefix_beside_state": ("map", lambda p: {f"params/{k}": v for k, v in p.items()} | OPT_STATE, None),
    "opt_target_prefix": ("map", lambda p: {f"opt/target/{k}": v for k, v in p.items()} | OPT_STATE, None),
    "scanned": ("gap_scanned", lambda p: p, None),
    "inline_map_head": ("map", inline_map_head, None),
    "bfloat16": ("map", bfloat16_as_void, as_bfloat16),
}
LAYOUT_FORMS = {"tok": ("learn", "tok", 0, False), "tok_pre_logits": ("learn", "tok", 16, False), **FORMS}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_big_vision_loads(tmp_path, name):
    form, layout, seen = LAYOUTS[name]
    posemb, pool, rep, scan = LAYOUT_FORMS[form]
    params = big_vision_params(posemb, pool, rep, scan)
    model = load_model(save_npz(tmp_path / "bv.npz", layout(params)), **overrides_for(posemb, pool))
    expected = BigVisionReference(posemb, pool, rep, scan)((seen or (lambda p: p))(params), nhwc(images()))
    np.testing.assert_allclose(vitkit_logits(model, images()), expected["logits"], **TOL)


# ---------------------------------------------------------------------------------- image-text checkpoints
def siglip(img: dict[str, np.ndarray], towers: tuple[str, ...] = ("img",)) -> dict[str, np.ndarray]:
    """A two_towers checkpoint as big_vision saves it: params/{img, txt, t, b}; the text tower is a
    text_transformer (Embed_0, its own Transformer), t and b the SigLIP temperature and bias."""
    rng = np.random.default_rng(3)
    out = {f"params/{tower}/{k}": v for tower in towers for k, v in img.items()}
    out["params/txt/Embed_0/embedding"] = rng.standard_normal((50, D)).astype(np.float32)
    out["params/txt/Transformer/encoder_norm/scale"] = np.ones(D, np.float32)
    out["params/t"], out["params/b"] = np.array([2.3], np.float32), np.array([-10.0], np.float32)
    return out


def test_siglip_image_tower(tmp_path):
    params = big_vision_params("learn", "map")
    path = save_npz(tmp_path / "siglip.npz", siglip(params))
    expected = BigVisionReference("learn", "map")(params, nhwc(images()))["logits"]
    # the only ViT in the file: read from it, and the report says which sub-tree
    model, report = load_model(path, return_report=True)
    np.testing.assert_allclose(vitkit_logits(model, images()), expected, **TOL)
    assert report.metadata["tower"] == "img" and report.ok
    # named, as a keyword or as big_vision's 'file.npz:img'
    for model in (load_model(path, tower="img"), load_model(f"{path}:img")):
        np.testing.assert_allclose(vitkit_logits(model, images()), expected, **TOL)
    with pytest.raises(UserError, match=r"no sub-tree 'txt2'.*'img'"):
        load_model(path, tower="txt2")


def test_several_image_towers_need_a_choice(tmp_path):
    params = big_vision_params("learn", "map")
    path = save_npz(tmp_path / "two.npz", siglip(params, ("img", "student")))
    with pytest.raises(UserError, match=r"several ViT sub-trees \['img', 'student'\]; pass tower="):
        load_model(path)
    expected = BigVisionReference("learn", "map")(params, nhwc(images()))["logits"]
    np.testing.assert_allclose(vitkit_logits(load_model(path, tower="student"), images()), expected, **TOL)
    with pytest.raises(UserError, match="tower"):
        load_model(tmp_path / "two.npz", tower="img", format="timm")


def test_class_token_and_map_head_together_is_an_error(tmp_path):
    params = big_vision_params("learn", "map") | {"cls": np.zeros((1, 1, D), np.float32)}
    with pytest.raises(UserError, match="class token and a MAP head"):
        load_model(save_npz(tmp_path / "bv.npz", params))


def test_load_pretrained_into_a_model_built_for_a_sincos_file(tmp_path):
    """The model says what the file cannot (its grid and table): load_pretrained needs no overrides."""
    model = VisionTransformer(
        img_size=32, patch_size=8, width=32, depth=1, num_heads=2, mlp_dim=64, classifier="gap", pos_embed="sincos_2d"
    )
    path = tmp_path / "sincos.npz"
    np.savez(path, **vitkit_to_official(model))
    target = VisionTransformer(model.config)
    report = load_pretrained(target, path)
    assert report.ok and "img_size" in report.from_caller
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(target(x), model(x))
