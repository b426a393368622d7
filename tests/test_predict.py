"""Prediction: a saved tiny model on real photos (scikit-learn's sample images), labels, JSON and bad files."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitkit.checkpoint.native import save_pretrained
from vitkit.cli import main
from vitkit.data import load_image
from vitkit.models import ResNet, VisionTransformer
from vitkit.predict import load_for_inference, predict_files, read_labels
from vitkit.preprocessing import read_preprocessing

# The two photos that ship with scikit-learn (a development dependency), located without importing it.
_SKLEARN = importlib.util.find_spec("sklearn")
if _SKLEARN is None:
    pytest.skip("scikit-learn (a dev dependency) provides the sample photos", allow_module_level=True)
PHOTOS = [Path(_SKLEARN.submodule_search_locations[0]) / "datasets" / "images" / n for n in ("china.jpg", "flower.jpg")]
NAMES = ["ant", "bee", "cat", "dog", "eel", "fox", "gnu"]


def tiny_classifier(**overrides) -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, width=32, depth=1, num_heads=2, mlp_dim=64, num_classes=7)
    with torch.no_grad():  # the head is zero-initialised: give it weights so the classes differ
        torch.nn.init.normal_(model.head.weight, std=1.0)
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt")
    meta = {"class_names": NAMES, "img_size": 32, "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "in_chans": 3}
    return save_pretrained(tiny_classifier(), path, metadata=meta)


def test_photos_get_sorted_top_k_probabilities_matching_the_model(checkpoint):
    model, prep, metadata = load_for_inference(checkpoint)
    assert prep.class_names == NAMES and prep.img_size == 32 and metadata["class_names"] == NAMES
    results = predict_files(model, PHOTOS, prep, k=3, batch_size=1)
    assert [r.file for r in results] == [str(p) for p in PHOTOS]
    for r, photo in zip(results, PHOTOS):
        assert r.error is None and len(r.top) == 3
        probs = [p for _, _, p in r.top]
        assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-6
        with torch.no_grad():  # the same answer as the model on the image resized to 32x32, scaled to [-1, 1]
            x = torch.from_numpy(np.array(load_image(photo).resize((32, 32), Image.BILINEAR)))  # (H, W, 3)
            x = (x.permute(2, 0, 1).float() / 255 - 0.5) / 0.5
            expected = model(x[None]).softmax(-1)[0].topk(3)
        assert [i for i, _, _ in r.top] == expected.indices.tolist()
        assert [name for _, name, _ in r.top] == [NAMES[i] for i in expected.indices.tolist()]
        torch.testing.assert_close(torch.tensor(probs), expected.values, rtol=1e-4, atol=1e-5)
    assert results[0].top != results[1].top


def test_batching_does_not_change_predictions(checkpoint):
    model, prep, _ = load_for_inference(checkpoint)
    one = predict_files(model, PHOTOS * 2, prep, k=7, batch_size=1)
    many = predict_files(model, PHOTOS * 2, prep, k=7, batch_size=4)
    for a, b in zip(one, many):
        assert [i for i, _, _ in a.top] == [i for i, _, _ in b.top]
        torch.testing.assert_close(torch.tensor([p for *_, p in a.top]), torch.tensor([p for *_, p in b.top]))
        assert sum(p for *_, p in a.top) == pytest.approx(1.0, abs=1e-5)  # k = all classes


def test_cli_json_reports_a_corrupt_file_and_predicts_the_rest(checkpoint, tmp_path, capsys):
    corrupt = tmp_path / "corrupt.jpg"
    corrupt.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    files = [str(PHOTOS[0]), str(corrupt), str(PHOTOS[1])]
    status = main(["predict", str(checkpoint), *files, "--json", "--top-k", "2", "--batch-size", "2"])
    captured = capsys.readouterr()
    assert status == 2  # a user's mistake, as in every command
    doc = json.loads(captured.out)
    assert [d["file"] for d in doc] == files
    assert "corrupt.jpg" in doc[1]["error"] and "predictions" not in doc[1]
    for d in (doc[0], doc[2]):
        probs = [p["probability"] for p in d["predictions"]]
        assert len(probs) == 2 and probs[0] >= probs[1] and all(p["label"] in NAMES for p in d["predictions"])
    assert "corrupt.jpg" in captured.err and "cannot read image" in captured.err


def test_cli_a_corrupt_image_alone_is_one_error_line_and_status_2(checkpoint, tmp_path, capsys):
    corrupt = tmp_path / "corrupt.jpg"
    corrupt.write_bytes(b"not an image")
    assert main(["predict", str(checkpoint), str(corrupt)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing predicted: no blank line either
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"vitkit predict: error: {corrupt}: cannot read image"), lines


def test_cli_text_output_with_a_labels_file(checkpoint, tmp_path, capsys):
    labels = tmp_path / "labels.txt"
    labels.write_text("\n".join(n.upper() for n in NAMES) + "\n\n")
    assert read_labels(labels) == [n.upper() for n in NAMES]
    assert main(["predict", str(checkpoint), str(PHOTOS[0]), "--labels", str(labels), "--top-k", "9"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == str(PHOTOS[0]) and len(out) == 8  # top-k is capped at the 7 classes
    assert all(line.strip().split()[1] in [n.upper() for n in NAMES] for line in out[1:])
    percents = [float(line.split()[-1].rstrip("%")) for line in out[1:]]
    assert percents == sorted(percents, reverse=True)
    short = tmp_path / "short.txt"
    short.write_text("a\nb\n")
    assert main(["predict", str(checkpoint), str(PHOTOS[0]), "--labels", str(short)]) == 2
    assert "2 class names given but the model has 7 classes" in capsys.readouterr().err


def test_cli_a_folder_is_every_image_inside_sorted(checkpoint, tmp_path, capsys):
    folder = tmp_path / "photos"
    (folder / "b").mkdir(parents=True)
    (folder / ".cache").mkdir()
    names = {"b/2_flower.jpg": PHOTOS[1], "1_china.jpg": PHOTOS[0], "3.PNG": PHOTOS[1], ".cache/hidden.jpg": PHOTOS[0]}
    for name, photo in names.items():
        (folder / name).write_bytes(photo.read_bytes())
    (folder / "notes.txt").write_text("not an image")
    assert main(["predict", str(checkpoint), str(folder), "--json", "--top-k", "3"]) == 0
    from_folder = json.loads(capsys.readouterr().out)
    expected = [str(folder / n) for n in ("1_china.jpg", "3.PNG", "b/2_flower.jpg")]  # sorted, hidden skipped
    assert [d["file"] for d in from_folder] == expected
    assert main(["predict", str(checkpoint), *expected, "--json", "--top-k", "3"]) == 0  # the same, listed
    assert json.loads(capsys.readouterr().out) == from_folder


@pytest.mark.parametrize("kind", ["missing file", "empty folder"])
def test_cli_a_missing_image_or_an_empty_folder_is_one_line_exit_2(checkpoint, tmp_path, capsys, kind):
    target = tmp_path / ("nope.jpg" if kind == "missing file" else "empty")
    if kind == "empty folder":
        target.mkdir()
        (target / "readme.txt").write_text("no images here")
    capsys.readouterr()
    assert main(["predict", str(checkpoint), str(PHOTOS[0]), str(target)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"vitkit predict: error: {target}: "), captured.err
    assert ("no such image file" if kind == "missing file" else "no image files") in lines[0]
    assert captured.out == ""  # nothing predicted: the mistake is reported before the model runs


def test_defaults_without_metadata():
    prep = read_preprocessing({}, tiny_classifier().config.to_dict())
    assert (prep.img_size, prep.mean, prep.std, prep.class_names) == (32, [0.5] * 3, [0.5] * 3, None)
    resnet = ResNet(layers=(1,), width_factor=0.5, num_classes=3, in_chans=1, img_size=24)
    prep = read_preprocessing({"img_size": 48, "mean": 0.2, "std": [0.3]}, resnet.config.to_dict())
    assert (prep.img_size, prep.in_chans, prep.mean, prep.std) == (48, 1, [0.2], [0.3])
    with pytest.raises(ValueError, match="in_chans=3 but the model takes 1"):
        read_preprocessing({"in_chans": 3}, resnet.config.to_dict())
