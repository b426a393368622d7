"""int8 inference on a CPU: every nn.Linear of a frozen copy in int8, weights per output channel, activations per
token, products summed exactly in int32.

With 8-bit dot products (VNNI) the layers are ``Int8Linear`` (oneDNN's int8 matmul on weights packed once, written
so that torch.compile fuses the quantisation around it); without, fbgemm's dynamic kernels through torch's dynamic
quantisation. Attention has no int8 kernel: where bf16 matmuls are native it is computed in bf16, written out
(``Bf16Attention``). int8 changes predictions more than bf16 does, so it is only ever asked for.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from ..device import bf16_is_fast, cpu_has_vnni
from ..errors import UserError
from ..models.vit import Attention, Probs
from .cpu import _copy_sharing_packed, _plain_linear


class Bf16Attention(Attention):
    """Attention in bf16, written out whatever path is asked for: q, k, v and the logit bias cast to bf16, the output
    (and the probabilities handed to ``attention``) cast back; where bf16 matmuls are native, the fastest on a CPU."""

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, explicit: bool, attention: Probs = None
    ) -> Tensor:
        dtype = q.dtype
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
        bias = None if bias is None else bias.to(torch.bfloat16)
        probs: Probs = None if attention is None else []
        out = super().attend(q, k, v, bias, True, probs)
        if attention is not None and probs:
            attention.append(probs[0].to(dtype))
        return out.to(dtype)


INT8_KERNELS = ("auto", "onednn", "fbgemm")
_EPS = float(torch.finfo(torch.float32).tiny)


class Int8Linear(nn.Module):
    """An nn.Linear for inference in int8: ``y = (q(x) @ q(W)^T) * s_x * s_w + b``. Weights symmetric int8 per output
    channel (``s_w = max|W_o,:| / 127``), activations per token at each call (``s_x = max|x_t| / 127``), so a token's
    rounding follows its own range. oneDNN's int8 matmul on the weight packed once sums exactly in int32, the
    activations shifted by 128 to the unsigned bytes its VNNI kernels take. Plain tensor ops around that one call, so
    torch.compile fuses the quantisation and rescale into their neighbours."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        _require_vnni()
        w = linear.weight.detach().float()
        scale = w.abs().amax(1).clamp_min(_EPS) / 127
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # an opaque oneDNN tensor, kept out of state_dict and .to() (as PackedLinear's): int8 models are not saved
        self.packed_weight = torch.ops.onednn.qlinear_prepack((w / scale[:, None]).round().to(torch.int8), None)
        self.weight_scale: torch.Tensor
        self.register_buffer("weight_scale", scale)
        self.weight_zero_point: torch.Tensor
        self.register_buffer("weight_zero_point", torch.zeros(self.out_features, dtype=torch.int32), persistent=False)
        self.bias: torch.Tensor | None
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        scale = rows.abs().amax(1, keepdim=True).clamp_min(_EPS) / 127  # (tokens, 1)
        unsigned = ((rows / scale).round() + 128).to(torch.uint8)  # q(x) + 128: exact, q(x) is in [-127, 127]
        y = self.products(unsigned) * scale
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def products(self, unsigned: torch.Tensor) -> torch.Tensor:
        """(q(x) @ q(W)^T) * s_w from the quantised rows shifted to unsigned bytes, q(x) + 128 (tokens, in): the one
        library call, summed in int32 by oneDNN."""
        return torch.ops.onednn.qlinear_pointwise(
            *(unsigned, 1.0, 128, self.packed_weight, self.weight_scale, self.weight_zero_point),
            *(None, 1.0, 0, torch.float32, "none", [None], ""),
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Module:
        return _copy_sharing_packed(self, memo)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _has_vnni_layer() -> bool:
    """Whether Int8Linear runs here: oneDNN present and 8-bit dot products (VNNI) in the CPU."""
    return cpu_has_vnni() and torch.backends.mkldnn.is_available()


def _require_vnni() -> None:
    """Int8Linear's products are exact only with 8-bit dot products (VNNI): without them oneDNN multiplies unsigned
    by signed bytes with vpmaddubsw, whose int16 pair sums saturate (255 x 127 x 2 > 32767), so the layer refuses."""
    if not _has_vnni_layer():
        raise UserError(
            "int8 kernel 'onednn' (Int8Linear): this CPU has no VNNI, where its unsigned x signed byte products would "
            "saturate; use the 'fbgemm' kernel (what 'auto' picks here)"
        )


def int8_kernel(kernel: str = "auto") -> str:
    """The int8 path for this CPU: "onednn" (Int8Linear) with 8-bit dot products (VNNI), else "fbgemm", whose 7-bit
    activations cannot saturate where oneDNN's unsigned x signed products would (_require_vnni)."""
    if kernel not in INT8_KERNELS:
        raise UserError(f"int8 kernel {kernel!r}: expected one of {INT8_KERNELS}")
    if kernel == "auto":
        return "onednn" if _has_vnni_layer() else "fbgemm"
    if kernel == "onednn":
        _require_vnni()
    return kernel


def quantize_int8(model: nn.Module, kernel: str = "auto") -> nn.Module:
    """A frozen copy of an fp32 model whose nn.Linear layers run in int8; the model is untouched.

    ``kernel`` "onednn" (where the CPU has VNNI): every nn.Linear becomes an Int8Linear, and where bf16 matmuls are
    native the attention computes in bf16 (Bf16Attention). "fbgemm" (elsewhere): torch's dynamic quantisation, 7-bit
    activations from the whole input's range, run eagerly (torch.compile cannot trace it). A Linear layer with hooks
    of its own stays in fp32 (its replacement would not run them); other layers keep copies of their fp32 weights."""
    kernel = int8_kernel(kernel)
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise UserError("int8: quantise an fp32 model (this one has other parameter dtypes)")
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise UserError("int8: the int8 kernels run on the CPU only; move the model with .cpu() first")
    frozen = copy.deepcopy(model).eval().requires_grad_(False)
    if kernel == "onednn":
        attend_in_bf16 = bf16_is_fast(torch.device("cpu"))
        for parent in list(frozen.modules()):
            if attend_in_bf16 and type(parent) is Attention:
                parent.__class__ = Bf16Attention
            for name, child in parent.named_children():
                if _plain_linear(child):
                    setattr(parent, name, Int8Linear(child))
        return frozen
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    # torch.ao.quantization.quantize_dynamic is deprecated in favour of torchao, a separate package, yet in torch it is
    # still the only public route to fbgemm's dynamic int8 linear kernels: its deprecation warnings are silenced here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*(torch\.ao\.quantization|quantized tensor).*deprecated")
        warnings.filterwarnings("ignore", message=r"torch\.quantize_per_\w+.* are deprecated", category=UserWarning)
        plain = {name: per_channel_dynamic_qconfig for name, m in frozen.named_modules() if _plain_linear(m)}
        return quantize_dynamic(frozen, plain, dtype=torch.qint8, inplace=True)  # by name: hooked layers stay
