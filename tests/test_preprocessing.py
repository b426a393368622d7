"""The one preprocessing record: JSON round trip, and every export carrying it so that the peer library
(transformers' pipeline, timm's config, an ONNX reader) preprocesses as vitkit.predict does."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitkit.checkpoint import convert, read_checkpoint, save_pretrained
from vitkit.errors import UserError
from vitkit.models import VisionTransformer
from vitkit.predict import load_for_inference, predict_files
from vitkit.preprocessing import Preprocessing, from_hf_processor, from_timm_config
from vitkit.pretrained import PRETRAINED

_SKLEARN = importlib.util.find_spec("sklearn")
PHOTO = Path(_SKLEARN.submodule_search_locations[0]) / "datasets" / "images" / "china.jpg" if _SKLEARN else None
NAMES = ["ant", "bee", "cat", "dog", "eel", "fox", "gnu"]
IMAGENET = dict(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])


def classifier(img_size: int = 32) -> VisionTransformer:
    torch.manual_seed(0)
    dims = dict(patch_size=8, width=32, depth=1, num_heads=2, mlp_dim=64, num_classes=7)
    model = VisionTransformer(img_size=img_size, **dims)
    with torch.no_grad():  # the head is zero-initialised: give it weights so the classes differ
        torch.nn.init.normal_(model.head.weight, std=1.0)
    return model.eval()


def photo() -> Image.Image:
    if PHOTO is None:
        pytest.skip("scikit-learn (a dev dependency) provides the sample photo")
    return Image.open(PHOTO).convert("RGB")


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    meta = {"class_names": NAMES, "img_size": 32, **IMAGENET}
    return save_pretrained(classifier(), tmp_path / "src", metadata=meta)


def test_record_round_trips_through_json_and_refuses_unknown_keys():
    prep = Preprocessing(24, [0.1, 0.2, 0.3], [0.4, 0.5, 0.6], 3, 0.875, "bicubic", ["a", "b"])
    assert Preprocessing.from_dict(json.loads(json.dumps(prep.to_dict()))) == prep
    rect = Preprocessing((16, 32))
    assert Preprocessing.from_dict(json.loads(json.dumps(rect.to_dict()))) == rect and rect.size == (16, 32)
    with pytest.raises(UserError, match=r"unknown preprocessing keys \['crop'\]"):
        Preprocessing.from_dict({"img_size": 8, "crop": 0.9})
    with pytest.raises(UserError, match="interpolation"):
        Preprocessing(8, interpolation="lanczos")
    with pytest.raises(UserError, match="one value per channel"):
        Preprocessing(8, mean=[0.5])


def test_the_checkpoint_record_is_what_predict_uses(checkpoint):
    ckpt = read_checkpoint(checkpoint)
    _, prep, _ = load_for_inference(checkpoint)
    assert ckpt.preprocessing == prep == Preprocessing(32, IMAGENET["mean"], IMAGENET["std"], class_names=NAMES)


def test_hf_export_is_classified_by_transformers_pipeline_as_by_vitkit(checkpoint, tmp_path):
    transformers = pytest.importorskip("transformers")
    image = photo()
    image.save(tmp_path / "photo.png")
    model, prep, _ = load_for_inference(checkpoint)
    ours = predict_files(model, [tmp_path / "photo.png"], prep, k=3)[0]

    hf_dir = convert(checkpoint, tmp_path / "hf", to="hf")
    processor = json.loads((hf_dir / "preprocessor_config.json").read_text())
    assert processor["image_processor_type"] == "ViTImageProcessor" and processor["image_mean"] == IMAGENET["mean"]
    pipe = transformers.pipeline("image-classification", model=str(hf_dir), device="cpu")
    theirs = pipe(image, top_k=3)
    assert [r["label"] for r in theirs] == [name for _, name, _ in ours.top]
    np.testing.assert_allclose([r["score"] for r in theirs], [p for _, _, p in ours.top], rtol=1e-4, atol=1e-5)
    assert read_checkpoint(hf_dir).preprocessing == prep  # and reading the export back gives the same record


def test_hf_processor_with_a_centre_crop_is_convnexts_rule(tmp_path):
    transformers = pytest.importorskip("transformers")
    # 64x48: the long side scales to a whole 53.33 -> 53 pixels, which transformers truncates and vitkit rounds alike
    image = photo().resize((64, 48), Image.Resampling.BILINEAR)
    image.save(tmp_path / "photo.png")
    meta = {"class_names": NAMES, "img_size": 32, "crop_fraction": 0.8, **IMAGENET}  # 32 / 0.8: a 40-pixel side
    src = save_pretrained(classifier(), tmp_path / "src", metadata=meta)
    model, prep, _ = load_for_inference(src)
    ours = predict_files(model, [tmp_path / "photo.png"], prep, k=7)[0]
    hf_dir = convert(src, tmp_path / "hf", to="hf")
    assert json.loads((hf_dir / "preprocessor_config.json").read_text())["crop_pct"] == 0.8
    theirs = transformers.pipeline("image-classification", model=str(hf_dir), device="cpu")(image, top_k=7)
    assert [r["label"] for r in theirs] == [name for _, name, _ in ours.top]
    np.testing.assert_allclose([r["score"] for r in theirs], [p for _, _, p in ours.top], rtol=1e-4, atol=1e-5)
    assert read_checkpoint(hf_dir).preprocessing == prep


def test_timm_export_carries_the_record_in_pretrained_cfg(checkpoint, tmp_path):
    prep = read_checkpoint(checkpoint).preprocessing
    weights = convert(checkpoint, tmp_path / "timm", to="timm")
    doc = json.loads(weights.with_name("config.json").read_text())
    pre = doc["pretrained_cfg"]
    assert (pre["mean"], pre["std"], pre["input_size"], pre["crop_pct"], pre["interpolation"], pre["num_classes"]) == (
        IMAGENET["mean"],
        IMAGENET["std"],
        [3, 32, 32],
        1.0,
        "bilinear",
        7,
    )
    assert pre["label_names"] == doc["label_names"] == NAMES
    assert read_checkpoint(weights.parent).preprocessing == prep
    # timm's own spelling (label_names as an id map, crop_pct, bicubic) reads into the record's names
    said = from_timm_config({"label_names": {"0": "x", "1": "y"}, "pretrained_cfg": {"crop_pct": 0.9, **IMAGENET}})
    assert said == {"class_names": ["x", "y"], "crop_fraction": 0.9, **IMAGENET}


def test_onnx_export_stores_the_record_in_metadata_props(checkpoint, tmp_path):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    from vitkit.export import export_onnx, read_onnx_preprocessing

    model, prep, _ = load_for_inference(checkpoint)
    path = export_onnx(model, tmp_path / "m.onnx", preprocessing=prep)
    props = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert json.loads(props["class_names"]) == NAMES
    assert read_onnx_preprocessing(path) == prep
    pytest.importorskip("onnxruntime")
    assert read_onnx_preprocessing(export_onnx(model, tmp_path / "q.onnx", preprocessing=prep, int8=True)) == prep


def test_hf_processor_spellings():
    doc = {"size": {"height": 384, "width": 384}, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "resample": 3}
    assert from_hf_processor(doc) == {"img_size": 384, "mean": [0.5] * 3, "std": [0.5] * 3, "interpolation": "bicubic"}
    with pytest.raises(UserError, match="rescale_factor"):
        from_hf_processor({"rescale_factor": 1.0})


def test_pretrained_rows_are_records():
    row = PRETRAINED["vit_b16.augreg2_in21k_ft_in1k"]
    prep = row.preprocessing()
    assert (prep.img_size, prep.crop_fraction, prep.interpolation, len(prep.class_names or ())) == (
        224,
        0.9,
        "bicubic",
        1000,
    )
    meta = row.metadata()
    assert Preprocessing.from_dict({k: meta[k] for k in prep.to_dict()}) == prep
    assert meta["pretrained_tag"] == row.tag


def test_a_training_runs_data_info_is_the_record_its_checkpoint_is_read_with(tmp_path):
    from vitkit.data import DataConfig, build_datasets
    from vitkit.preprocessing import from_data_info

    _, _, info = build_datasets(DataConfig(source="digits"))
    prep = from_data_info(info)
    assert (prep.img_size, prep.in_chans, prep.mean, prep.class_names) == (16, 1, [0.5], [str(k) for k in range(10)])
    model = VisionTransformer(img_size=16, patch_size=4, in_chans=1, width=32, depth=1, num_heads=2, num_classes=10)
    path = save_pretrained(model, tmp_path / "run", metadata={**info.to_dict(), **prep.to_dict(), "step": 3})
    assert read_checkpoint(path).preprocessing == prep == load_for_inference(path)[1]
