"""Reading and writing checkpoints: official .npz, Big Transfer .npz, Hugging Face, timm and vitkit's own format. One
module per format (``detect``, ``read`` into a base.Checkpoint, a writer where vitkit exports it); loader.py reads any
of them, loads strictly with a report and converts. The public names are in vitkit.hub.
"""

from .base import Checkpoint, read_npz
from .hf import to_hf_model, vitkit_to_hf
from .loader import LoadReport, convert, detect_format, read_checkpoint, read_into, read_model
from .native import read_native, save_pretrained
from .official import infer_official_config, official_to_vitkit, vitkit_to_official
from .timm import timm_kwargs, vitkit_to_timm

__all__ = [
    "Checkpoint",
    "LoadReport",
    "convert",
    "detect_format",
    "infer_official_config",
    "official_to_vitkit",
    "read_checkpoint",
    "read_into",
    "read_model",
    "read_native",
    "read_npz",
    "save_pretrained",
    "timm_kwargs",
    "to_hf_model",
    "vitkit_to_hf",
    "vitkit_to_official",
    "vitkit_to_timm",
]
