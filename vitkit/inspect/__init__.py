"""Looking inside a ViT (paper sec 4.5): ``attention`` and ``embeddings`` return arrays, ``figures`` draws them as
the paper does, ``report.write_inspection`` writes them all for a model and a few images."""

from .attention import (
    AttentionRecord,
    attention_distance,
    attention_maps,
    attention_rollout,
    mean_attention_distance,
    probe_attention,
    query_attention,
    record_attention,
    rollout_map,
    token_distances,
    untrained_layers,
    upsample_map,
)
from .embeddings import patch_filter_components, position_embedding_grid, position_similarity
from .report import InspectionImage, write_inspection

__all__ = [
    "AttentionRecord",
    "InspectionImage",
    "attention_distance",
    "attention_maps",
    "attention_rollout",
    "mean_attention_distance",
    "patch_filter_components",
    "position_embedding_grid",
    "position_similarity",
    "probe_attention",
    "query_attention",
    "record_attention",
    "rollout_map",
    "token_distances",
    "untrained_layers",
    "upsample_map",
    "write_inspection",
]
