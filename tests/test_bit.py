"""BiT ResNet-v2 (Big Transfer): the released .npz and timm layouts against an independent float64 computation,
golden parameter counts, the renamed post-activation rows, gradients and conversion."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import vitkit
from vitkit import BiT, BiTConfig, UserError
from vitkit.checkpoint import convert, detect_format, save_pretrained
from vitkit.errors import ConfigError
from vitkit.hub import load_model, load_pretrained
from vitkit.models import MODELS, ResNet, create_model

R50, R101, R152 = (3, 4, 6, 3), (3, 4, 23, 3), (3, 8, 36, 3)
TINY_LAYERS, TINY_CLASSES = (2, 1, 1, 1), 7  # two units in the first stage: an identity shortcut too


# ------------------------------------------------------------------------------------ the released layout
def released_arrays(layers=TINY_LAYERS, wf=1, classes=TINY_CLASSES, in_chans=3, seed=0) -> dict[str, np.ndarray]:
    """Random arrays under the names and shapes of google-research/big_transfer's .npz files, as its
    bit_pytorch/models.py ResNetV2.load_from / PreActBottleneck.load_from read them: HWIO kernels, GN (C,)."""
    rng = np.random.default_rng(seed)

    def kernel(*shape, std=0.02):  # about a trained kernel's scale, where the 1e-10 of the standardisation matters
        return (std * rng.normal(size=shape)).astype(np.float32)

    def gn(prefix, c):
        return {
            f"{prefix}/group_norm/gamma": (1 + 0.2 * rng.normal(size=c)).astype(np.float32),
            f"{prefix}/group_norm/beta": (0.2 * rng.normal(size=c)).astype(np.float32),
        }

    width = 64 * wf
    p = {"resnet/root_block/standardized_conv2d/kernel": kernel(7, 7, in_chans, width)}
    cin = width
    for s, depth in enumerate(layers, start=1):
        mid = width * 2 ** (s - 1)
        cout = 4 * mid
        for u in range(1, depth + 1):
            unit = f"resnet/block{s}/unit{u:02d}"
            c = cin if u == 1 else cout
            p |= gn(f"{unit}/a", c) | gn(f"{unit}/b", mid) | gn(f"{unit}/c", mid)
            p[f"{unit}/a/standardized_conv2d/kernel"] = kernel(1, 1, c, mid)
            p[f"{unit}/b/standardized_conv2d/kernel"] = kernel(3, 3, mid, mid)
            p[f"{unit}/c/standardized_conv2d/kernel"] = kernel(1, 1, mid, cout)
            if u == 1:  # every first unit changes width or stride (block1: 64w -> 256w)
                p[f"{unit}/a/proj/standardized_conv2d/kernel"] = kernel(1, 1, c, cout)
        cin = cout
    p |= gn("resnet", cin)  # resnet/group_norm/{gamma,beta}: the pre-head GN
    p["resnet/head/conv2d/kernel"] = kernel(1, 1, cin, classes, std=0.05)
    p["resnet/head/conv2d/bias"] = kernel(classes, std=0.1)
    return p


def reference_logits(p: dict[str, np.ndarray], x: torch.Tensor) -> torch.Tensor:
    """The published architecture in float64 with plain functional ops, read straight from the released names.

    As big_transfer's three implementations compute it: kernels standardised (w - mean) / sqrt(var + 1e-10) over
    (H, W, I); GroupNorm(32, eps 1e-5); root conv 7x7/2 pad 3, zero pad 1, max-pool 3x3/2; pre-activation units
    with the projection on the pre-activated input and the stride on the 3x3 conv; GN + ReLU, mean, dense head.
    """

    def w(name):  # HWIO -> OIHW, standardised
        k = torch.from_numpy(p[name]).double().permute(3, 2, 0, 1)
        mean = k.mean(dim=(1, 2, 3), keepdim=True)
        var = (k - mean).square().mean(dim=(1, 2, 3), keepdim=True)
        return (k - mean) / torch.sqrt(var + 1e-10)

    def gn_relu(t, prefix):
        g, b = (torch.from_numpy(p[f"{prefix}/group_norm/{n}"]).double() for n in ("gamma", "beta"))
        return F.relu(F.group_norm(t, 32, g, b, eps=1e-5))

    x = x.double()
    x = F.conv2d(x, w("resnet/root_block/standardized_conv2d/kernel"), stride=2, padding=3)
    x = F.max_pool2d(F.pad(x, (1, 1, 1, 1), value=0.0), 3, 2)
    blocks = sorted({int(k.split("/")[1][5:]) for k in p if k.startswith("resnet/block")})
    for s in blocks:
        units = sorted({k.split("/")[2] for k in p if k.startswith(f"resnet/block{s}/")})
        for unit in units:
            u = f"resnet/block{s}/{unit}"
            stride = 2 if s > 1 and unit == "unit01" else 1
            pre = gn_relu(x, f"{u}/a")
            proj = f"{u}/a/proj/standardized_conv2d/kernel"
            shortcut = F.conv2d(pre, w(proj), stride=stride) if proj in p else x
            y = F.conv2d(pre, w(f"{u}/a/standardized_conv2d/kernel"))
            y = F.conv2d(gn_relu(y, f"{u}/b"), w(f"{u}/b/standardized_conv2d/kernel"), stride=stride, padding=1)
            y = F.conv2d(gn_relu(y, f"{u}/c"), w(f"{u}/c/standardized_conv2d/kernel"))
            x = y + shortcut
    feats = gn_relu(x, "resnet").mean(dim=(2, 3))  # (B, C)
    kernel = torch.from_numpy(p["resnet/head/conv2d/kernel"]).double()  # (1, 1, C, K)
    return feats @ kernel.reshape(kernel.shape[-2], kernel.shape[-1]) + torch.from_numpy(p["resnet/head/conv2d/bias"])


def timm_state(p: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The same weights under timm's resnetv2_*_bit names (timm resnetv2.py _load_weights, written out here)."""
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    conv = lambda a: t(a.transpose(3, 2, 0, 1))  # noqa: E731
    out = {"stem.conv.weight": conv(p["resnet/root_block/standardized_conv2d/kernel"])}
    for key, value in p.items():
        parts = key.split("/")
        if not parts[1].startswith("block"):
            continue
        stage, unit, rest = int(parts[1][5:]) - 1, int(parts[2][4:]) - 1, "/".join(parts[3:])
        pre = f"stages.{stage}.blocks.{unit}."
        norm = {"a": "norm1", "b": "norm2", "c": "norm3"}[parts[3]]
        if rest.endswith("proj/standardized_conv2d/kernel"):
            out[pre + "downsample.conv.weight"] = conv(value)
        elif rest.endswith("standardized_conv2d/kernel"):
            out[pre + norm.replace("norm", "conv") + ".weight"] = conv(value)
        else:
            out[pre + norm + (".weight" if rest.endswith("gamma") else ".bias")] = t(value)
    out["norm.weight"], out["norm.bias"] = t(p["resnet/group_norm/gamma"]), t(p["resnet/group_norm/beta"])
    kernel = p["resnet/head/conv2d/kernel"]  # (1, 1, C, K) -> timm's 1x1 conv (K, C, 1, 1)
    out["head.fc.weight"] = conv(kernel)
    out["head.fc.bias"] = t(p["resnet/head/conv2d/bias"])
    return out


def images(shape=(3, 3, 35, 42)) -> torch.Tensor:
    """Odd, non-square: 35 -> 18 (conv) -> 9 (pool) -> 5 -> 3 -> 2, so every padded border is exercised. The last
    image is low-contrast, so that the GroupNorm eps (1e-5 against the hybrid stem's 1e-6) changes its logits."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    x[-1] *= 0.01
    return x


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    p = released_arrays()
    path = tmp_path_factory.mktemp("bit") / "BiT-M-R-tiny.npz"
    np.savez(path, **p)
    return p, path


def test_released_npz_matches_the_float64_reference(released):
    p, path = released
    assert detect_format(path) == "big_transfer"
    model = load_model(path).eval()
    assert isinstance(model, BiT)
    assert model.config == BiTConfig(layers=TINY_LAYERS, width_factor=1, num_classes=TINY_CLASSES)
    x = images()
    with torch.no_grad():
        got = model(x)
    want = reference_logits(p, x)
    assert want.abs().max() > 1  # logits of a size where 1e-5 means something
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_timm_state_dict_matches_the_float64_reference(released, tmp_path):
    p, _ = released
    x, want = images(), reference_logits(p, images())
    save_file(timm_state(p), tmp_path / "resnetv2_bit.safetensors")
    wrapped = {"module." + k: v for k, v in timm_state(p).items()}  # as DataParallel saves it
    torch.save({"state_dict": wrapped}, tmp_path / "resnetv2_bit.pth")
    for name in ("resnetv2_bit.safetensors", "resnetv2_bit.pth"):
        assert detect_format(tmp_path / name) == "timm"
        model = load_model(tmp_path / name).eval()
        assert model.config.arch == "bit" and model.config.layers == TINY_LAYERS
        with torch.no_grad():
            torch.testing.assert_close(model(x).double(), want, rtol=1e-5, atol=1e-5, msg=name)


def test_zero_padded_max_pool_is_what_the_reference_tests(released):
    """The root is not rectified, so its output is partly negative and the zero border wins some maxima: a
    -inf (or TF 'SAME') padded pool is another function, and the reference above tells them apart."""
    p, path = released
    stem = load_model(path).stem
    with torch.no_grad():
        y = stem.conv(images())
        zero = F.max_pool2d(F.pad(y, (1, 1, 1, 1), value=0.0), 3, 2)
        neg_inf = F.max_pool2d(F.pad(y, (1, 1, 1, 1), value=float("-inf")), 3, 2)
        assert (y < 0).any() and not torch.equal(zero, neg_inf)
        torch.testing.assert_close(stem(images()), zero, rtol=0, atol=0)


def test_timm_resnetv2_matches_when_timm_is_installed(released):
    """Peer parity with timm's own resnetv2 BiT model on the same weights (skipped without timm)."""
    timm = pytest.importorskip("timm")
    p, path = released
    ours = load_model(path).eval()
    peer = timm.models.resnetv2.ResNetV2(
        layers=list(TINY_LAYERS),
        num_classes=TINY_CLASSES,
        stem_type="fixed",
        conv_layer=lambda *a, **k: timm.layers.StdConv2d(*a, eps=1e-10, **k),  # big_transfer's; timm's BiT: 1e-8
    ).eval()
    peer.load_state_dict(timm_state(p))
    with torch.no_grad():
        torch.testing.assert_close(ours(images()), peer(images()), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------ golden parameter counts
def bit_param_count(layers: tuple[int, ...], wf: int, classes: int) -> int:
    """By hand from the architecture: root conv; per unit GN(in) + 1x1 + GN + 3x3 + GN + 1x1 (+ projection);
    the pre-head GN; the dense head. Convs have no bias, GN has a scale and a bias per channel."""
    width = 64 * wf
    n, cin = 7 * 7 * 3 * width, width
    for i, depth in enumerate(layers):
        mid = width * 2**i
        cout = 4 * mid
        for u in range(depth):
            c = cin if u == 0 else cout
            n += 2 * c + c * mid + 2 * mid + 9 * mid * mid + 2 * mid + mid * cout + (c * cout if u == 0 else 0)
        cin = cout
    return n + 2 * cin + cin * classes + classes


# With a 1000-class head; these are also the counts of timm's resnetv2_{50x1,...}_bit (timm 1.0, create_model).
GOLDEN_BIT = {
    "bit_r50x1": 25_549_352,
    "bit_r50x3": 217_319_080,
    "bit_r101x1": 44_541_480,
    "bit_r101x3": 387_934_888,
    "bit_r152x2": 236_335_208,
    "bit_r152x4": 936_533_224,
}
DEPTH_WIDTH = {"bit_r50x1": (R50, 1), "bit_r50x3": (R50, 3), "bit_r101x1": (R101, 1), "bit_r101x3": (R101, 3)}
DEPTH_WIDTH |= {"bit_r152x2": (R152, 2), "bit_r152x4": (R152, 4)}


def test_bit_rows_are_the_six_released_architectures():
    assert {n for n, row in MODELS.items() if row["arch"] == "bit"} == set(GOLDEN_BIT)


@pytest.mark.parametrize("name", sorted(GOLDEN_BIT))
def test_golden_parameter_counts(name):
    with torch.device("meta"):
        model = create_model(name, num_classes=1000)
    assert model.num_params() == GOLDEN_BIT[name] == bit_param_count(*DEPTH_WIDTH[name], 1000)


def test_bit_m_r50x1_with_its_imagenet21k_head():
    # BiT-M's head has 21,843 classes; timm's model card for resnetv2_50x1_bit.goog_in21k gives "Params (M): 68.3"
    # (https://huggingface.co/timm/resnetv2_50x1_bit.goog_in21k).
    with torch.device("meta"):
        model = create_model("bit_r50x1", num_classes=21843)
    assert model.num_params() == bit_param_count(R50, 1, 21843) == 68_256_659


# ------------------------------------------------------------------------------------ names
def test_old_names_say_where_they_went():
    with pytest.raises(UserError, match="'bit_r26x1'.*now 'hybrid_resnet_r26x1'"):
        create_model("bit_r26x1")
    with pytest.raises(UserError, match="vitkit names this architecture 'bit_r50x1'"):
        create_model("resnetv2_50x1_bit")
    with pytest.raises(UserError, match="'bit_r152x2'"):
        create_model("BiT-M-R152x2")
    # the post-activation ResNet keeps its numbers under the new names (the old bit_r* counts)
    with torch.device("meta"):
        hybrid = create_model("hybrid_resnet_r50x1", num_classes=1000)
    assert isinstance(hybrid, ResNet) and hybrid.num_params() == 25_557_032
    assert MODELS["bit_r50x1"]["arch"] == "bit"


def test_a_post_activation_checkpoint_does_not_load_as_bit(tmp_path):
    save_pretrained(ResNet(layers=(1,), width_factor=0.5, num_classes=3), tmp_path / "old")
    with pytest.raises(UserError, match="holds a 'resnet' model, the target is 'bit'.*hybrid_resnet_r"):
        load_pretrained(BiT(layers=(1,), width_factor=0.5, num_classes=3), tmp_path / "old")


# ------------------------------------------------------------------------------------ model behaviour
def test_init_shapes_and_methods():
    torch.manual_seed(0)
    model = BiT(layers=(1, 1), width_factor=0.5, num_classes=3, img_size=32).eval()
    assert not model.head.weight.any() and not model.head.bias.any()  # big_transfer's zero_head
    norms = [m for m in model.modules() if isinstance(m, torch.nn.GroupNorm)]
    assert norms and all(torch.all(m.weight == 1) and not m.bias.any() for m in norms)  # no zero-init GN in BiT
    x = torch.randn(2, 3, 32, 32)
    feats = model.forward_features(x)
    assert feats.shape == (2, 256, 4, 4)  # 32 -> /4 root -> /2 second stage; 4 x 64 channels
    assert (feats >= 0).all()  # the pre-head GN + ReLU is part of the features
    assert model.forward_head(feats, pre_logits=True).shape == (2, 256)
    assert torch.count_nonzero(model(x)) == 0
    model.reset_classifier(5)
    assert model(x).shape == (2, 5) and model.config.num_classes == 5
    model.reset_classifier(0)
    assert model(x).shape == (2, 256)
    assert model.no_weight_decay() == set()


def test_every_parameter_gets_a_gradient():
    torch.manual_seed(0)
    model = BiT(layers=(2, 1), width_factor=0.5, num_classes=4)
    with torch.no_grad():
        model.head.weight.normal_(std=0.5)  # a zero head passes no gradient to the body
    loss = F.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.tensor([0, 3]))
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_config_is_checked():
    with pytest.raises(ConfigError, match="width_factor"):
        BiTConfig(width_factor=0.3)  # 19.2 channels: not a whole number of 32 groups
    with pytest.raises(ConfigError, match="layers"):
        BiTConfig(layers=())
    with pytest.raises(ConfigError, match="num_classes"):
        BiTConfig(num_classes=-1)
    with pytest.raises(TypeError):
        create_model("bit_r50x1", widht=2)


# ------------------------------------------------------------------------------------ loading and converting
def test_another_class_count_gets_a_fresh_zero_head(released):
    p, path = released
    model, report = load_model(path, num_classes=3, return_report=True)
    assert report.reinitialised == ["head.weight", "head.bias"] and report.ok
    assert not model.head.weight.any()
    featureless, report = load_model(path, num_classes=0, return_report=True)
    assert report.dropped == ["head.weight", "head.bias"]


def test_convert_big_transfer_to_vitkit_and_back(released, tmp_path):
    p, path = released
    out = convert(path, tmp_path / "bit")
    doc = json.loads((out / "config.json").read_text())
    assert doc["model"]["arch"] == "bit" and doc["model"]["layers"] == list(TINY_LAYERS)
    a, b = load_model(path).eval(), vitkit.load_model(tmp_path / "bit").eval()
    assert isinstance(b, BiT)
    for k, v in a.state_dict().items():
        torch.testing.assert_close(v, b.state_dict()[k], rtol=0, atol=0, msg=k)
    with torch.no_grad():
        torch.testing.assert_close(a(images()), b(images()), rtol=0, atol=0)


def test_unknown_names_and_foreign_resnetv2_are_refused(tmp_path):
    p = released_arrays(layers=(1,), classes=2)
    p["resnet/block1/unit01/a/extra"] = np.zeros(3, np.float32)
    np.savez(tmp_path / "extra.npz", **p)
    with pytest.raises(UserError, match="unexpected resnet/block1/unit01/a/extra"):
        load_model(tmp_path / "extra.npz")
    state = timm_state(released_arrays(layers=(1,), classes=2))
    bn = dict(state, **{"stages.0.blocks.0.norm1.running_mean": torch.zeros(64)})
    save_file(bn, tmp_path / "bn.safetensors")
    with pytest.raises(UserError, match="BatchNorm"):
        load_model(tmp_path / "bn.safetensors")
    (tmp_path / "hub").mkdir()
    save_file(state, tmp_path / "hub" / "model.safetensors")
    (tmp_path / "hub" / "config.json").write_text(json.dumps({"architecture": "resnetv2_50", "num_classes": 2}))
    with pytest.raises(UserError, match="'resnetv2_50' is a ResNetV2 but not BiT's"):
        load_model(tmp_path / "hub")


def test_an_empty_batch_gives_empty_logits():
    """GroupNorm names its group size where -1 could not be inferred from no elements (it raised for B = 0)."""
    model = BiT(layers=(1, 1), width_factor=0.5, num_classes=3, img_size=32).eval()
    with torch.no_grad():
        assert model(torch.zeros(0, 3, 32, 32)).shape == (0, 3)
