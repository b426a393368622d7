"""Inspection: attention distance, rollout, attention maps, embedding analyses and the `vitkit inspect` figures."""

import itertools
import json
import math

import pytest
import torch
from PIL import Image

from vitkit.checkpoint.native import save_pretrained
from vitkit.cli import main
from vitkit.inspect import (
    attention_distance,
    attention_maps,
    attention_rollout,
    mean_attention_distance,
    patch_filter_components,
    position_embedding_grid,
    position_similarity,
    record_attention,
    rollout_map,
)
from vitkit.models import VisionTransformer, sincos_2d

TINY = dict(img_size=16, patch_size=4, width=32, depth=2, num_heads=2, mlp_dim=64, num_classes=5)


def tiny_vit(**overrides) -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(**{**TINY, **overrides}).eval()


def mean_pairwise_distance(grid, stride) -> float:
    """The mean Euclidean pixel distance over all ordered pairs of token positions (self-pairs included)."""
    cells = list(itertools.product(range(grid[0]), range(grid[1])))
    total = sum(
        math.hypot((r1 - r2) * stride[0], (c1 - c2) * stride[1])
        for (r1, c1), (r2, c2) in itertools.product(cells, cells)
    )
    return total / len(cells) ** 2


# ----------------------------------------------------------------------------------------- attention distance
@pytest.mark.parametrize("prefix", [0, 1])
def test_attention_distance_of_self_attention_is_zero(prefix):
    grid, n = (3, 4), 12
    attn = torch.eye(prefix + n).expand(2, 3, 2, -1, -1)  # (L, B, nh, N, N): every token attends to itself
    dist = mean_attention_distance(attn, grid, (16, 16), prefix)
    assert dist.shape == (2, 2)
    assert torch.all(dist == 0)


@pytest.mark.parametrize("grid, stride, prefix", [((4, 4), (16, 16), 1), ((3, 5), (8, 32), 0)])
def test_attention_distance_of_uniform_attention_is_the_mean_pairwise_distance(grid, stride, prefix):
    n = prefix + grid[0] * grid[1]
    attn = torch.full((3, 2, 4, n, n), 1.0 / n)  # uniform, also over the class token (renormalised away)
    dist = mean_attention_distance(attn, grid, stride, prefix)
    torch.testing.assert_close(dist, torch.full((3, 4), mean_pairwise_distance(grid, stride)))


def test_attention_distance_averages_heads_separately():
    grid, n = (2, 2), 4
    local, uniform = torch.eye(n), torch.full((n, n), 1.0 / n)
    attn = torch.stack([local, uniform])[None, None]  # (L=1, B=1, nh=2, N, N): head 0 local, head 1 global
    dist = mean_attention_distance(attn, grid, (10, 10))[0]
    assert dist[0] == 0
    assert dist[1].item() == pytest.approx(mean_pairwise_distance(grid, (10, 10)))


def test_attention_distance_of_a_model_is_in_pixel_range():
    model = tiny_vit()
    images = torch.randn(5, 3, 16, 16)
    dist = attention_distance(model, images, batch_size=2)  # (L, nh), batched over the images
    assert dist.shape == (2, 2)
    one_batch = mean_attention_distance(attention_maps(model, images), model.grid, model.config.stride, 1)
    torch.testing.assert_close(torch.from_numpy(dist), one_batch)
    max_distance = math.hypot(12, 12)  # opposite corners of the 4x4 grid, 4 px apart
    assert (dist > 0).all() and (dist < max_distance).all()


# ------------------------------------------------------------------------------------------------- rollout
def test_rollout_of_identity_attention_is_identity():
    n = 6
    attn = torch.eye(n).expand(3, 2, 4, n, n)
    torch.testing.assert_close(attention_rollout(attn), torch.eye(n).expand(2, n, n))


def test_rollout_rows_sum_to_one_and_follow_the_definition():
    gen = torch.Generator().manual_seed(0)
    attn = torch.randn(3, 2, 4, 7, 7, generator=gen).softmax(-1)  # (L, B, nh, N, N)
    joint = attention_rollout(attn)
    torch.testing.assert_close(joint.sum(-1), torch.ones(2, 7))
    per_layer = [(a.mean(1) + torch.eye(7)) / 2 for a in attn]  # heads averaged, identity added, rows renormalised
    torch.testing.assert_close(joint, per_layer[2] @ per_layer[1] @ per_layer[0])


@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_rollout_map_covers_the_patch_grid(classifier):
    model = tiny_vit(classifier=classifier)
    rec = record_attention(model, torch.randn(2, 3, 16, 16))
    heat = rollout_map(rec)
    assert heat.shape == (2, 4, 4) and (heat > 0).all()
    total = heat.sum(dim=(1, 2))
    if classifier == "gap":  # no class token: the pooled tokens' rows lie entirely on patches
        torch.testing.assert_close(total, torch.ones(2))
    else:  # the class token keeps some of its own mass
        assert (total < 1).all()


# ------------------------------------------------------------------------------------------ attention maps
@pytest.mark.parametrize(
    "overrides",
    [{}, {"classifier": "gap", "pos_embed": "sincos_2d"}, {"resnet_layers": (), "patch_size": 1, "img_size": 32}],
    ids=["token", "gap", "hybrid"],
)
def test_explicit_attention_sums_to_one_and_matches_fused(overrides):
    model = tiny_vit(**overrides)
    size = model.config.img_size[0]
    x = torch.randn(2, 3, size, size)
    attn = attention_maps(model, x)
    n = model.num_prefix_tokens + model.grid[0] * model.grid[1]
    assert attn.shape == (2, 2, 2, n, n)  # (L, B, heads, N, N)
    torch.testing.assert_close(attn.sum(-1), torch.ones(2, 2, 2, n))
    with torch.no_grad():
        fused = model.forward_features(x, attn_impl="sdpa")
        explicit = model.forward_features(x, attn_impl="explicit")
        # the recorded probabilities reproduce the first block's attention output
        blk = model.blocks[0]
        tokens = blk.norm1(model.embed(x))
        B, N, D = tokens.shape
        v = blk.attn.qkv(tokens).reshape(B, N, 3, blk.attn.num_heads, blk.attn.head_dim)[:, :, 2].transpose(1, 2)
        out = blk.attn.proj((attn[0] @ v).transpose(1, 2).reshape(B, N, D))  # (B, nh, N, hd) -> (B, N, D)
    torch.testing.assert_close(explicit, fused, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, blk.attn(tokens), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------- embeddings
def test_sincos_similarity_is_maximal_on_the_diagonal_and_falls_with_distance():
    model = tiny_vit(pos_embed="sincos_2d", img_size=32, width=64)  # 8x8 grid
    table = position_embedding_grid(model)
    torch.testing.assert_close(table.reshape(64, 64), sincos_2d((8, 8), 64))
    sim = position_similarity(table)  # (8, 8, 8, 8)
    flat = sim.reshape(64, 64)
    torch.testing.assert_close(flat.diagonal(), torch.ones(64))
    off_diagonal = flat - 2 * torch.eye(64)
    assert (flat.diagonal() > off_diagonal.max(dim=1).values).all()
    for r, c in itertools.product(range(8), range(8)):
        row = [sim[r, c, r, c + d] for d in range(4) if c + d < 8]
        col = [sim[r, c, r + d, c] for d in range(4) if r + d < 8]
        assert all(a > b for a, b in zip(row, row[1:])) and all(a > b for a, b in zip(col, col[1:]))
        if r + 1 < 8 and c + 1 < 8:
            assert sim[r, c, r + 1, c + 1] < sim[r, c, r + 1, c]


@pytest.mark.parametrize("pos_embed", ["learned", "learned_2d"])
def test_position_grid_is_the_added_table_without_the_class_row(pos_embed):
    model = tiny_vit(pos_embed=pos_embed, img_size=(12, 20))  # 3x5 grid: not square
    table = position_embedding_grid(model)
    assert table.shape == (3, 5, 32)
    added = model._pos_embed_for(model.grid)[0, 1:].detach()
    torch.testing.assert_close(table.reshape(15, 32), added)
    assert position_similarity(table).shape == (3, 5, 3, 5)
    with pytest.raises(ValueError, match="no position embedding"):
        position_embedding_grid(tiny_vit(pos_embed="none"))


def test_patch_filter_components_are_the_principal_axes():
    model = tiny_vit()
    w = model.patch_embed.proj.weight  # (32, 3, 4, 4)
    with torch.no_grad():  # filters = mean + a * u + 0.1 * b * v: two known directions of decreasing variance
        gen = torch.Generator().manual_seed(0)
        u, v = torch.zeros(48), torch.zeros(48)
        u[0], v[5] = 1.0, 1.0
        a, b = torch.randn(32, 1, generator=gen), torch.randn(32, 1, generator=gen)
        w.copy_((0.3 + a * u + 0.1 * b * v).reshape(32, 3, 4, 4))
    comps, explained = patch_filter_components(model, 5)
    assert comps.shape == (5, 3, 4, 4) and explained.shape == (5,)
    flat = comps.reshape(5, -1)
    torch.testing.assert_close(flat @ flat.T, torch.eye(5), atol=1e-5, rtol=0)
    assert abs(flat[0] @ u) == pytest.approx(1, abs=1e-3) and abs(flat[1] @ v) == pytest.approx(1, abs=1e-3)
    assert explained[0] > 0.9 and explained[2:].sum() < 1e-6
    with pytest.raises(ValueError, match="hybrid"):
        patch_filter_components(tiny_vit(resnet_layers=(), patch_size=1, img_size=32))


# ------------------------------------------------------------------------------------------------------ CLI
def _open_png(path):
    assert path.stat().st_size > 1000
    with Image.open(path) as im:
        im.load()
        assert im.format == "PNG" and im.width > 100 and im.height > 100


def test_inspect_cli_writes_figures_that_open(tmp_path):
    ckpt = tmp_path / "ckpt"
    save_pretrained(tiny_vit(), ckpt, metadata={"class_names": list("abcde"), "img_size": 16, "mean": [0.5] * 3})
    image = tmp_path / "photo.png"
    Image.fromarray((torch.rand(40, 60, 3) * 255).byte().numpy()).save(image)
    out = tmp_path / "figures"
    assert main(["inspect", str(ckpt), str(image), "--out", str(out)]) == 0
    index = json.loads((out / "index.json").read_text())
    written = {w["file"] for w in index["written"]}
    assert {"patch_embedding_pca.png", "position_embedding_similarity.png", "attention_distance.png"} <= written
    assert {"rollout_00_photo.png", "attention_00_photo.png"} <= written
    assert index["skipped"] == []
    for name in written:
        _open_png(out / name)
    assert "attention_distance.png" in (out / "index.md").read_text()
    assert "layer 2 left out (its patch queries feed no output)" in (out / "index.md").read_text()  # class token


def test_inspect_cli_reports_what_it_skips(tmp_path, capsys):
    ckpt = tmp_path / "hybrid"
    save_pretrained(tiny_vit(resnet_layers=(), patch_size=1, img_size=32, pos_embed="none", classifier="gap"), ckpt)
    out = tmp_path / "figures"
    assert main(["inspect", str(ckpt), "--out", str(out)]) == 0  # no images, no data recorded
    index = json.loads((out / "index.json").read_text())
    assert index["written"] == []
    reasons = " ".join(s["reason"] for s in index["skipped"])
    assert "hybrid" in reasons and "no position embedding" in reasons and "no images" in reasons
    assert "does not record its data" in capsys.readouterr().err
    # data that is named but cannot be read is an error, not a smaller report
    assert main(["inspect", str(ckpt), "--out", str(tmp_path / "f2"), "--data", "folder", "--root", "/no/such"]) == 2
    assert "/no/such" in capsys.readouterr().err


def test_inspect_cli_takes_images_from_the_checkpoints_data(tmp_path):
    ckpt = tmp_path / "digits"
    meta = {"source": "digits", "class_names": [str(d) for d in range(10)], "img_size": 16, "in_chans": 1}
    save_pretrained(tiny_vit(in_chans=1, num_classes=10), ckpt, metadata=meta)
    out = tmp_path / "figures"
    argv = ["inspect", str(ckpt), "--out", str(out), "--num-images", "2", "--distance-images", "6"]
    assert main(argv) == 0
    index = json.loads((out / "index.json").read_text())
    rollouts = sorted(w["file"] for w in index["written"] if w["file"].startswith("rollout_"))
    assert len(rollouts) == 2 and rollouts[0].startswith("rollout_00_example")
    assert any("6 images" in w["description"] for w in index["written"])
    assert "digits" in " ".join(index["notes"])
    with Image.open(out / rollouts[0]) as im:
        assert im.width > 100


def test_inspect_refuses_an_earlier_inspection_and_force_leaves_exactly_the_new_index(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    save_pretrained(tiny_vit(), ckpt, metadata={"class_names": list("abcde"), "img_size": 16})
    photos = tmp_path / "photos"
    photos.mkdir()
    for name in ("cat", "dog"):
        Image.fromarray((torch.rand(20, 24, 3) * 255).byte().numpy()).save(photos / f"{name}.png")
    out = tmp_path / "figures"
    out.mkdir()
    (out / "notes.txt").write_text("mine")  # not an inspection's file: never refused, never removed
    assert main(["inspect", str(ckpt), str(photos), "--out", str(out)]) == 0  # a folder: its images, sorted
    first = json.loads((out / "index.json").read_text())
    assert {"rollout_00_cat.png", "rollout_01_dog.png", "attention_01_dog.png"} <= {w["file"] for w in first["written"]}
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    capsys.readouterr()
    assert main(["inspect", str(ckpt), str(photos / "cat.png"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vitkit inspect: error: ") and str(out / "index.json") in err[0]
    assert "--force" in err[0]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing touched

    assert main(["inspect", str(ckpt), str(photos / "cat.png"), "--out", str(out), "--force"]) == 0
    printed = capsys.readouterr().out
    index = json.loads((out / "index.json").read_text())
    listed = {w["file"] for w in index["written"]}
    assert "rollout_01_dog.png" not in listed and "rollout_00_cat.png" in listed
    # the directory holds exactly what the new index lists (the dog's figures are gone), plus the user's file
    assert {p.name for p in out.iterdir()} == listed | {"index.json", "index.md", "notes.txt"}
    assert (out / "notes.txt").read_text() == "mine"
    assert f"removed {out}/rollout_01_dog.png" in printed and f"removed {out}/attention_01_dog.png" in printed


def test_inspect_images_that_do_not_exist_are_one_line_before_any_work(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    save_pretrained(tiny_vit(), ckpt, metadata={"img_size": 16})
    (tmp_path / "empty").mkdir()
    for missing, cause in ((tmp_path / "nope.png", "no such image file or folder"), (tmp_path / "empty", "no image")):
        capsys.readouterr()
        assert main(["inspect", str(ckpt), str(missing), "--out", str(tmp_path / "figs")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(missing) in err[0] and cause in err[0]
    assert not (tmp_path / "figs").exists()


def test_rollout_colour_bar_shows_the_colours_blended_onto_the_image():
    from matplotlib.collections import QuadMesh

    from vitkit.inspect.figures import ROLLOUT_ALPHA, rollout_figure

    torch.manual_seed(0)
    image, heat = torch.rand(12, 16, 3).numpy(), 3.0 * torch.rand(12, 16).double().numpy()  # heat: any scale
    fig = rollout_figure(image, heat)
    (cax,) = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    (bar,) = [c for c in cax.collections if isinstance(c, QuadMesh)]  # the bar's colour strip
    overlay = fig.axes[1].get_images()[-1]  # drawn over the input image
    # the overlay's colours are the bar's cmap and norm applied to the rollout (as a share of its max) ...
    expected = bar.get_cmap()(bar.norm(heat / heat.max()))
    assert overlay.get_array().shape == expected.shape
    torch.testing.assert_close(torch.as_tensor(overlay.get_array()), torch.as_tensor(expected))
    assert (bar.norm.vmin, bar.norm.vmax) == (0, 1) and bar.get_cmap().name == "inferno"
    # ... blended at the overlay's opacity, while the bar shows them at full strength rather than faded over white
    assert overlay.get_alpha() == ROLLOUT_ALPHA and bar.get_alpha() in (None, 1.0)


@pytest.mark.parametrize("chans", [1, 3])
def test_patch_components_mosaic_shows_each_component_scaled_under_its_label(tmp_path, monkeypatch, chans):
    from matplotlib.figure import Figure

    from vitkit.inspect import figures

    drawn: list[Figure] = []
    monkeypatch.setattr(figures, "_save", lambda fig, path: drawn.append(fig))
    torch.manual_seed(0)
    comps, explained = torch.randn(9, chans, 4, 4).double().numpy(), [0.3 - 0.02 * i for i in range(9)]
    figures.plot_patch_components(comps, explained, tmp_path / "pca.png", ncols=4)  # 3 rows, the last one short
    ((ax,),) = [drawn[0].axes]
    grid = ax.get_images()[0].get_array()
    assert grid.shape[:2] == (3 * 4 + 2, 4 * 4 + 3)  # 4x4 tiles, 1-pixel white gutters
    labels = {t.get_text(): t.get_position() for t in ax.texts}
    for i in range(9):
        r, c = divmod(i, 4)
        tile = grid[5 * r : 5 * r + 4, 5 * c : 5 * c + 4]
        comp = comps[i].transpose(1, 2, 0).squeeze(-1) if chans == 1 else comps[i].transpose(1, 2, 0)
        expected = (comp - comp.min()) / (comp.max() - comp.min())  # min-max over the whole component
        torch.testing.assert_close(torch.as_tensor(tile), torch.as_tensor(expected))
        x, y = labels[f"PC {i + 1} ({100 * explained[i]:.1f}%)"]
        assert x == 5 * c + 1.5 and 5 * r - 1 < y < 5 * r  # centred just above its tile
    assert (grid[4] == 1).all() and (grid[10:, 15:] == 1).all()  # a gutter row, and the empty places are white
