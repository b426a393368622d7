"""The newcomer's path through the public API: ``pretrained=True``, tags and timm / Hugging Face names, the
names ``dir(vitkit)`` shows, and images turned into the batch a model's weights expect. Released weights are
stood in for by a tiny model's file put in the cache where the real row's URL would land (no network)."""

from __future__ import annotations

import inspect
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

import vitkit
from vitkit import UserError, hub
from vitkit import pretrained as released
from vitkit.checkpoint.official import vitkit_to_official
from vitkit.errors import UserFileNotFoundError
from vitkit.models import MODELS, registry
from vitkit.preprocessing import Preprocessing
from vitkit.pretrained import DEFAULT_WEIGHTS, PRETRAINED, names

SMALL = dict(img_size=16, patch_size=4, width=32, depth=2, num_heads=2, mlp_dim=64, num_classes=1000)


@pytest.fixture
def s16_default(tmp_path, monkeypatch):
    """vit_s16's default row, its config shrunk to SMALL, served from the cache: the tiny model's official .npz
    sits where the row's URL is cached, so nothing is downloaded."""
    monkeypatch.setenv("VITKIT_CACHE", str(tmp_path / "cache"))
    tag = "vit_s16.augreg_in21k_ft_in1k"
    row = replace(PRETRAINED[tag], config=SMALL, img_size=16)
    monkeypatch.setitem(PRETRAINED, tag, row)
    torch.manual_seed(0)
    model = registry.create_model("vit_s16", **SMALL).eval()
    torch.nn.init.normal_(model.head.weight, std=0.02)  # a head that is not zero, so it is seen to load
    assert row.url is not None
    path = released.url_cache_path(row.url)
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:
        np.savez(f, **vitkit_to_official(model))
    return model


# ------------------------------------------------------------------------------------------ pretrained=True
def test_pretrained_true_loads_the_default_weights(s16_default):
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        want = s16_default(x)
        loaded = [
            vitkit.create_model("vit_s16", pretrained=True),
            vitkit.create_model("vit_s16", pretrained="augreg_in21k_ft_in1k"),
            vitkit.create_model("vit_s16.augreg_in21k_ft_in1k", pretrained=True),
            vitkit.create_model("vit_small_patch16_384.augreg_in21k_ft_in1k", pretrained=True),  # timm's name
            vitkit.load_model("vit_small_patch16_384.augreg_in21k_ft_in1k"),
            vitkit.load_model("vit_s16"),  # a bare model name: its default weights
        ]
        for model in loaded:
            torch.testing.assert_close(model.eval()(x), want, rtol=1e-5, atol=1e-5)
            assert model.preprocessing == PRETRAINED["vit_s16.augreg_in21k_ft_in1k"].preprocessing()
        plain = vitkit.create_model("vit_s16", pretrained=False, **SMALL).eval()
        assert not torch.allclose(plain(x), want) and not hasattr(plain, "preprocessing")
    at_224 = vitkit.create_model("vit_small_patch16_224", pretrained="augreg_in21k_ft_in1k")  # the alias's size
    assert at_224.config.img_size == (224, 224) and at_224.preprocessing.img_size == 224
    torch.testing.assert_close(at_224.head.weight, s16_default.head.weight)
    fresh = vitkit.create_model("vit_s16", pretrained=True, num_classes=10)  # another head: its names do not apply
    assert fresh.config.num_classes == 10 and fresh.preprocessing.class_names is None
    with pytest.raises(UserError, match="vit_s16_gap has no released weights"):
        vitkit.create_model("vit_s16_gap", pretrained=True)
    with pytest.raises(UserError, match="already names weights"):
        vitkit.create_model("vit_s16.augreg_in21k", pretrained="augreg_in21k_ft_in1k")


def test_the_default_weights_follow_their_stated_rule():
    """DEFAULT_WEIGHTS re-derived from the table: of the official buckets' files (Hub copies aside), the ImageNet-1k
    fine-tune of ImageNet-21k pretraining (AugReg before the 2020 release, the larger resolution first), else the
    ImageNet-21k weights (BiT-M before BiT-S)."""

    def rank(row: released.PretrainedRow) -> tuple[bool, bool, bool, int]:
        return ("in21k_ft_in1k" in row.weights, "in21k" in row.weights, row.weights.startswith("augreg"), row.img_size)

    derived = {}
    for model in dict.fromkeys(row.model for row in PRETRAINED.values()):
        rows = [r for r in PRETRAINED.values() if r.model == model and r.url is not None]
        derived[model] = max(rows, key=rank).weights if rows else None
    assert {m: w for m, w in derived.items() if w is not None} == DEFAULT_WEIGHTS
    assert {m for m, w in derived.items() if w is None} == set()  # every model with weights has a default
    assert released.default_pretrained("vit_b16").tag == "vit_b16.augreg_in21k_ft_in1k"


# ------------------------------------------------------------------------------------ timm and HF names
@pytest.mark.parametrize(
    "name, model, img_size, tag",
    [
        ("vit_base_patch16_224", "vit_b16", 224, None),
        ("vit_base_patch16_224.augreg_in21k", "vit_b16", 224, "vit_b16.augreg_in21k"),
        ("vit_small_patch16_384.augreg_in21k_ft_in1k", "vit_s16", 384, "vit_s16.augreg_in21k_ft_in1k"),
        ("vit_tiny_patch16_224", "vit_ti16", 224, None),
        ("vit_large_patch32_384", "vit_l32", 384, None),
        ("vit_huge_patch14_224", "vit_h14", 224, None),
        ("vit_base_r50_s16_384", "r50_vit_b16", 384, None),
        ("vit_base_r50_s16_384.orig_in21k_ft_in1k", "r50_vit_b16", 384, "r50_vit_b16.orig_in21k_ft_in1k"),
        ("resnetv2_50x1_bit.goog_in21k", "bit_r50x1", None, "bit_r50x1.bit_m_in21k"),
        ("google/vit-base-patch16-224", "vit_b16", 224, "vit_b16.orig_in21k_ft_in1k_224_hf"),
        ("google/vit-base-patch16-224-in21k", "vit_b16", 224, "vit_b16.orig_in21k"),
        ("google/vit-large-patch16-384", "vit_l16", 384, "vit_l16.orig_in21k_ft_in1k"),
        ("google/vit-huge-patch14-224-in21k", "vit_h14", 224, "vit_h14.orig_in21k"),
    ],
)
def test_timm_and_hf_names_resolve_to_vitkit_rows(name, model, img_size, tag):
    resolved = names.resolve_name(name)
    assert (resolved.model, resolved.img_size, resolved.tag) == (model, img_size, tag)
    if tag is not None:
        row = PRETRAINED[tag]
        assert row.model == model and (img_size is None or row.img_size == img_size)


def test_every_alias_lands_on_a_row_of_its_own_model_and_resolution():
    for arch, target in names.TIMM_ARCHS.items():
        assert target is None or target[0] in MODELS, arch
    for timm_tag in names.TIMM_WEIGHTS:
        target = names.TIMM_ARCHS[timm_tag.partition(".")[0]]
        assert target is not None, timm_tag
        tag = names._tag_of(timm_tag)
        if tag is None:
            continue
        row = PRETRAINED[tag]
        assert row.model == target[0], timm_tag
        fine_tuned = timm_tag.endswith("ft_in1k")
        assert not fine_tuned or row.img_size == target[1], timm_tag  # a 384 alias is a 384 fine-tune
        assert fine_tuned == (row.classes == "imagenet-1k" and "in21k" in row.weights), timm_tag
        url = names.TIMM_WEIGHTS[timm_tag]
        assert url is None or not url.startswith("https://") or row.url == url  # the very file timm names
    for name, (model, res, tag) in names.HF_NAMES.items():
        row = PRETRAINED[tag]
        assert row.model == model and row.img_size == res, name
        assert ("in21k" in name) == (row.classes == "imagenet-21k"), name


def test_an_alias_gives_the_architecture_at_its_resolution():
    model = vitkit.create_model("vit_base_patch16_384", depth=1)
    assert model.config == registry.model_config("vit_b16", img_size=384, depth=1)
    hf = vitkit.create_model("google/vit-base-patch16-224-in21k", depth=1)  # the architecture its weights need
    assert hf.config.num_classes == 21843 and hf.config.representation_size == 768
    hybrid = vitkit.create_model("vit_tiny_r_s16_p8_384")
    assert hybrid.config == registry.model_config("r_vit_ti32", img_size=384)


def test_token_merging_is_a_speed_patch_asked_for_by_keyword():
    plain = vitkit.create_model("vit_ti16", depth=1, img_size=32)
    merging = vitkit.create_model("vit_ti16", token_merge=2, depth=1, img_size=32)
    assert merging.token_merge == 2 and merging.config == plain.config  # the config knows nothing of it
    assert merging.state_dict().keys() == plain.state_dict().keys()
    with pytest.raises(UserError, match="token_merge=2: merging needs a VisionTransformer, not BiT"):
        vitkit.create_model("bit_r50x1", token_merge=2)


def test_weights_vitkit_does_not_hold_are_an_error_never_another_file():
    assert names.TIMM_WEIGHTS["vit_base_patch16_224.augreg_in1k"] is None
    with pytest.raises(UserError, match=r"timm's vit_base_patch16_224.augreg_in1k is not in vitkit's weights table"):
        vitkit.load_model("vit_base_patch16_224.augreg_in1k")
    with pytest.raises(UserError, match="vit_b16.orig_in21k"):  # the error lists what vitkit has instead
        vitkit.create_model("vit_base_patch16_224.augreg_in1k", pretrained=True)
    plain = vitkit.create_model("vit_base_patch16_224.augreg_in1k", depth=1)  # the architecture alone is fine
    assert plain.config == registry.model_config("vit_b16", img_size=224, depth=1)


# ------------------------------------------------------------------------------------------ did you mean
def _first_suggestion(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message and "did you mean " in message
    return message.split("did you mean ", 1)[1].split(", ")[0]


@pytest.mark.parametrize(
    "typo, first",
    [
        ("vit_base_patch16_22", "vit_base_patch16_224 (vit_b16 at 224)"),
        ("vit_b_16", "vit_b16"),
        ("ViT-B16", "vit_b16"),
        ("google/vit-large-patch16-38", "google/vit-large-patch16-384 (vit_l16.orig_in21k_ft_in1k)"),
        ("vit_small_patch8_224", "vit_small_patch32_224 (vit_s32 at 224)"),  # timm has it; vitkit has no S/8
    ],
)
def test_a_misspelt_name_proposes_the_right_row_first(typo, first):
    with pytest.raises(UserError) as error:
        vitkit.create_model(typo)
    assert _first_suggestion(error) == first


def test_a_misspelt_name_given_to_load_model_is_not_taken_for_a_file():
    with pytest.raises(UserFileNotFoundError, match="neither a file nor a model name") as error:
        vitkit.load_model("vit_b_16")
    assert _first_suggestion(error) == "vit_b16"
    with pytest.raises(FileNotFoundError, match="no-such.npz"):
        vitkit.load_model("no-such.npz")  # a file name stays a file name
    with pytest.raises(UserError, match="unknown pretrained weights 'vit_b16.augreg_in21'; did you mean"):
        vitkit.load_model("vit_b16.augreg_in21")


# ---------------------------------------------------------------------------------------- the public API
PUBLIC = (
    "create_model",
    "load_model",
    "load_pretrained",
    "save_pretrained",
    "list_models",
    "list_pretrained",
    "optimize_for_inference",
    "preprocess",
    "preprocessing_of",
    "UserError",
    "__version__",
)


def test_dir_shows_the_public_api_with_reference_docstrings():
    shown = dir(vitkit)
    for name in PUBLIC:
        assert name in vitkit.__all__ and name in shown, name
        assert getattr(vitkit, name) is not None
    assert "importlib" not in shown and "Any" not in shown  # the module's own imports are not API
    for name in vitkit.__all__:
        obj = getattr(vitkit, name)
        if callable(obj) and not isinstance(obj, type):
            assert obj.__doc__ and obj.__doc__.strip(), name
    for fn in (vitkit.create_model, vitkit.load_model, vitkit.load_pretrained, vitkit.preprocess):
        doc = inspect.getdoc(fn)
        assert doc is not None and "Args:" in doc and "Returns:" in doc, fn.__name__
        documented = {p for p in inspect.signature(fn).parameters if p != "overrides"}
        assert all(f"{p}:" in doc or f"**{p}" in doc for p in documented), fn.__name__


# ----------------------------------------------------------------------------------------- images -> batch
def _by_hand(img: Image.Image, size: int, mean: list[float], std: list[float]) -> torch.Tensor:
    """The evaluation preprocessing written out: PIL's bilinear resize of the whole image, then numpy."""
    pixels = np.asarray(img.convert("RGB").resize((size, size), Image.Resampling.BILINEAR), dtype=np.float64)
    normalised = (pixels / 255.0 - np.array(mean)) / np.array(std)  # (H, W, C)
    return torch.from_numpy(normalised.transpose(2, 0, 1)).float()


def test_preprocess_turns_images_into_the_batch_the_record_asks_for(tmp_path):
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (30, 41, 3), dtype=np.uint8))
    (tmp_path / "imgs").mkdir()
    img.save(tmp_path / "imgs" / "b.png")
    Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(tmp_path / "imgs" / "a.png")
    prep = Preprocessing(img_size=24, mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    want = _by_hand(img, 24, prep.mean, prep.std)
    from_pil = vitkit.preprocess(prep, img)
    from_file = vitkit.preprocess(prep, tmp_path / "imgs" / "b.png")
    assert from_pil.shape == (1, 3, 24, 24) and from_pil.dtype == torch.float32
    torch.testing.assert_close(from_pil[0], want, rtol=0, atol=1e-5)
    torch.testing.assert_close(from_file, from_pil)  # PNG is lossless: the file and the image agree
    folder = vitkit.preprocess(prep, tmp_path / "imgs")
    assert folder.shape == (2, 3, 24, 24)
    torch.testing.assert_close(folder[1], want, rtol=0, atol=1e-5)  # sorted by name: a.png, b.png
    mixed = vitkit.preprocess(prep, [img, str(tmp_path / "imgs" / "a.png")])
    torch.testing.assert_close(mixed, torch.stack([want, folder[0]]))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="folder has no images"):
        vitkit.preprocess(prep, tmp_path / "empty")


def test_preprocess_takes_what_people_pass_and_leaves_it_theirs(tmp_path):
    """An opened image file stays open, an array and a tensor (uint8, or floats in [0, 1]) give the file's batch
    and stay as they were; another shape or dtype is refused in one line saying what is accepted."""
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (30, 41, 3), dtype=np.uint8)  # (H, W, C)
    Image.fromarray(pixels).save(tmp_path / "a.png")
    prep = Preprocessing(img_size=24, mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    want = vitkit.preprocess(prep, tmp_path / "a.png")
    opened = Image.open(tmp_path / "a.png")
    torch.testing.assert_close(vitkit.preprocess(prep, [opened]), want)
    assert np.array_equal(np.asarray(opened), pixels)  # still open: a closed image raises here
    tensor = torch.from_numpy(pixels).permute(2, 0, 1).contiguous()  # (C, H, W), as torchvision reads it
    given = [pixels, tensor, tensor.float() / 255, torch.from_numpy(pixels[:, :, :1]).permute(2, 0, 1)]
    before = [g.copy() if isinstance(g, np.ndarray) else g.clone() for g in given]
    batch = vitkit.preprocess(prep, given)
    torch.testing.assert_close(batch[:3], want.expand(3, -1, -1, -1), rtol=0, atol=1e-5)
    grey = vitkit.preprocess(prep, Image.fromarray(pixels[:, :, 0]))  # one channel: the grey PIL image's batch
    torch.testing.assert_close(batch[3:], grey, rtol=0, atol=1e-5)
    assert all(np.array_equal(np.asarray(g), np.asarray(b)) for g, b in zip(given, before))
    refused = {
        "a tensor of shape (30, 41, 3) and dtype torch.uint8": torch.from_numpy(pixels),  # (H, W, C) as a tensor
        "an array of shape (3, 30, 41) and dtype uint8": pixels.transpose(2, 0, 1),
        "an array of shape (30, 41, 3) and dtype int64": pixels.astype(np.int64),
        "a tensor of shape (3, 30, 41) and dtype torch.float32": (tensor.float() - 128) / 64,  # normalised already
        "a tensor of shape (1, 3, 30, 41) and dtype torch.uint8": tensor[None],  # a batch
    }
    for said, bad in refused.items():
        with pytest.raises(UserError) as caught:
            vitkit.preprocess(prep, [pixels, bad])
        message = str(caught.value)
        assert message.startswith(f"preprocess: image 1 is {said}; expected") and "\n" not in message
        assert "(H, W, C)" in message if isinstance(bad, np.ndarray) else "(C, H, W)" in message


def test_a_loaded_model_carries_its_preprocessing(s16_default, tmp_path):
    row = PRETRAINED["vit_s16.augreg_in21k_ft_in1k"]
    model = vitkit.load_model("vit_s16.augreg_in21k_ft_in1k")
    assert hub.preprocessing_of(model) == row.preprocessing() == hub.preprocessing_of("vit_s16")
    assert hub.preprocessing_of("vit_small_patch16_384.augreg_in21k_ft_in1k") == row.preprocessing()
    img = Image.fromarray(np.random.default_rng(1).integers(0, 256, (25, 33, 3), dtype=np.uint8))
    batch = vitkit.preprocess(model, img)
    torch.testing.assert_close(batch[0], _by_hand(img, 16, [0.5] * 3, [0.5] * 3), rtol=0, atol=1e-5)
    with torch.no_grad():
        assert model.eval()(batch).shape == (1, 1000)
    # a checkpoint written by vitkit: load_model gives the model its record, as does the path itself
    vitkit.save_pretrained(model, tmp_path / "saved", metadata=row.metadata())
    again = vitkit.load_model(tmp_path / "saved")
    assert again.preprocessing == row.preprocessing() == hub.preprocessing_of(tmp_path / "saved")
    bare = registry.create_model("vit_s16", **SMALL)  # built without weights: the paper's [-1, 1] at its size
    assert hub.preprocessing_of(bare) == Preprocessing(img_size=16)
