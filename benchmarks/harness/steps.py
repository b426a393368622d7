"""The timed units: an inference forward, or forward + cross-entropy + backward + AdamW step.

``make_step`` runs a model as it is given (a peer, or vitkit's model as built); ``vitkit_step`` first gives vitkit's
model its documented switch, the one a user asks for: ``optimize_for_inference(model, precision, compile=...)`` for
fp32, bf16 and int8 inference, ``optimize_for_training(model)`` for a training step. bf16-autocast inference has no
switch of vitkit's (optimize_for_inference casts the weights instead), so there vitkit's model runs as built, as the
peers do. ``peer_step`` runs a peer as built, or for int8 under the peers' own switch (quantize_dynamic).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vitkit.accel.first_token import applies as first_token_applies
from vitkit.accel.inference import compile_for_inference, optimize_for_inference
from vitkit.accel.training import optimize_for_training
from vitkit.device import autocast
from vitkit.models import MODELS, BiTConfig, ResNetConfig, ViTConfig, create_model
from vitkit.models.registry import unknown_model

from .config import BenchConfig
from .switches import peer_switch


def build_model(cfg: BenchConfig, device: torch.device) -> nn.Module:
    """The registered model with random weights; the zero-initialised head gets random weights too, so that
    output parity checks compare informative logits rather than zeros."""
    if cfg.model not in MODELS:
        raise unknown_model(cfg.model)  # a did-you-mean
    torch.manual_seed(0)
    attn = {"attn_impl": cfg.attn} if MODELS[cfg.model]["arch"] == "vit" else {}
    model = create_model(cfg.model, img_size=cfg.img_size, **attn, **cfg.overrides)
    head = getattr(model, "head", None)
    if isinstance(head, nn.Linear):
        nn.init.normal_(head.weight, std=0.02)
    return model.to(device=device, dtype=cfg.param_dtype)


def inputs_and_classes(model: nn.Module) -> tuple[int, int]:
    """(input channels, classes) of a registered model, from its config."""
    config = model.config
    assert isinstance(config, (ViTConfig, ResNetConfig, BiTConfig)), f"not a registered model: {type(model)}"
    return config.in_chans, max(config.num_classes, 1)


def bench_autocast(cfg: BenchConfig, device: torch.device) -> contextlib.AbstractContextManager[object]:
    return autocast(device, "bf16" if cfg.dtype == "bf16-autocast" else "none")


def has_switch(cfg: BenchConfig) -> bool:
    """Whether vitkit_step gives vitkit's model a switch for cfg (every setting but bf16-autocast inference)."""
    return not (cfg.mode == "infer" and cfg.dtype == "bf16-autocast")


def executes_first_token(model: nn.Module, cfg: BenchConfig) -> bool:
    """Whether vitkit_step's model computes the class token alone in its last block (vitkit.accel.first_token),
    which changes the FLOPs it executes (vitkit.models.flops)."""
    return has_switch(cfg) and first_token_applies(model)


def _forward_fn(model: nn.Module, cfg: BenchConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """The forward a step calls: the model, or its compiled form (with freezing for inference)."""
    if cfg.compile == "none":
        return model
    if cfg.mode == "infer":
        return compile_for_inference(model, cfg.compile)
    return torch.compile(model, mode=cfg.compile)


def make_step(
    model: nn.Module, cfg: BenchConfig, x: torch.Tensor, y: torch.Tensor, device: torch.device
) -> Callable[[], torch.Tensor]:
    """One timed unit of model as it is: an inference forward, or forward + cross-entropy + backward + AdamW step."""
    forward = _forward_fn(model, cfg)
    if cfg.mode == "infer":
        model.eval()

        def infer() -> torch.Tensor:
            with torch.no_grad(), bench_autocast(cfg, device):
                return forward(x)

        return infer
    model.train()
    # the fused kernel on the CPU too, for every library alike: unfused, AdamW's many small kernels take a large
    # share of a small model's step
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type in ("cpu", "cuda"))

    def train() -> torch.Tensor:
        if cfg.compile == "reduce-overhead":  # a new step: the CUDA graphs' last outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        with bench_autocast(cfg, device):
            loss = F.cross_entropy(forward(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return train


def vitkit_step(
    model: nn.Module, cfg: BenchConfig, x: torch.Tensor, y: torch.Tensor, device: torch.device
) -> Callable[[], torch.Tensor]:
    """make_step of vitkit's model under its documented switch (the module docstring). Inference converts the model
    in place as optimize_for_inference does (eval, frozen, cast to the precision it resolves)."""
    if not has_switch(cfg):
        return make_step(model, cfg, x, y, device)
    if cfg.mode == "train":
        return make_step(optimize_for_training(model), cfg, x, y, device)
    precision = cfg.dtype if cfg.dtype in ("bf16", "int8") else "fp32"
    fast = optimize_for_inference(model, precision, compile=cfg.compile)
    if cfg.attn != "auto":  # the attention path asked for, rather than the switch's own pick for the precision
        fast.call_kwargs = {"attn_impl": cfg.attn}

    def infer() -> torch.Tensor:
        return fast(x)

    return infer


def peer_step(
    model: nn.Module, cfg: BenchConfig, x: torch.Tensor, y: torch.Tensor, device: torch.device
) -> Callable[[], torch.Tensor]:
    """make_step of a peer: as built, but for int8 under the peers' documented switch (switches.peer_switch:
    quantize_dynamic), which runs eagerly whatever cfg.compile says, as it cannot be compiled."""
    if cfg.dtype != "int8":
        return make_step(model, cfg, x, y, device)
    return make_step(peer_switch(model, "int8", "none"), replace(cfg, compile="none"), x, y, device)


def onnx_step(model: nn.Module, cfg: BenchConfig, x: torch.Tensor, workdir: Path) -> Callable[[], Any]:
    """An onnxruntime session over the model exported with a dynamic batch axis (fp32 inference only)."""
    from vitkit.export import export_onnx, onnx_session

    path = export_onnx(model, workdir / "model.onnx", img_size=cfg.img_size)
    session = onnx_session(path)
    feed = {session.get_inputs()[0].name: x.float().cpu().numpy()}
    return lambda: session.run(None, feed)[0]
