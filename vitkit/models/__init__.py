from .bit import BiT, BiTConfig
from .common import count_params
from .posemb import resample_pos_embed, sincos_2d
from .registry import MODELS, create_model, list_models, model_from_config
from .resnet import ResNet, ResNetBackbone, ResNetConfig
from .vit import VisionTransformer, ViTConfig

__all__ = [
    "MODELS",
    "BiT",
    "BiTConfig",
    "ResNet",
    "ResNetBackbone",
    "ResNetConfig",
    "ViTConfig",
    "VisionTransformer",
    "count_params",
    "create_model",
    "list_models",
    "model_from_config",
    "resample_pos_embed",
    "sincos_2d",
]
