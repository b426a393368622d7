"""The peers timed beside vitkit, each built from vitkit's model with its weights, dtype and device: transformers'
ViTForImageClassification and timm's VisionTransformer. They live here, beside the scripts, not in the vitkit
package: timm imports torchvision, which vitkit does not depend on."""

from __future__ import annotations

import torch
from torch import nn

from vitkit.checkpoint.timm import timm_kwargs, vitkit_to_timm

PEER_NAMES = {"hf": "transformers", "timm": "timm", "onnx": "onnxruntime"}
# what vitkit.optional.require checks for a peer (timm is no extra of vitkit's: the scripts look for it themselves)
PEER_MODULES = {"hf": ("transformers",), "onnx": ("onnx", "onnxscript", "onnxruntime")}


class Logits(nn.Module):
    """transformers' models return an output object; the benchmark wants the logits tensor."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.hf(pixel_values=x).logits


def hf_peer(model: nn.Module) -> nn.Module:
    """transformers' ViTForImageClassification with the same weights, dtype and device, on its SDPA attention."""
    from vitkit.checkpoint.hf import to_hf_model

    hf = to_hf_model(model)
    hf.set_attn_implementation("sdpa")  # transformers' fastest attention on CPU and a match for ours on CUDA
    return Logits(hf)


def timm_peer(model: nn.Module) -> nn.Module:
    """timm's VisionTransformer with vitkit's weights, dtype and device."""
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    ref = next(model.parameters())
    peer = TimmViT(**timm_kwargs(model))
    peer.load_state_dict(vitkit_to_timm(model))
    return peer.to(device=ref.device, dtype=ref.dtype)
