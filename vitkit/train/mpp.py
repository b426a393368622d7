"""Masked patch prediction (paper sec 4.6, appendix B.1.2): self-supervised pretraining of a ViT without labels.

    images (B, C, H, W) -> patch embeddings (B, N, D) -> corrupt mask_ratio of them -> class token + position
    embedding -> encoder -> final LayerNorm -> the corrupted patches' output tokens (M, D) -> Linear -> targets

Corruption precedes the position embedding, so a corrupted patch keeps its position. Every image has the same count
of corrupted patches (so each weighs the same in the loss); each becomes the [mask] embedding, another clean patch
of the same image, or stays, as BERT corrupts tokens. The saved run is the plain ViT plus ``mpp.*`` keys, with
metadata that tells every loader to drop them (``drop_on_load``)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from ..data import DatasetInfo
from ..device import autocast
from ..errors import UserError
from ..evaluate.loop import batches, evaluating
from ..models import VisionTransformer
from ..models.common import as_pair, zero_head
from ..pixels import patches_of, unnormalise
from .config import MPPConfig
from .sampling import mix_seed

MPP_PREFIX = "mpp."  # the checkpoint keys of the pretraining head; loaders drop them
KEPT, MASKED, REPLACED, UNCHANGED = 0, 1, 2, 3  # what corruption did to a patch; KEPT: not corrupted
BIN_EPS = 1e-5  # in bin units: a colour on a bin edge (k / 2^bits) lands in bin k despite float rounding
# the ViT parameters on the path from pixels to the output tokens; the rest (pooling, head) never sees a corrupted
# token, so it is frozen during MPP: no gradient to wait for under DDP, no weight decay pulling at it
TOKEN_PATH = ("patch_embed.", "cls_token", "pos_embed", "blocks.", "norm.")


# ---------------------------------------------------------------------------------------------- corruption
def draw_corruption(
    batch: int,
    num_patches: int,
    cfg: MPPConfig,
    device: torch.device | str = "cpu",
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kind (B, N) long: KEPT / MASKED / REPLACED / UNCHANGED, source (B, N) long: the patch whose embedding a
    REPLACED patch takes, never itself). Draws from ``generator`` (default: torch's global RNG)."""
    B, N = batch, num_patches
    count = min(N, max(1, int(cfg.mask_ratio * N + 0.5)))  # round half up, at least one patch per image
    order = torch.rand(B, N, device=device, generator=generator).argsort(dim=1)
    chosen = torch.zeros(B, N, dtype=torch.bool, device=device).scatter_(1, order[:, :count], True)
    u = torch.rand(B, N, device=device, generator=generator)
    kind = torch.full((B, N), UNCHANGED, dtype=torch.long, device=device)
    kind[u < cfg.mask_share + cfg.random_share] = REPLACED
    kind[u < cfg.mask_share] = MASKED
    kind[~chosen] = KEPT
    if N > 1:  # an offset in 1..N-1: uniform over the other patches
        offset = torch.randint(1, N, (B, N), device=device, generator=generator)
    else:
        offset = torch.zeros(B, N, dtype=torch.long, device=device)
    source = (torch.arange(N, device=device) + offset) % N
    return kind, source


def corrupt(tokens: torch.Tensor, kind: torch.Tensor, source: torch.Tensor, mask_token: torch.Tensor) -> torch.Tensor:
    """Patch embeddings (B, N, D), MASKED ones replaced by mask_token (D,), REPLACED ones by their source's."""
    other = tokens.gather(1, source[..., None].expand(-1, -1, tokens.shape[-1]))  # (B, N, D)
    out = torch.where((kind == REPLACED)[..., None], other, tokens)
    return torch.where((kind == MASKED)[..., None], mask_token.to(out.dtype).expand_as(out), out)


# ------------------------------------------------------------------------------------------------- targets
def colour_classes(pixels: torch.Tensor, bits: int) -> torch.Tensor:
    """Pixels in [0, 1] (..., C, h, w) -> the class of their mean colour (...,): each channel's mean quantised to
    ``bits`` bits, channel 0 the most significant digit (2^(bits x C) classes)."""
    levels = 2**bits
    mean = pixels.float().mean(dim=(-2, -1))  # (..., C)
    bins = torch.floor(mean * levels + BIN_EPS).clamp(0, levels - 1).long()
    weights = levels ** torch.arange(mean.shape[-1] - 1, -1, -1, device=pixels.device)  # (C,)
    return (bins * weights).sum(dim=-1)


def grid_cells(patches: torch.Tensor, grid: int) -> torch.Tensor:
    """(..., C, ph, pw) -> (..., grid * grid, C, ph / grid, pw / grid): the cells of each patch, row-major."""
    *lead, C, ph, pw = patches.shape
    x = patches.reshape(*lead, C, grid, ph // grid, grid, pw // grid)
    n = len(lead)
    x = x.permute(*range(n), n + 1, n + 3, n, n + 2, n + 4)  # (..., grid, grid, C, ph/grid, pw/grid)
    return x.reshape(*lead, grid * grid, C, ph // grid, pw // grid)


def num_classes(cfg: MPPConfig, in_chans: int) -> int:
    """Colour classes per prediction: 2^(bits x channels)."""
    return 2 ** (cfg.bits * in_chans)


def output_dim(cfg: MPPConfig, in_chans: int, patch: tuple[int, int]) -> int:
    """Head outputs per corrupted patch: K classes, grid^2 x K, or the patch's C x ph x pw pixels."""
    if cfg.target == "color":
        return num_classes(cfg, in_chans)
    if cfg.target == "color_grid":
        return cfg.grid**2 * num_classes(cfg, in_chans)
    return in_chans * patch[0] * patch[1]


class Targets:
    """What each patch of a batch of normalised images should be predicted as, for one MPPConfig."""

    def __init__(self, cfg: MPPConfig, mean: list[float], std: list[float], patch: tuple[int, int]) -> None:
        self.cfg, self.patch = cfg, patch
        self.mean, self.std = list(mean), list(std)  # per channel, [0, 1] pixel units

    def colours(self, patches: torch.Tensor) -> torch.Tensor:
        """Normalised patches (..., C, ph, pw) -> colour classes: (...,) for color and pixels, (..., grid^2) for
        color_grid."""
        pixels = unnormalise(patches, self.mean, self.std)
        if self.cfg.target == "color_grid":
            pixels = grid_cells(pixels, self.cfg.grid)
        return colour_classes(pixels, self.cfg.bits)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """Normalised images (B, C, H, W) -> targets (B, N) long (color), (B, N, grid^2) long (color_grid) or
        (B, N, C x ph x pw) float (pixels)."""
        patches = patches_of(images, self.patch)
        if self.cfg.target == "pixels":
            return patches.float().flatten(2)
        return self.colours(patches)


# --------------------------------------------------------------------------------------------------- model
class MPPHead(nn.Module):
    """The pretraining-only parameters: the learned [mask] embedding and the Linear on the output tokens."""

    def __init__(self, width: int, out_dim: int) -> None:
        super().__init__()
        self.mask_token = nn.Parameter(torch.zeros(width))  # (D,)
        self.head = zero_head(width, out_dim)  # like the ViT's head: uniform predictions at the start
        nn.init.normal_(self.mask_token, std=0.02)  # as BERT and the ViT's own learned embeddings start


class MPPModel(nn.Module):
    """A VisionTransformer (``vit``, used only through its public pieces, so its weights are a plain ViT's) with
    corruption of its patch embeddings and an MPP head (``mpp``). ``forward(images)`` -> (predictions (M, out) for
    the M corrupted patches in row-major (image, patch) order, kind (B, N))."""

    def __init__(self, vit: nn.Module, cfg: MPPConfig) -> None:
        super().__init__()
        if not isinstance(vit, VisionTransformer):
            arch = getattr(getattr(vit, "config", None), "arch", type(vit).__name__)
            raise UserError(f"run.objective=mpp: needs a ViT, got a {arch!r} model")
        vcfg = vit.config
        self.patch = vcfg.stride  # input pixels per token, hybrids included
        h, w = as_pair("ViTConfig", "img_size", vcfg.img_size)
        if tuple(vit.grid) != (h // self.patch[0], w // self.patch[1]):
            raise UserError(
                f"run.objective=mpp: the {vit.grid} token grid does not tile the {vcfg.img_size} image in "
                f"{self.patch} pixel patches, so a token has no patch of pixels to predict"
            )
        if cfg.target == "color_grid" and (self.patch[0] % cfg.grid or self.patch[1] % cfg.grid):
            raise UserError(f"mpp.grid={cfg.grid}: does not divide the {self.patch} pixel patches (target color_grid)")
        if cfg.random_share > 0 and vit.grid[0] * vit.grid[1] < 2:
            raise UserError("mpp.random_share > 0 needs at least two patches per image to replace one by another")
        self.vit: VisionTransformer = vit
        self.cfg = cfg
        self.mpp = MPPHead(vcfg.width, output_dim(cfg, vcfg.in_chans, self.patch))
        for name, p in vit.named_parameters():
            if not name.startswith(TOKEN_PATH):
                p.requires_grad_(False)

    def forward(
        self, images: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        vit = self.vit
        tokens, grid = vit.patch_embed(images)  # (B, N, D), before the position embedding
        kind, source = draw_corruption(tokens.shape[0], tokens.shape[1], self.cfg, tokens.device, generator)
        tokens = corrupt(tokens, kind, source, self.mpp.mask_token)
        encoded = vit.encode(vit.embed_tokens(tokens, grid), grid=grid)  # (B, prefix + N, D), final-normed
        patches = encoded[:, vit.num_prefix_tokens :]  # (B, N, D): the class token is never a target
        return self.mpp.head(patches[kind != KEPT]), kind

    def no_weight_decay(self) -> set[str]:
        return {f"vit.{n}" for n in self.vit.no_weight_decay()} | {"mpp.mask_token"}


class MaskedPatchPrediction:
    """The training objective of run.objective=mpp (what an objective does: objectives.py)."""

    def __init__(self, cfg: MPPConfig, info: DatasetInfo, seed: int = 0) -> None:
        self.cfg, self.info, self.seed = cfg, info, seed
        self.targets: Targets | None = None

    def wrap(self, vit: nn.Module) -> MPPModel:
        model = MPPModel(vit, self.cfg)
        self.targets = Targets(self.cfg, self.info.mean, self.info.std, model.patch)
        return model

    def outputs(
        self, model: nn.Module, images: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(predictions (M, out), their targets, kind (B, N)) for a batch; model may be wrapped (DDP, compile)."""
        assert self.targets is not None, "wrap() the model first"
        pred, kind = model(images, generator) if generator is not None else model(images)
        return pred, self.targets(images)[kind != KEPT], kind

    def criterion(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over corrupted patches (and grid cells), or their mean squared error (pixels)."""
        pred = pred.float()
        if self.cfg.target == "pixels":
            return F.mse_loss(pred, target)
        if self.cfg.target == "color_grid":
            pred = pred.reshape(-1, num_classes(self.cfg, self.info.in_chans))  # (M x grid^2, K)
            target = target.reshape(-1)
        return F.cross_entropy(pred, target)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """The MPP loss of a batch (labels y are ignored); corruption draws from torch's global RNG, which the
        engine seeds per (seed, step, micro-batch, rank)."""
        pred, target, _ = self.outputs(model, x)
        return self.criterion(pred, target)

    def correct(self, pred: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
        """(right, total) colour predictions: classes, grid cells, or the regressed patches' mean colours."""
        assert self.targets is not None
        if self.cfg.target == "pixels":
            shape = (-1, self.info.in_chans, *self.targets.patch)
            hit = self.targets.colours(pred.float().reshape(shape)) == self.targets.colours(target.reshape(shape))
        elif self.cfg.target == "color_grid":
            hit = pred.reshape(*target.shape, -1).argmax(dim=-1) == target
        else:
            hit = pred.argmax(dim=-1) == target
        return int(hit.sum()), hit.numel()

    def evaluate(
        self,
        model: nn.Module,
        dataset: Dataset[Any],
        device: torch.device | str = "cpu",
        batch_size: int = 512,
        amp: str = "none",
        num_workers: int = 0,
    ) -> dict[str, float]:
        """Mean MPP loss (per corrupted patch) and colour accuracy on dataset, under one fixed corruption per run
        (a generator seeded by the run's seed), so that evaluations at different steps score the same task."""
        generator = torch.Generator(device=device).manual_seed(mix_seed(self.seed, 0x3E7A1))
        loss_sum, right, total, patches, images = 0.0, 0, 0, 0, 0
        with evaluating(model):
            for x, _ in batches(dataset, batch_size, device, num_workers=num_workers):
                with autocast(x.device, amp):
                    pred, target, _ = self.outputs(model, x, generator)
                loss_sum += float(self.criterion(pred, target)) * len(pred)
                r, t = self.correct(pred, target)
                right, total, patches, images = right + r, total + t, patches + len(pred), images + len(x)
        return {"eval_mpp_loss": loss_sum / patches, "eval_mpp_acc": right / total, "eval_images": images}

    def export(self, model: nn.Module) -> tuple[nn.Module, dict[str, torch.Tensor], dict[str, Any]]:
        """(the ViT the run saves, the MPP head's tensors under ``mpp.``, metadata telling loaders to drop them)."""
        assert isinstance(model, MPPModel), "export() takes the model wrap() made"
        extra = {f"{MPP_PREFIX}{k}": v for k, v in model.mpp.state_dict().items()}
        meta = {"objective": "mpp", "mpp": asdict(self.cfg), "drop_on_load": [MPP_PREFIX]}
        return model.vit, extra, meta
