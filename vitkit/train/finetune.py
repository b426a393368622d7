"""Fine-tuning initialisation (``run.init_from``): the paper's recipe for starting from a pretrained model.

Load every weight a checkpoint in any supported format holds (vitkit.checkpoint.load_pretrained: official .npz,
Hugging Face, timm, vitkit), with the position embeddings resampled to the configured resolution (sec 3.2);
then replace the whole head by one zero-initialised Dense for the new classes, dropping the pre-logits
layer (sec 3.1). Anything else that does not fit (another width, depth, patch size) is an error.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from ..errors import UserError


def init_from_checkpoint(model: nn.Module, path: str | Path, num_classes: int) -> str:
    """Load path into model for fine-tuning; returns a one-paragraph report of what was adapted."""
    from ..checkpoint.loader import load_pretrained

    try:
        report = load_pretrained(model, path)  # strict: weights that do not fit are an error listing them
    except UserError as e:
        raise type(e)(f"run.init_from: {e} (model.name and its fields describe the model to fine-tune)") from None
    if hasattr(model, "reset_classifier"):
        model.reset_classifier(num_classes)  # a zero head, no pre-logits: the paper's fine-tuning head
    lines = [line.strip() for line in str(report).splitlines()]
    return "; ".join([*lines, f"head: a zero-initialised one for {num_classes} classes, no pre-logits"])
