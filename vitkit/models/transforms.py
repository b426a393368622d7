"""Where vitkit's own autograd functions give way to torch's ops.

In training on a CPU some of the model's work runs in autograd functions of vitkit's own: the Dense layers' oneDNN
matmuls (linear.py), the tanh-GELU kernels (gelu.py), and the written-out attention's chunks and one-row products
(attention.py), each the function of the torch ops it stands for. They define a backward pass, and nothing for the
machinery that looks through the ops themselves: torch.jit tracing, torch.func's transforms (grad, vmap, jvp, ...)
and forward-mode AD (``torch.autograd.forward_ad``'s dual tensors). There they give way to the torch ops, so that a
model computes the same there as anywhere else. Their backward passes do the same where the backward pass itself is
transformed: ``torch.autograd.grad(..., is_grads_batched=True)`` (and so ``torch.autograd.functional.jacobian(...,
vectorize=True)``) runs it under a vmap.
"""

from __future__ import annotations

import torch
from torch.autograd import forward_ad


def transformed() -> bool:
    """Whether torch.jit is tracing, a torch.func transform is active or forward-mode AD is in use (inside
    ``forward_ad.dual_level()``): there vitkit's own autograd functions give way to torch's ops."""
    return (
        torch.jit.is_tracing()
        or torch._C._are_functorch_transforms_active()
        or forward_ad._current_level >= 0  # the dual level entered, -1 outside one
    )


def transformed_backward(grad: torch.Tensor) -> bool:
    """Whether a backward pass receiving ``grad`` runs transformed: ``transformed()``, or ``grad`` batched by
    ``is_grads_batched`` (torch.autograd.grad's vmap, the legacy one, which ``transformed`` does not see)."""
    return transformed() or torch._C._functorch.is_legacy_batchedtensor(grad)
