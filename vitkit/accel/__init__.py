"""Optional speed, attached from outside: faster modules swapped into a built model, its state dict unchanged.

Two calls: ``optimize_for_inference(model, precision)`` (inference.py) and ``optimize_for_training(model)``
(training.py). What they swap in lives beside them, one idea a module: cpu.py (oneDNN matmuls and the fused GELU-MLP),
kernels.py (compiled GELU), int8.py, first_token.py (a class-token model's last block for the class token alone),
tome.py (token merging, asked for by ``token_merge``). vitkit.models never imports this package.
"""

from .inference import optimize_for_inference
from .training import optimize_for_training

__all__ = ["optimize_for_inference", "optimize_for_training"]
