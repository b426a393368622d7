"""The house rules for vitkit.accel, checked from outside: optimize_for_training and optimize_for_inference leave the
model's state dict as it was (keys and tensors) and compute the plain model's function within the precision's
tolerance (against a float64 copy of the plain model); a training run is the plain model's; and what each swaps in
where, with nothing of vitkit.accel in a model as built."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vitkit.accel import cpu, optimize_for_inference, optimize_for_training
from vitkit.accel.cpu import MIN_SIDE, FusedMlp, OneDnnLinear, has_onednn, swap_for_training
from vitkit.accel.first_token import FirstTokenBlock, FirstTokenViT
from vitkit.accel.kernels import TanhGELU, swap_gelus
from vitkit.device import bf16_is_fast
from vitkit.models import VisionTransformer
from vitkit.models.vit import Mlp

# Dense layers of sides >= MIN_SIDE: vitkit.accel's CPU layers run in training (the head's 5 outputs stay nn.Linear)
BASE = dict(img_size=32, patch_size=8, width=MIN_SIDE, depth=2, num_heads=2, mlp_dim=2 * MIN_SIDE, num_classes=5)
CONFIGS = {
    "token": {},
    "gap": {"classifier": "gap"},
    "map": {"classifier": "map"},
    "relative": {"pos_embed": "relative"},
    "relative_2d": {"pos_embed": "relative_2d", "classifier": "first"},
    "learned_2d": {"pos_embed": "learned_2d"},
    "hybrid": {"resnet_layers": (), "patch_size": 2},
    "dropout": {"dropout": 0.1, "attn_dropout": 0.1, "drop_path": 0.1},  # compared in eval mode
}
PRECISIONS = [
    "fp32",
    "int8",
    pytest.param("bf16", marks=pytest.mark.skipif(not bf16_is_fast(torch.device("cpu")), reason="bf16 not native")),
]
ACCEL = "vitkit.accel"
onednn = pytest.mark.skipif(not has_onednn(), reason="oneDNN on x86 only")


def plain_vit(**overrides) -> VisionTransformer:
    """A ViT as built whose head, norms and class token are random (as built, the zero head gives zero logits)."""
    torch.manual_seed(0)
    model = VisionTransformer(**{**BASE, **overrides})
    with torch.no_grad():
        model.head.weight.normal_(std=0.5)
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.normal_(1, 0.2), m.bias.normal_(0, 0.2)
        if model.cls_token is not None:
            model.cls_token.normal_()
    return model


def snapshot(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each state-dict entry: the tensor itself and a copy of its values."""
    return {k: (v, v.detach().clone()) for k, v in model.state_dict().items()}


def assert_state_unchanged(model: nn.Module, before: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    after = model.state_dict()
    assert list(after) == list(before)
    for k, (tensor, values) in before.items():
        assert after[k] is tensor or after[k].data_ptr() == tensor.data_ptr(), k  # the same tensor, not a copy
        assert after[k].dtype == values.dtype and torch.equal(after[k], values), k


def float64_reference(model: nn.Module, x: torch.Tensor, training: bool) -> tuple[torch.Tensor, dict]:
    """The plain model's logits in float64 and every parameter's gradient of their squares' sum."""
    ref = copy.deepcopy(model).double().train(training)
    out = ref(x.double())
    out.square().sum().backward()
    return out.detach(), {n: p.grad for n, p in ref.named_parameters()}


def uses_accel(model: nn.Module) -> bool:
    return any(type(m).__module__.startswith(ACCEL) for m in model.modules())


def test_a_model_as_built_holds_stock_torch_layers_and_nothing_of_accel():
    for overrides in CONFIGS.values():
        model = plain_vit(**overrides)
        assert not uses_accel(model)
        layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.GELU))]
        assert layers and all(type(m) in (nn.Linear, nn.GELU) for m in layers)
        assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))


@pytest.mark.parametrize("name", CONFIGS)
def test_optimize_for_training_keeps_the_state_dict_and_the_function(name):
    model = plain_vit(**CONFIGS[name])
    training = "dropout" not in name  # dropout draws masks: compared in eval mode
    x = torch.randn(4, 3, 32, 32)
    want, want_grads = float64_reference(model, x, training)
    before = snapshot(model)
    assert optimize_for_training(model) is model
    assert_state_unchanged(model, before)
    assert uses_accel(model)
    got = model.train(training)(x)
    scale = float(want.abs().max())
    assert float((got.detach().double() - want).abs().max()) <= 1e-5 * scale
    got.double().square().sum().backward()
    for n, p in model.named_parameters():
        g = want_grads[n]
        assert p.grad is not None or not g.any(), n  # the last block's relative table: outside the class token's path
        if p.grad is not None:
            assert float((p.grad.double() - g).abs().max()) <= 1e-5 * max(float(g.abs().max()), 1e-6), n
    assert_state_unchanged(model, before)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", CONFIGS)
def test_optimize_for_inference_keeps_the_state_dict_and_the_function(name, precision):
    model = plain_vit(**CONFIGS[name])
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        want = copy.deepcopy(model).double().eval()(x.double())
    before = snapshot(model)
    fast = optimize_for_inference(model, precision, compile="none")
    assert fast.precision == precision and not uses_accel(model)
    if precision == "bf16":  # documented: the model itself is cast, as model.to(torch.bfloat16) would
        after = model.state_dict()
        assert list(after) == list(before)
        assert all(torch.equal(after[k], values.to(after[k].dtype)) for k, (_, values) in before.items())
    else:
        assert_state_unchanged(model, before)
    got = fast(x)
    assert got.dtype == torch.float32 and got.shape == want.shape
    err, scale = float((got.double() - want).abs().max()), float(want.abs().max())
    assert err <= {"fp32": 1e-5, "bf16": 5e-2, "int8": 0.1}[precision] * scale, err / scale
    if precision == "int8":
        assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.75


TRAIN = dict(img_size=32, patch_size=4, width=MIN_SIDE, depth=2, num_heads=2, mlp_dim=4 * MIN_SIDE, num_classes=5)


def train_vit(**overrides) -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(**{**TRAIN, **overrides})
    with torch.no_grad():
        model.head.weight.normal_(std=0.1)
    return model


def adamw_steps(model: nn.Module, steps: int = 3) -> dict[str, torch.Tensor]:
    """steps of AdamW on fixed batches in the model's dtype, dropout's masks from a fixed seed; the parameters after
    them, in float64."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(2)
    model.train()
    for _ in range(steps):
        # 32 images of 65 tokens: 2,080 rows a layer and 1.06M MLP activations, the sizes from which the oneDNN
        # layers pack their weights and the GELU runs its compiled kernels, fused with the MLP's second layer
        x, y = torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 5, (32,), generator=g)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x.to(dtype)), y).backward()
        opt.step()
    return {n: p.detach().double() for n, p in model.named_parameters()}


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The Euclidean distance between two models' parameters (the same names)."""
    assert a.keys() == b.keys()
    return float(sum((a[n] - b[n]).square().sum() for n in a)) ** 0.5


class Runs:
    """A model's parameters before training, after the plain model's run in float64 and in fp32. AdamW's steps
    divide each gradient by its running size, so an element whose gradient is near zero (or zero, as the key
    biases', where rounding leaves noise) steps by up to lr whatever its rounding: fp32 runs are compared by how
    far they land from the float64 run, against how far the plain fp32 run lands."""

    def __init__(self, plain: nn.Module) -> None:
        self.start = adamw_steps(copy.deepcopy(plain), steps=0)
        self.float64 = adamw_steps(copy.deepcopy(plain).double())
        self.fp32 = adamw_steps(copy.deepcopy(plain))
        self.rounding = distance(self.fp32, self.float64)
        assert self.rounding < 1e-2 * distance(self.fp32, self.start)  # the steps moved the weights far more

    def assert_as_close(self, run: dict[str, torch.Tensor]) -> None:
        assert distance(run, self.float64) <= 2 * self.rounding, (distance(run, self.float64), self.rounding)


@pytest.mark.parametrize(
    "overrides", [{}, {"classifier": "gap", "dropout": 0.1, "drop_path": 0.1}], ids=["token", "gap_dropout"]
)
def test_optimize_for_training_trains_as_the_plain_model(overrides, monkeypatch):
    """Three AdamW steps of the optimised model land as close to the plain model's float64 run as the plain fp32 run
    does (each gradient is the plain model's to fp32 rounding). With dropout: a gap head reads every token, and the
    swapped layers draw the plain model's masks in the plain model's order."""
    plain = train_vit(**overrides)
    runs = Runs(plain)
    model = optimize_for_training(copy.deepcopy(plain))
    assert isinstance(model, FirstTokenViT) == ("classifier" not in overrides)
    applied: list[str] = []
    for fn in (cpu._OneDnnLinear, cpu._GeluLinear):
        apply = fn.apply
        monkeypatch.setattr(fn, "apply", lambda *a, _f=fn, _apply=apply: applied.append(_f.__name__) or _apply(*a))
    runs.assert_as_close(adamw_steps(model))
    if has_onednn():  # the oneDNN layers ran, and without dropout in the MLP its GELU fused with its second layer
        assert "_OneDnnLinear" in applied and ("_GeluLinear" in applied) == ("dropout" not in overrides)


@onednn
def test_with_dropout_only_the_first_token_patch_changes_a_runs_masks():
    """A class-token model with dropout: its layers swapped for the CPU's (not the first-token patch) it trains as
    the plain model, the same masks drawn; with the first-token patch too (optimize_for_training) the last block
    draws masks for the class token alone, fewer and of other shapes, so the run is another draw of the masks."""
    plain = train_vit(dropout=0.1, attn_dropout=0.1, drop_path=0.1)
    runs = Runs(plain)
    swapped, optimised = copy.deepcopy(plain), copy.deepcopy(plain)
    swap_gelus(swapped)
    swap_for_training(swapped)
    optimize_for_training(optimised)
    assert isinstance(swapped.blocks[0].mlp, FusedMlp) and not isinstance(swapped, FirstTokenViT)
    runs.assert_as_close(adamw_steps(swapped))
    assert distance(adamw_steps(optimised), runs.fp32) > 10 * runs.rounding


@onednn
def test_what_optimize_for_training_swaps_in_on_a_cpu():
    model = plain_vit(classifier="map", mlp_dim=MIN_SIDE // 2)  # an MLP whose fc2 is narrower than MIN_SIDE
    optimize_for_training(model)
    linears = {n: type(m) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear):
            big = min(m.in_features, m.out_features) >= MIN_SIDE
            assert (type(m) is OneDnnLinear) == big and (type(m) is nn.Linear) != big, n
    assert linears["blocks.0.attn.qkv"] is OneDnnLinear and linears["head"] is nn.Linear
    assert linears["blocks.0.mlp.fc1"] is nn.Linear  # 64 outputs
    assert all(type(m) is TanhGELU for m in model.modules() if isinstance(m, nn.GELU))
    # an MLP whose second layer stays nn.Linear has nothing to fuse: it stays a plain Mlp
    assert {type(b.mlp) for b in model.blocks} == {Mlp} and type(model.attn_pool.mlp) is Mlp
    wide = plain_vit(classifier="map")
    optimize_for_training(wide)
    assert {type(b.mlp) for b in wide.blocks} == {FusedMlp} and type(wide.attn_pool.mlp) is FusedMlp
    assert not isinstance(model, FirstTokenViT)  # a MAP head reads every token

    exact = plain_vit(gelu="exact")
    optimize_for_training(exact)
    assert all(type(m) is nn.GELU for m in exact.modules() if isinstance(m, nn.GELU))
    assert type(exact) is FirstTokenViT and type(exact.blocks[-1]) is FirstTokenBlock

    small = plain_vit(width=64, num_heads=4, mlp_dim=128)  # the main job's widths: no layer of MIN_SIDE
    optimize_for_training(small)
    assert not any(isinstance(m, (OneDnnLinear, FusedMlp)) for m in small.modules())


def test_off_the_cpu_optimize_for_training_swaps_no_cpu_layer():
    with torch.device("meta"):
        model = VisionTransformer(**BASE)
    optimize_for_training(model)
    assert type(model) is FirstTokenViT  # device-independent
    assert not any(type(m).__module__ == "vitkit.accel.cpu" or isinstance(m, TanhGELU) for m in model.modules())
