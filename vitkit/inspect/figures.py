"""PNG figures of the inspection arrays, drawn like the paper's Fig 6, 7 and 11, with matplotlib's object API on the
Agg canvas (no pyplot, no global state: any thread, any machine); a grid of small maps is one mosaic image."""

from __future__ import annotations

from pathlib import Path

import matplotlib as mpl
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..io import atomic_write

DPI = 120


def _save(fig: Figure, path: str | Path) -> Path:
    """Render on the Agg canvas and write the PNG atomically (a half-written figure never replaces a good one)."""
    path = Path(path)
    FigureCanvasAgg(fig)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=DPI, bbox_inches="tight", facecolor="white"))
    return path


def _titles(fig: Figure, ax, title: str, subtitle: str = "") -> None:
    """The figure's title with an optional small grey line of context under it."""
    fig.suptitle(title, fontsize=11)
    if subtitle:
        ax.set_title(subtitle, fontsize=7, color="0.35")


def mosaic(tiles: np.ndarray, gap: int = 1, fill: float = np.nan) -> np.ndarray:
    """(R, C, h, w, ...) tiles -> one (R * (h + gap) - gap, C * (w + gap) - gap, ...) image, gutters ``fill``."""
    r, c, h, w = tiles.shape[:4]
    out = np.full((r * (h + gap) - gap, c * (w + gap) - gap, *tiles.shape[4:]), fill)
    for i in range(r):
        for j in range(c):
            out[i * (h + gap) : i * (h + gap) + h, j * (w + gap) : j * (w + gap) + w] = tiles[i, j]
    return out


def _tile_ticks(n: int, size: int, gap: int, max_labels: int = 16) -> tuple[list[float], list[str]]:
    """Tick positions at the centres of n tiles of the given size, labelled 1..n (thinned out when n is large)."""
    step = max(1, -(-n // max_labels))
    idx = list(range(0, n, step))
    return [i * (size + gap) + (size - 1) / 2 for i in idx], [str(i + 1) for i in idx]


def _mosaic_axes(ax, cols: int, rows: int, tile_w: int, tile_h: int, gap: int) -> None:
    """Label a mosaic's tiles 1..cols along x and 1..rows along y, without ticks or frame."""
    xt, xl = _tile_ticks(cols, tile_w, gap)
    yt, yl = _tile_ticks(rows, tile_h, gap)
    ax.set_xticks(xt, xl, fontsize=7)
    ax.set_yticks(yt, yl, fontsize=7)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)


def _display_image(image: np.ndarray) -> tuple[np.ndarray, str | None]:
    """(H, W, C) in [0, 1] -> something imshow draws faithfully, and the colour map for one channel."""
    image = np.clip(np.asarray(image, dtype=np.float64), 0.0, 1.0)
    if image.ndim == 3 and image.shape[2] != 3:
        image = image.mean(axis=2)  # grey, or neither grey nor RGB: one channel, the mean
    return image, ("gray" if image.ndim == 2 else None)


# ----------------------------------------------------------------------------------------------- Fig 7 left
def plot_patch_components(
    components: np.ndarray, explained: np.ndarray, path: str | Path, title: str = "", ncols: int = 7
) -> Path:
    """Principal components of the patch-embedding filters (n, C, P, P) as a grid of RGB (or grey) patches, each
    min-max scaled (its sign and scale are arbitrary) and labelled with its share of the variance."""
    components, explained = np.asarray(components, dtype=np.float64), np.asarray(explained, dtype=np.float64)
    n, chans = components.shape[:2]
    ncols = min(ncols, n)
    nrows = -(-n // ncols)
    low = components.reshape(n, -1).min(axis=1)[:, None, None, None]
    span = np.maximum(components.reshape(n, -1).max(axis=1)[:, None, None, None] - low, 1e-12)
    tiles = np.stack([_display_image(c.transpose(1, 2, 0))[0] for c in (components - low) / span])  # in [0, 1]
    ph, pw = tiles.shape[1:3]
    gap = max(1, ph // 3)
    blank = np.ones((nrows * ncols - n, *tiles.shape[1:]))  # white: the empty places of the last row
    grid = mosaic(np.concatenate([tiles, blank]).reshape(nrows, ncols, *tiles.shape[1:]), gap, fill=1.0)
    width = 1.3 * ncols  # inches; the mosaic fills the width, with 0.7 in above it for the titles
    height = 0.96 * width * grid.shape[0] / grid.shape[1]
    fig = Figure(figsize=(width, height + 0.8))
    ax = fig.add_axes((0.02, 0.1 / (height + 0.8), 0.96, height / (height + 0.8)))
    ax.imshow(grid, cmap="gray" if grid.ndim == 2 else None, vmin=0, vmax=1, interpolation="nearest")
    ax.set_axis_off()
    for i in range(n):
        r, c = divmod(i, ncols)
        x, y = c * (pw + gap) + (pw - 1) / 2, r * (ph + gap) - 0.5 - gap / 4
        ax.text(x, y, f"PC {i + 1} ({100 * explained[i]:.1f}%)", fontsize=7, ha="center", va="bottom")
    kind = "RGB" if chans == 3 else ("Grey-scale" if chans == 1 else f"{chans}-channel (mean shown)")
    fig.suptitle(title or f"{kind} embedding filters: first {n} principal components", fontsize=10)
    return _save(fig, path)


# --------------------------------------------------------------------------------------------- Fig 7 centre
def plot_position_similarity(similarity: np.ndarray, path: str | Path, title: str = "") -> Path:
    """Fig 7 centre: tile (r, c) is patch (r, c)'s position-embedding similarity (gh, gw, gh, gw) with every patch."""
    sim = np.asarray(similarity, dtype=np.float64)
    gh, gw = sim.shape[:2]
    gap = max(1, max(gh, gw) // 8)
    image = mosaic(sim, gap)
    side = min(9.0, max(4.0, 0.35 * max(gh, gw) + 2))
    fig = Figure(figsize=(side + 1.2, side * gh / gw + 0.4))
    ax = fig.add_subplot(1, 1, 1)
    # The paper's scale is [-1, 1]; tables whose similarities are all high (sin-cos) get a tighter lower end
    # so their structure stays visible. The colour bar shows which.
    vmin = max(-1.0, np.floor(10 * np.nanmin(image)) / 10)
    im = ax.imshow(np.ma.masked_invalid(image), cmap="viridis", vmin=vmin, vmax=1, interpolation="nearest")
    _mosaic_axes(ax, gw, gh, gw, gh, gap)
    ax.set_xlabel("Input patch column")
    ax.set_ylabel("Input patch row")
    ax.set_title(title or f"Position embedding similarity ({gh}x{gw} patches)")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03, label="Cosine similarity")
    return _save(fig, path)


# ---------------------------------------------------------------------------------------- Fig 7 right / 11
def plot_attention_distance(
    distance: np.ndarray, path: str | Path, title: str = "", reference: float | None = None, subtitle: str = ""
) -> Path:
    """Mean attention distance (L, nh) of every head against depth; ``reference``: uniform attention's. A layer of
    NaN (not measured) has no dots."""
    dist = np.asarray(distance, dtype=np.float64)
    layers, heads = dist.shape
    fig = Figure(figsize=(max(4.5, 0.35 * layers + 2.5), 4.0))
    ax = fig.add_subplot(1, 1, 1)
    colors = mpl.colormaps["tab20" if heads > 10 else "tab10"]
    depth = np.arange(1, layers + 1)
    for h in range(heads):
        ax.scatter(depth, dist[:, h], s=16, color=colors(h % colors.N), label=f"Head {h + 1}", zorder=3)
    if reference is not None:
        ax.axhline(reference, color="0.5", linestyle="--", linewidth=1, zorder=2, label="uniform\nattention")
    ax.set_xlim(0.3, layers + 0.7)
    ax.set_xticks(depth if layers <= 16 else depth[:: -(-layers // 16)])
    top = max(np.nanmax(dist), reference or 0.0)
    ax.set_ylim(0, 1.1 * top if top > 0 else 1)
    ax.set_xlabel("Network depth (layer)")
    ax.set_ylabel("Mean attention distance (pixels)")
    ax.grid(True, alpha=0.3, zorder=0)
    _titles(fig, ax, title or "Mean attention distance per head", subtitle)
    ncol = 1 if heads <= 12 else 2
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, ncol=ncol, frameon=False, markerscale=1.2)
    return _save(fig, path)


# ---------------------------------------------------------------------------------------------- Fig 6 / 14
ROLLOUT_ALPHA = 0.6  # opacity of the rollout colours blended onto the image


def plot_rollout(image: np.ndarray, heat: np.ndarray, path: str | Path, title: str = "") -> Path:
    """Fig 6: the image (H, W, C) in [0, 1], the rollout heat (H, W) overlaid, and the image weighted by it."""
    return _save(rollout_figure(image, heat, title), path)


def rollout_figure(image: np.ndarray, heat: np.ndarray, title: str = "") -> Figure:
    """The figure plot_rollout writes (arguments as there)."""
    img, cmap = _display_image(image)
    heat = np.asarray(heat, dtype=np.float64)
    heat = heat / heat.max() if heat.max() > 0 else heat  # share of the strongest location
    fig = Figure(figsize=(10.5, 3.9))
    axes = [fig.add_subplot(1, 3, i + 1) for i in range(3)]
    axes[0].imshow(img, cmap=cmap, vmin=0, vmax=1)
    axes[1].imshow(img, cmap=cmap, vmin=0, vmax=1)
    # The overlay's colours and the colour bar come from this one mapping. The overlay is drawn as those colours
    # (alpha applied to it alone): a bar built from a translucent image would copy its alpha and show the
    # scale faded over white, which matches nothing on the image.
    heat_colors = mpl.cm.ScalarMappable(norm=mpl.colors.Normalize(0, 1), cmap="inferno")
    axes[1].imshow(heat_colors.to_rgba(heat), alpha=ROLLOUT_ALPHA)
    weighted = img * (heat if img.ndim == 2 else heat[..., None])
    axes[2].imshow(weighted, cmap=cmap, vmin=0, vmax=1)
    for ax, name in zip(axes, ("Input", "Attention rollout", "Image x attention")):
        ax.set_title(name)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.colorbar(heat_colors, ax=axes, fraction=0.02, pad=0.02, label="Rollout (share of max)")
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def plot_attention_maps(maps: np.ndarray, path: str | Path, title: str = "", what: str = "") -> Path:
    """Per-layer, per-head attention (L, nh, gh, gw) as rows of layers, columns of heads, each map scaled by its own
    maximum so that a head's pattern shows even when spread thin."""
    maps = np.asarray(maps, dtype=np.float64)
    layers, heads, gh, gw = maps.shape
    peak = maps.reshape(layers, heads, -1).max(axis=-1)[..., None, None]
    maps = maps / np.maximum(peak, 1e-12)
    gap = max(1, max(gh, gw) // 7)
    image = mosaic(maps, gap)
    scale = min(0.7, 9.0 / max(heads, layers))
    fig = Figure(figsize=(scale * heads + 2.0, scale * layers * gh / gw + 1.0))
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(np.ma.masked_invalid(image), cmap="magma", vmin=0, vmax=1, interpolation="nearest")
    _mosaic_axes(ax, heads, layers, gw, gh, gap)
    ax.set_xlabel("Head")
    ax.set_ylabel("Layer")
    _titles(fig, ax, title or "Attention maps", what)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.03, label="Attention (share of the map's max)")
    return _save(fig, path)
