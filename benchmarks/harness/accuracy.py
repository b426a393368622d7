"""What each inference switch costs in accuracy: top-1 agreement with fp32 and logit error, on held-out images of a
trained digits model and of an official-format ViT-S/16 (benchmarks/speed_targets.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from .parity import batched_logits, logit_agreement
from .switches import peer_switch, vitkit_switch


def switch_accuracy(model: nn.Module, images: torch.Tensor, precisions: list[str]) -> dict[str, dict]:
    """Each switch (vitkit's, and the peers' documented int8 applied to the same model) against fp32 on the same
    images, in batches of 64."""
    model = model.eval()
    want = batched_logits(model, images)

    def against_fp32(fn: Callable[[torch.Tensor], Any]) -> dict[str, float]:
        return logit_agreement(want, batched_logits(fn, images))

    out = {f"vitkit {p}": against_fp32(vitkit_switch(model, p, "none")) for p in precisions}
    if "int8" in precisions:  # the peers' switch: per-tensor weights, activations over half the 8-bit range
        out["peers' int8 (quantize_dynamic)"] = against_fp32(peer_switch(model, "int8", "none"))
    return out


def accuracy_lines(accuracy: dict[str, dict[str, dict]]) -> list[str]:
    lines = ["accuracy cost of each switch against fp32 (logit errors relative to the largest |fp32 logit|):"]
    for label, per_switch in accuracy.items():
        lines.append(f"  {label}")
        for name, a in per_switch.items():
            lines.append(
                f"    {name:<31} top-1 agreement {a['top1_agreement']:.2%} of {a['n']} images, "
                f"logit error max {a['max_err']:.3g} mean {a['mean_err']:.3g} (|logit| up to {a['max_abs_logit']:.3g})"
            )
    return lines


def digits_model(run_dir: Path | None, workdir: Path) -> tuple[nn.Module, torch.Tensor, str]:
    """A trained digits model and its 360 held-out images: the given run, or a short run of the shipped config."""
    from dataclasses import replace

    from vitkit.data import build_datasets
    from vitkit.hub import load_model
    from vitkit.train import load_config, train

    cfg = load_config("digits", ["schedule.epochs=15", "run.progress=false", "run.plots=false", "run.eval_every=0"])
    threads = torch.get_num_threads()  # the digits config trains on one thread: restored for the timings
    if run_dir is None:
        cfg = replace(cfg, run=replace(cfg.run, out_dir=str(workdir), name="digits"))
        result = train(cfg)
        torch.set_num_threads(threads)
        run_dir = result.run_dir
        top1 = next((v for k, v in result.metrics.items() if "top1" in k or "top-1" in k), float("nan"))
        label = f"digits run trained here ({cfg.schedule.epochs:g} epochs, held-out top-1 {top1:.2%})"
    else:
        label = f"digits run {run_dir}"
    _, held_out, _ = build_datasets(cfg.data)
    return load_model(run_dir), held_out.images, label


def official_model(npz: Path | None, workdir: Path, held_out: torch.Tensor) -> tuple[nn.Module, torch.Tensor, str]:
    """An official-format ViT-S/16 read back through the .npz reader, and 128 held-out digits as 224px RGB."""
    from vitkit.checkpoint.official import vitkit_to_official
    from vitkit.hub import load_model
    from vitkit.models import create_model

    if npz is None:
        torch.manual_seed(0)
        source = create_model("vit_s16", num_classes=1000)
        nn.init.normal_(source.head.weight, std=0.02)  # the released heads are not zero
        npz = workdir / "vit_s16_random.npz"
        np.savez(npz, **vitkit_to_official(source))
        label = "official-format ViT-S/16, RANDOMLY INITIALISED (no released file here), written by vitkit_to_official"
    else:
        label = f"official checkpoint {npz}"
    model = load_model(npz)
    size = model.config.img_size
    size = size if isinstance(size, int) else size[0]
    x = held_out[:128]
    x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    x = x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x
    return model, (x * 2 - 1).contiguous() if x.min() >= 0 else x.contiguous(), label
