"""Layer-wise learning-rate decay (optim.layer_decay) for fine-tuning."""

from __future__ import annotations

import pytest

from vitkit import BiT, UserError, VisionTransformer
from vitkit.train import config_from_dict
from vitkit.train.optim import build_optimizer, param_groups, set_lr


def test_each_groups_lr_is_the_decay_to_the_power_of_its_distance_from_the_head():
    model = VisionTransformer(img_size=16, patch_size=8, width=32, depth=3, num_heads=2, mlp_dim=64, num_classes=4)
    cfg = config_from_dict({}, ["optim.name=sgd", "optim.lr=0.1", "optim.layer_decay=0.5"]).optim
    optimizer = build_optimizer(model, cfg)
    set_lr(optimizer, 0.1)
    lr_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    expected = {  # depth 3: embeddings 0.5^4, block i 0.5^(3 - i), what reads the last block 0.5^0
        "patch_embed.proj.weight": 0.1 * 0.5**4,
        "cls_token": 0.1 * 0.5**4,
        "pos_embed": 0.1 * 0.5**4,
        "blocks.0.attn.qkv.weight": 0.1 * 0.5**3,
        "blocks.1.mlp.fc1.bias": 0.1 * 0.5**2,
        "blocks.2.norm1.weight": 0.1 * 0.5**1,
        "norm.weight": 0.1,
        "head.weight": 0.1,
    }
    params = dict(model.named_parameters())
    for name, lr in expected.items():
        assert lr_of[id(params[name])] == pytest.approx(lr), name
    # weight decay still skips biases, norms and embeddings, within every depth
    groups = param_groups(model, 0.05, 0.5)
    for g in groups:
        names = [n for n, p in model.named_parameters() if any(p is q for q in g["params"])]
        decayed = {n for n in names if params[n].ndim >= 2 and n not in model.no_weight_decay()}
        assert (g["weight_decay"] > 0) == bool(decayed) and (not decayed or decayed == set(names))
    assert sum(len(g["params"]) for g in groups) == len(params)


def test_off_by_default_and_checked():
    model = VisionTransformer(img_size=16, patch_size=8, width=32, depth=2, num_heads=2, mlp_dim=64)
    assert [g["lr_scale"] for g in param_groups(model, 0.05)] == [1.0, 1.0]
    with pytest.raises(UserError, match=r"optim.layer_decay=1.5: expected a factor in \(0, 1\]"):
        config_from_dict({}, ["optim.layer_decay=1.5"])
    with pytest.raises(UserError, match="needs a ViT"):
        param_groups(BiT(layers=(1,), num_classes=2), 0.0, 0.5)
