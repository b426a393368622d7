"""The method's constants, each pinned by behaviour against a source outside the code under test.

Every number here comes from the paper or the official code (see the comment next to it), not from vitkit:
the initialisation laws of vit_jax (checked statistically on widths where the statistics are tight), the
zero-initialised last GroupNorm of each BiT bottleneck unit, the few-shot ridge regression against a float64
numpy solution written from big_vision's description, and the global gradient-norm clip against an update
computed by hand from a separate backward pass.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy import stats
from torch import nn

from vitkit.cli import build_parser
from vitkit.evaluate import fewshot, fewshot_from_features, linear_fewshot_accuracy, whiten
from vitkit.models import VisionTransformer, create_model
from vitkit.train import Trainer, config_from_dict

# the module itself (the package exports a function of the same name)
fewshot_module = importlib.import_module("vitkit.evaluate.fewshot")

# ------------------------------------------------------------------------------------ initialisation laws
# Width 192 with 8x8 patches of 3 channels: every kernel tested has 18k to 147k entries, so the empirical std
# lands within ~0.5% of the law's and a 2% tolerance separates it from every plausible alternative law
# (kaiming, normal(0.02), xavier over the fused (3D, D) matrix, lecun over fan_out, an uncorrected truncation).
D, MLP, REP, PATCH, IMG = 192, 768, 96, 8, 64
STD_RTOL = 0.02
KS_MIN_P = 1e-4  # a Kolmogorov-Smirnov p-value this small means the sample is not from the stated law
TRUNC_STD = 0.87962566103423978  # std of a unit normal truncated to [-2, 2] (Flax's truncated lecun_normal)


@pytest.fixture(scope="module")
def vit_params() -> dict[str, torch.Tensor]:
    with torch.random.fork_rng():  # a fixed draw, without disturbing the RNG of other tests
        torch.manual_seed(0)
        model = VisionTransformer(
            img_size=IMG,
            patch_size=PATCH,
            width=D,
            depth=2,
            num_heads=3,
            mlp_dim=MLP,
            num_classes=10,
            representation_size=REP,
        )
    return {k: v.detach().double() for k, v in model.state_dict().items()}


def assert_xavier_uniform(w: torch.Tensor, fan_in: int, fan_out: int, name: str) -> None:
    """U(-b, b) with b = sqrt(6 / (fan_in + fan_out)) (Glorot & Bengio; Flax's xavier_uniform)."""
    bound = math.sqrt(6.0 / (fan_in + fan_out))
    x = w.flatten().numpy()
    top = np.abs(x).max()
    assert top <= bound * (1 + 1e-6), f"{name}: max |w| {top:.5f} exceeds the xavier bound {bound:.5f}"
    assert top >= 0.99 * bound, f"{name}: max |w| {top:.5f} well inside the xavier bound {bound:.5f}"
    std = x.std()
    assert abs(std / (bound / math.sqrt(3)) - 1) < STD_RTOL, f"{name}: std {std:.5f}, expected {bound / 3**0.5:.5f}"
    assert abs(x.mean()) < 0.02 * bound, f"{name}: mean {x.mean():.2e} is not centred"
    p = stats.kstest(x, stats.uniform(loc=-bound, scale=2 * bound).cdf).pvalue
    assert p > KS_MIN_P, f"{name}: not uniform on [-{bound:.4f}, {bound:.4f}] (KS p={p:.1e})"


def assert_lecun_normal(w: torch.Tensor, fan_in: int, name: str) -> None:
    """Flax's lecun_normal: a normal truncated to +-2 sigma, sigma corrected so that the variance is 1/fan_in."""
    std = math.sqrt(1.0 / fan_in)
    sigma = std / TRUNC_STD
    x = w.flatten().numpy()
    top = np.abs(x).max()
    assert top <= 2 * sigma * (1 + 1e-6), f"{name}: max |w| {top:.5f} beyond the 2-sigma cutoff {2 * sigma:.5f}"
    assert top >= 0.97 * 2 * sigma, f"{name}: max |w| {top:.5f} well inside the cutoff {2 * sigma:.5f}"
    assert abs(x.std() / std - 1) < STD_RTOL, f"{name}: std {x.std():.5f}, expected sqrt(1/fan_in) = {std:.5f}"
    p = stats.kstest(x, stats.truncnorm(-2, 2, scale=sigma).cdf).pvalue
    assert p > KS_MIN_P, f"{name}: not a 2-sigma truncated normal (KS p={p:.1e})"


def test_attention_kernels_are_xavier_uniform_per_projection(vit_params):
    # Flax's q, k, v are separate DenseGeneral kernels (D, heads, head_dim), each initialised on its flattened
    # D x D shape: so every D-row chunk of the fused (3D, D) qkv weight has fan_in = fan_out = D on its own.
    for i in range(2):
        qkv = vit_params[f"blocks.{i}.attn.qkv.weight"]
        assert qkv.shape == (3 * D, D)
        for j, part in enumerate("qkv"):
            assert_xavier_uniform(qkv[j * D : (j + 1) * D], D, D, f"block {i} {part}")
        assert not torch.equal(qkv[:D], qkv[D : 2 * D]), "q and k must be independent draws"
        assert_xavier_uniform(vit_params[f"blocks.{i}.attn.proj.weight"], D, D, f"block {i} out")
        assert not vit_params[f"blocks.{i}.attn.qkv.bias"].any(), "q, k, v biases start at zero"
        assert not vit_params[f"blocks.{i}.attn.proj.bias"].any(), "the out bias starts at zero"


def test_mlp_kernels_are_xavier_uniform_with_tiny_normal_biases(vit_params):
    for i in range(2):
        assert_xavier_uniform(vit_params[f"blocks.{i}.mlp.fc1.weight"], D, MLP, f"block {i} fc1")
        assert_xavier_uniform(vit_params[f"blocks.{i}.mlp.fc2.weight"], MLP, D, f"block {i} fc2")
        # vit_jax MlpBlock: bias_init=normal(stddev=1e-6); 768 / 192 draws pin the std to within ~10%
        for fc, n in (("fc1", MLP), ("fc2", D)):
            b = vit_params[f"blocks.{i}.mlp.{fc}.bias"].numpy()
            assert b.shape == (n,)
            assert abs(b.std() / 1e-6 - 1) < 0.2, f"block {i} {fc} bias std {b.std():.2e}, expected 1e-6"
            assert abs(b.mean()) < 0.3e-6


def test_pre_logits_and_patch_embedding_are_lecun_normal(vit_params):
    # torch kernels are (out, in, ...): fan_in is everything but the first axis
    pre = vit_params["pre_logits.weight"]
    assert pre.shape == (REP, D)  # REP != D, so a fan_out law would give another std
    assert_lecun_normal(pre, D, "pre_logits")
    assert not vit_params["pre_logits.bias"].any()
    patch = vit_params["patch_embed.proj.weight"]
    assert patch.shape == (D, 3, PATCH, PATCH)
    assert_lecun_normal(patch, 3 * PATCH * PATCH, "patch embedding")
    assert not vit_params["patch_embed.proj.bias"].any()


def test_position_embedding_class_token_and_head(vit_params):
    pos = vit_params["pos_embed"].flatten().numpy()  # (1, 65, D): 12,480 draws
    assert abs(pos.std() / 0.02 - 1) < 0.03, f"pos_embed std {pos.std():.5f}, expected 0.02"
    assert np.abs(pos).max() > 3 * 0.02, "pos_embed looks truncated: an untruncated normal reaches past 3 sigma"
    p = stats.kstest(pos, stats.norm(scale=0.02).cdf).pvalue
    assert p > KS_MIN_P, f"pos_embed is not N(0, 0.02^2) (KS p={p:.1e})"
    assert not vit_params["cls_token"].any(), "the class token starts at zero"
    # the fine-tuning head of the paper is one zero-initialised Dense
    assert not vit_params["head.weight"].any() and not vit_params["head.bias"].any()


# --------------------------------------------------------------------------------------------- BiT ResNet
TINY_RESNETS = [
    ("r50_vit_b16", dict(width=64, depth=1, num_heads=2, mlp_dim=64, resnet_layers=(1, 1), img_size=32)),
    ("hybrid_resnet_r26x1", dict(layers=(1, 1), width_factor=0.5, img_size=32)),
]


@pytest.mark.parametrize("name, overrides", TINY_RESNETS, ids=[n for n, _ in TINY_RESNETS])
def test_bottleneck_last_groupnorm_scale_starts_at_zero(name, overrides):
    """vit_jax models_resnet.ResidualUnit: GroupNorm(name='gn3', scale_init=zeros); every other GroupNorm has the
    default scale 1, bias 0. So each unit starts as relu(shortcut(x)), the residual branch switched off."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = create_model(name, num_classes=10, **overrides)
    norms = {n: m for n, m in model.named_modules() if isinstance(m, nn.GroupNorm)}
    last = {n for n in norms if n.endswith(".norm3")}
    units = {n.rsplit(".", 1)[0]: model.get_submodule(n.rsplit(".", 1)[0]) for n in last}
    assert len(units) == 2, f"{name}: expected one unit in each of the 2 stages, found {sorted(units)}"
    assert len(norms) > 2 * len(units), "the stem, norm1, norm2 and projection GroupNorms must be there too"
    for n, m in norms.items():
        expected = 0.0 if n in last else 1.0
        assert torch.all(m.weight == expected), f"{name}: {n}.weight should start at {expected}"
        assert not m.bias.any(), f"{name}: {n}.bias should start at zero"
    with torch.no_grad():
        for n, unit in units.items():
            x = torch.randn(2, unit.conv1.in_channels, 8, 8, generator=torch.Generator().manual_seed(0))
            shortcut = x if unit.downsample is None else unit.downsample(x)
            torch.testing.assert_close(unit(x), F.relu(shortcut), msg=f"{name}: {n} is not relu(shortcut) at init")


# ------------------------------------------------------------------------------------------- few-shot
# big_vision evaluators/fewshot_lsr.py, the public code of the paper's few-shot protocol: whiten with the subset's
# mean and std (+1e-5), pad a constant feature BIAS_CONSTANT = 100.0 (large, so the bias is almost
# unregularised), regress onto 2 * one_hot - 1 with l2_reg = 2**10 (its ViT configs), solved through the
# eigendecomposition of X^T X (n >= d) or X X^T (n < d).
BIG_VISION_BIAS = 100.0
BIG_VISION_STD_EPS = 1e-5
BIG_VISION_L2 = 2.0**10


def lsr_reference(train_x, train_y, test_x, num_classes, l2=BIG_VISION_L2, bias=BIG_VISION_BIAS, targets=(-1.0, 1.0)):
    """big_vision's closed form in float64 numpy: whitened inputs, targets, weights, test scores."""
    train_x, test_x = np.asarray(train_x, np.float64), np.asarray(test_x, np.float64)
    mean, std = train_x.mean(0, keepdims=True), train_x.std(0, keepdims=True) + BIG_VISION_STD_EPS
    x = np.pad((train_x - mean) / std, ((0, 0), (0, 1)), constant_values=bias)
    xt = np.pad((test_x - mean) / std, ((0, 0), (0, 1)), constant_values=bias)
    off, on = targets
    y = np.where(np.eye(num_classes, dtype=bool)[np.asarray(train_y)], on, off)
    n, d = x.shape
    if n >= d:
        eigs, q = np.linalg.eigh(x.T @ x)
        lhs, rhs = q, q.T @ (x.T @ y)
    else:
        eigs, q = np.linalg.eigh(x @ x.T)
        lhs, rhs = x.T @ q, q.T @ y
    w = (lhs / (eigs + l2)) @ rhs
    return x, xt, y, w, xt @ w


def separable_problem(n_per_class: list[int], dim: int, noise: float, seed: int):
    """Noisy clusters, n_per_class training examples per class. Unequal class sizes give each class's regression
    a different bias, so how strongly the bias is regularised (its constant) moves decisions; with balanced
    classes every class score shifts alike and the constant is invisible in the accuracy."""
    rng = np.random.default_rng(seed)
    k = len(n_per_class)
    centres = rng.normal(size=(k, dim)) * rng.uniform(0.2, 2.0, size=dim)  # anisotropic: l2 reshapes W too
    train_y = np.repeat(np.arange(k), n_per_class)
    test_y = rng.integers(0, k, 1000)
    train_x = centres[train_y] + noise * rng.normal(size=(len(train_y), dim)) + 3.0
    test_x = centres[test_y] + noise * rng.normal(size=(len(test_y), dim)) + 3.0
    return train_x.astype(np.float32), train_y, test_x.astype(np.float32), test_y


def accuracy(scores: np.ndarray, labels: np.ndarray) -> float:
    return float((scores.argmax(1) == labels).mean())


@pytest.mark.parametrize(
    "n_per_class, dim, noise",
    [([10, 30, 60], 150, 2.0), ([40, 120, 240], 12, 1.0)],
    ids=["dual n<d (few-shot)", "primal n>=d"],
)
def test_fewshot_solves_big_vision_ridge_regression(monkeypatch, n_per_class, dim, noise):
    train_x, train_y, test_x, test_y = separable_problem(n_per_class, dim, noise, seed=0)
    k = len(n_per_class)
    ref_x, ref_xt, ref_y, ref_w, ref_scores = lsr_reference(train_x, train_y, test_x, k)

    # The problem must be one where the constants decide the outcome, or agreeing with it proves nothing.
    # (The {0, 1} vs {-1, 1} choice cannot change an argmax: ridge is linear in the targets and the two differ by
    # an affine map with the same offset for every class. It is pinned on the targets and weights below.)
    ref_acc = accuracy(ref_scores, test_y)
    for changed in (dict(bias=10.0), dict(l2=2.0**9), dict(l2=2.0**11), dict(l2=1000.0)):
        other = accuracy(lsr_reference(train_x, train_y, test_x, k, **changed)[4], test_y)
        assert other != ref_acc, f"{changed} gives the same accuracy: the problem does not pin the constants"
    assert not np.allclose(lsr_reference(train_x, train_y, test_x, k, targets=(0.0, 1.0))[3], ref_w)

    solved = []  # what the accuracy function hands to the solver, and what it gets back

    def spy(x, y, l2):
        w = real_ridge(x, y, l2)
        solved.append((x.clone(), y.clone(), l2, w.clone()))
        return w

    real_ridge = fewshot_module.ridge_regression
    monkeypatch.setattr(fewshot_module, "ridge_regression", spy)
    tx, ty = torch.from_numpy(train_x), torch.from_numpy(train_y)
    acc = linear_fewshot_accuracy(tx, ty, torch.from_numpy(test_x), torch.from_numpy(test_y), k)  # default l2
    assert len(solved) == 1, "linear_fewshot_accuracy must solve one ridge regression through ridge_regression"
    x, y, l2, w = solved[0]
    assert l2 == BIG_VISION_L2
    np.testing.assert_array_equal(y.numpy(), ref_y, err_msg="targets must be one-vs-rest in {-1, 1}")
    np.testing.assert_allclose(x.numpy(), ref_x, rtol=1e-12, atol=1e-12, err_msg="whitened features + bias")
    np.testing.assert_allclose(w.numpy(), ref_w, rtol=1e-8, atol=1e-10, err_msg="ridge weights")
    test_whitened = whiten(tx.double(), torch.from_numpy(test_x).double())[1].numpy()
    np.testing.assert_allclose(test_whitened, ref_xt, rtol=1e-12, atol=1e-12, err_msg="test set whitening")
    np.testing.assert_array_equal((test_whitened @ w.numpy()).argmax(1), ref_scores.argmax(1))
    assert acc == pytest.approx(ref_acc, abs=1e-12)


def test_fewshot_default_l2_is_2_to_the_10_everywhere():
    for fn in (fewshot, fewshot_from_features, linear_fewshot_accuracy):
        assert inspect.signature(fn).parameters["l2"].default == BIG_VISION_L2, fn.__name__
    assert build_parser().parse_args(["fewshot", "model.npz"]).l2 == BIG_VISION_L2
    # End to end with defaults: shots = every training example of each class, so the subset is the whole
    # training set (in some order, which ridge regression ignores) and the reference needs no sampling.
    train_x, train_y, test_x, test_y = separable_problem([100, 100, 100], 12, noise=2.0, seed=0)
    ref_acc = accuracy(lsr_reference(train_x, train_y, test_x, 3)[4], test_y)
    for l2 in (2.0**9, 2.0**11, 1000.0):
        assert ref_acc != accuracy(lsr_reference(train_x, train_y, test_x, 3, l2=l2)[4], test_y), l2
    result = fewshot_from_features(train_x, train_y, test_x, test_y, shots=[100], seeds=1)
    assert result.l2 == BIG_VISION_L2
    assert result.accuracy[100] == [pytest.approx(ref_acc, abs=1e-12)]


# ----------------------------------------------------------------------------------- gradient clipping
PAPER_GRAD_CLIP = 1.0  # Tables 3-4: gradient clipping at global norm 1, pretraining and fine-tuning
LR = 0.5


def clip_doc(tmp_path) -> dict:
    """One plain SGD step (no momentum, no decay, constant lr) on a tiny ViT: the update is -lr * clipped grad."""
    return {
        "model": {"name": "vit_ti16", "patch_size": 8, "width": 32, "depth": 2, "num_heads": 2, "mlp_dim": 64},
        "data": {"source": "synthetic", "img_size": 16, "synthetic_size": 64, "synthetic_classes": 4},
        "optim": {"name": "sgd", "lr": LR, "momentum": 0.0, "weight_decay": 0.0, "batch_size": 16},
        "schedule": {"steps": 1, "warmup_steps": 0, "decay": "constant"},
        "run": {"out_dir": str(tmp_path / "runs"), "name": "clip", "progress": False, "plots": False, "threads": 1},
    }


def test_default_grad_clip_is_global_norm_1(tmp_path):
    assert config_from_dict({}).optim.grad_clip == PAPER_GRAD_CLIP
    assert config_from_dict(clip_doc(tmp_path)).optim.grad_clip == PAPER_GRAD_CLIP


@pytest.mark.parametrize(
    "overrides, max_norm", [([], PAPER_GRAD_CLIP), (["optim.grad_clip=0"], math.inf), (["optim.grad_clip=3"], 3.0)]
)
def test_train_step_applies_the_globally_clipped_gradient(tmp_path, overrides, max_norm):
    trainer = Trainer(config_from_dict(clip_doc(tmp_path), overrides))
    try:
        model = trainer.model
        with torch.no_grad():
            # a non-zero head lets the gradient reach every layer (a zero head stops it at the head), so the clip
            # acts on many tensors at once and a per-tensor clip could not pass for a global one
            model.head.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(0))
        reference = copy.deepcopy(model)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        x, y = next(trainer.batches(0))
        trainer.train_step(iter([(x, y)]))

        reference.train()
        F.cross_entropy(reference(x), y).backward()
        grads = {n: p.grad.double() for n, p in reference.named_parameters() if p.grad is not None}
        assert len([g for g in grads.values() if g.any()]) > 10, "the gradient should reach every layer"
        norm = math.sqrt(sum(float(g.square().sum()) for g in grads.values()))
        assert norm > 4.0, f"gradient norm {norm:.2f}: too small for the clip to act in this test"
        scale = min(1.0, max_norm / norm)
        params = dict(model.named_parameters())
        got = torch.cat([(params[n].detach().double() - before[n].double()).flatten() for n in grads])
        want = torch.cat([(-LR * scale * g).flatten() for g in grads.values()])
        rel = float((got - want).norm() / want.norm())
        assert rel < 1e-4, f"applied update differs from -lr * g * min(1, {max_norm}/|g|) by {rel:.2e} (relative)"
        for n in set(params) - set(grads):
            assert torch.equal(params[n], before[n]), f"{n} has no gradient but moved"
    finally:
        trainer.close()


# ------------------------------------------------------------------------------------------------- Adam
PAPER_ADAM_BETAS = (0.9, 0.999)  # paper appendix B.1: Adam with beta1 = 0.9, beta2 = 0.999 (also for fine-tuning)
ADAM_EPS = 1e-8  # the official code's optax.adam default


def adam_float64(params: list[np.ndarray], grads_per_step: list[list[np.ndarray]], lr, betas, eps, wd, decoupled):
    """Adam / AdamW written from Kingma & Ba (2015) and Loshchilov & Hutter (2019), in float64."""
    b1, b2 = betas
    p = [x.astype(np.float64).copy() for x in params]
    m = [np.zeros_like(x) for x in p]
    v = [np.zeros_like(x) for x in p]
    for t, grads in enumerate(grads_per_step, start=1):
        for i, g in enumerate(grads):
            g = g.astype(np.float64)
            if decoupled:
                p[i] = p[i] * (1 - lr * wd)
            else:
                g = g + wd * p[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            m_hat, v_hat = m[i] / (1 - b1**t), v[i] / (1 - b2**t)
            p[i] = p[i] - lr * m_hat / (np.sqrt(v_hat) + eps)
    return p


@pytest.mark.parametrize("name", ["adamw", "adam"])
def test_adam_defaults_are_the_papers_betas(name):
    from vitkit.train.optim import build_optimizer

    cfg = config_from_dict({"optim": {"name": name, "lr": 0.01, "weight_decay": 0.1}}).optim
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    optimizer = build_optimizer(model, cfg)
    assert {tuple(g["betas"]) for g in optimizer.param_groups} == {PAPER_ADAM_BETAS}
    assert {g["eps"] for g in optimizer.param_groups} == {ADAM_EPS}

    # several steps with changing gradients: the first step alone is lr * sign(g) whatever the betas are
    gen = torch.Generator().manual_seed(0)
    decayed = {id(p) for g in optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    params = list(model.parameters())
    start = [p.detach().numpy().copy() for p in params]
    steps = [[torch.randn(p.shape, generator=gen) * (1 + 3 * s) for p in params] for s in range(4)]
    for grads in steps:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()
    for decays in (True, False):
        chosen = [i for i, p in enumerate(params) if (id(p) in decayed) == decays]
        want = adam_float64(
            [start[i] for i in chosen],
            [[grads[i].numpy() for i in chosen] for grads in steps],
            0.01,
            PAPER_ADAM_BETAS,
            ADAM_EPS,
            0.1 if decays else 0.0,
            decoupled=name == "adamw",
        )
        for i, w in zip(chosen, want):
            np.testing.assert_allclose(params[i].detach().double().numpy(), w, rtol=1e-5, atol=1e-6)
