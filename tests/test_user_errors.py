"""Bad inputs a user meets on the command line end in one line naming the file (or key) and the cause.

Corrupt or truncated weights (.safetensors, .npz, torch files), a config.json that is not a JSON object, an
unreadable image (with and without DataLoader workers), and config values out of range or given twice.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import save_file

from vitkit import UserError, VisionTransformer
from vitkit.checkpoint import save_pretrained
from vitkit.checkpoint.hf import save_hf
from vitkit.cli import main
from vitkit.data import DataConfig, build_datasets
from vitkit.hub import load_model
from vitkit.train import load_config
from vitkit.train.config_files import _UniqueKeyLoader

TINY = dict(img_size=32, patch_size=8, width=32, depth=2, num_heads=4, mlp_dim=64, num_classes=2)
COMMANDS = ("eval", "predict", "convert")


def one_line_error(capsys, argv: list[str], *needles: str) -> str:
    """Run the command line; it must exit 2 with one stderr line that names every needle and no traceback."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"vitkit {argv[0]}: error: "), err
    for needle in needles:
        assert needle in lines[0], (needle, err)
    return lines[0]


def argv_for(command: str, checkpoint: Path, tmp_path: Path) -> list[str]:
    if command == "eval":
        return ["eval", str(checkpoint), "--data", "digits"]
    if command == "predict":  # a readable image: the checkpoint is what fails
        image = tmp_path / "image.png"
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(image)
        return ["predict", str(checkpoint), str(image)]
    return ["convert", str(checkpoint), str(tmp_path / "converted")]


def truncate(path: Path, keep: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:keep])


# ------------------------------------------------------------------------------------------------- weights
def corrupt_safetensors(tmp_path: Path, kind: str) -> tuple[Path, Path]:
    """(what the user names, the broken file) for a vitkit dir, an HF dir or a timm .safetensors file."""
    model = VisionTransformer(**TINY)
    if kind == "vitkit":
        src = save_pretrained(model, tmp_path / "vitkit_dir")
        broken = src / "model.safetensors"
    elif kind == "hf":
        src = save_hf(model, tmp_path / "hf_dir")
        broken = src / "model.safetensors"
    else:
        (tmp_path / "timm").mkdir()
        src = broken = tmp_path / "timm" / "vit.safetensors"
        save_file(model.state_dict(), str(src))
    truncate(broken)
    return src, broken


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", ["vitkit", "hf", "timm"])
def test_truncated_safetensors_is_one_line_naming_the_file(tmp_path, capsys, kind, command):
    src, broken = corrupt_safetensors(tmp_path, kind)
    one_line_error(capsys, argv_for(command, src, tmp_path), str(broken), "not a readable safetensors file")


def test_garbage_safetensors_header_and_load_model(tmp_path):
    src = save_pretrained(VisionTransformer(**TINY), tmp_path / "run")
    (src / "model.safetensors").write_bytes(b"\xff" * 64)  # a header length far beyond the file
    with pytest.raises(UserError, match=r"model\.safetensors: not a readable safetensors file"):
        load_model(src)


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    "text, cause",
    [("[1, 2]", "found a JSON array"), ("null", "found null"), ("{not json", "not valid JSON")],
    ids=["list", "null", "not-json"],
)
@pytest.mark.parametrize("kind", ["vitkit", "hf"])
def test_config_json_that_is_not_an_object(tmp_path, capsys, kind, text, cause, command):
    model = VisionTransformer(**TINY)
    src = save_pretrained(model, tmp_path / "ckpt") if kind == "vitkit" else save_hf(model, tmp_path / "ckpt")
    (src / "config.json").write_text(text)
    one_line_error(capsys, argv_for(command, src, tmp_path), str(src / "config.json"), cause)
    with pytest.raises(UserError, match="config.json"):
        load_model(src)
    with pytest.raises(UserError, match="config.json"):  # also when the weights file inside is named
        load_model(src / "model.safetensors")


def test_vitkit_config_with_a_model_that_is_not_an_object(tmp_path):
    src = save_pretrained(VisionTransformer(**TINY), tmp_path / "ckpt")
    (src / "config.json").write_text('{"format": "vitkit", "model": 3}')
    with pytest.raises(UserError, match=r"config\.json: expected a vitkit config"):
        load_model(src)


def damaged_npz(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / f"{kind}.npz"
    np.savez(path, **{"Transformer/posembed_input/pos_embedding": np.zeros((1, 17, 32), np.float32)})
    raw = bytearray(path.read_bytes())
    if kind == "truncated":
        path.write_bytes(bytes(raw[: len(raw) // 2]))
    elif kind == "empty":
        path.write_bytes(b"")
    else:  # the zip directory is intact, one member's bytes are not: a CRC mismatch on reading it
        raw[len(raw) // 4 : len(raw) // 4 + 16] = b"\xff" * 16
        path.write_bytes(bytes(raw))
    return path


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(
    "kind, cause",
    [("truncated", "not a readable .npz archive"), ("empty", "empty file"), ("bad-member", "is corrupt or truncated")],
)
def test_damaged_npz_is_one_line_naming_the_file(tmp_path, capsys, kind, cause, command):
    path = damaged_npz(tmp_path, kind)
    one_line_error(capsys, argv_for(command, path, tmp_path), str(path), cause)
    with pytest.raises(UserError, match=cause):
        load_model(path)


class Payload:
    """A class a pickle can name: loading it would need an import, which weights_only=True refuses."""


def unloadable_torch_file(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / {"custom-class": "model.pth", "garbage": "model.pt", "empty": "pytorch_model.bin"}[kind]
    if kind == "custom-class":
        torch.save({"head.weight": torch.zeros(2, 32), "extra": Payload()}, path)
    elif kind == "garbage":
        path.write_bytes(b"\x00\x01 not a torch file " * 8)
    else:
        path.write_bytes(b"")
    return path


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("kind", ["custom-class", "garbage", "empty"])
def test_unloadable_torch_file_never_suggests_weights_only_false(tmp_path, capsys, kind, command):
    path = unloadable_torch_file(tmp_path, kind)
    line = one_line_error(
        capsys, argv_for(command, path, tmp_path), str(path), "not a plain tensor file readable with weights_only=True"
    )
    assert "weights_only=False" not in line and "weights_only` set to `False" not in line
    if kind == "custom-class":
        assert "Payload" in line  # what the file would make Python import is named
    with pytest.raises(UserError) as info:
        load_model(path)
    assert "weights_only=False" not in str(info.value)


# ---------------------------------------------------------------------------------------------------- data
def image_folder(root: Path, classes: tuple[str, ...] = ("cat", "dog"), corrupt: bool = True) -> Path:
    """Three small PNGs per class; with corrupt, the last one of the last class is not a PNG at all."""
    for label, name in enumerate(classes):
        (root / name).mkdir(parents=True)
        for i in range(3):
            pixels = np.full((12, 12, 3), 60 * label + 20 * i, np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")
    if corrupt:
        (root / classes[-1] / "2.png").write_bytes(b"this is not a png")
    return root


@pytest.mark.parametrize("workers", [0, 2])
def test_corrupt_image_is_the_same_line_with_and_without_workers(tmp_path, capsys, workers):
    root = image_folder(tmp_path / "images")
    ckpt = save_pretrained(VisionTransformer(**TINY), tmp_path / "ckpt", metadata={"class_names": ["cat", "dog"]})
    argv = ["eval", str(ckpt), "--data", str(root), f"data.val_root={root}", f"data.num_workers={workers}"]
    line = one_line_error(capsys, [*argv, "--batch-size", "2"], str(root / "dog" / "2.png"), "cannot read image")
    assert "DataLoader" not in line and "Caught" not in line
    assert line.endswith("set data.skip_corrupt=true to skip unreadable images")


def test_corrupt_image_in_training_with_workers(tmp_path, capsys):
    root = image_folder(tmp_path / "images")
    config = tmp_path / "folder.yaml"
    doc = {
        "model": {"name": "vit_ti16", "patch_size": 8, "width": 32, "depth": 2, "num_heads": 2, "mlp_dim": 64},
        "data": {"source": "folder", "root": str(root), "val_root": str(root), "img_size": 16, "num_workers": 2},
        "optim": {"batch_size": 6},
        "schedule": {"steps": 2},
        "run": {"out_dir": str(tmp_path / "runs"), "progress": False, "plots": False, "threads": 1},
    }
    config.write_text(yaml.safe_dump(doc))
    line = one_line_error(capsys, ["train", str(config)], str(root / "dog" / "2.png"), "cannot read image")
    assert "Caught" not in line


def test_single_class_folder_warns_naming_root_and_class(tmp_path):
    root = image_folder(tmp_path / "images", classes=("only",), corrupt=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_datasets(DataConfig(source="folder", root=str(root), val_fraction=0.4))
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert any(str(root) in m and "'only'" in m and "one class" in m for m in messages), messages


def test_two_classes_do_not_warn(tmp_path):
    root = image_folder(tmp_path / "images", corrupt=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_datasets(DataConfig(source="folder", root=str(root), val_fraction=0.4))


# -------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "override, expected",
    [
        ("run.threads=-1", "run.threads=-1: expected >= 0"),
        ("run.eval_every=-5", "run.eval_every=-5: expected >= 0"),
        ("run.save_every=-1", "run.save_every=-1: expected >= 0"),
        ("run.log_every=-1", "run.log_every=-1: expected >= 0"),
        ("run.eval_batch_size=0", "run.eval_batch_size=0: expected >= 1"),
        ("optim.weight_decay=-0.1", "optim.weight_decay=-0.1: expected >= 0"),
        ("optim.lr=-1e-3", "optim.lr=-0.001: expected >= 0"),
        ("optim.grad_clip=-1", "optim.grad_clip=-1.0: expected >= 0"),
        ("optim.lr=nan", "optim.lr=nan: expected >= 0"),
        ("optim.label_smoothing=-0.1", "optim.label_smoothing=-0.1: expected a value in [0, 1)"),
        ("optim.label_smoothing=1", "optim.label_smoothing=1.0: expected a value in [0, 1)"),
        ("schedule.warmup_steps=-10", "schedule.warmup_steps=-10: expected >= 0"),
        ("schedule.steps=-3", "schedule.steps=-3: expected >= 0"),
    ],
)
def test_out_of_range_config_values_name_the_key(capsys, override, expected):
    one_line_error(capsys, ["train", "digits", override], "command line: ", expected)
    with pytest.raises(UserError, match=re.escape(expected)):
        load_config("digits", [override])


def test_boundary_config_values_are_accepted():
    cfg = load_config(
        "digits",
        ["optim.weight_decay=0", "optim.grad_clip=0", "optim.label_smoothing=0.99", "run.eval_batch_size=1"],
    )
    assert cfg.optim.label_smoothing == 0.99 and cfg.run.eval_batch_size == 1


def test_duplicate_yaml_key_names_the_key_and_line(tmp_path, capsys):
    config = tmp_path / "twice.yaml"
    config.write_text("optim:\n  lr: 1.0e-3\n  batch_size: 16\n  lr: 3.0e-4\nschedule:\n  steps: 2\n")
    line = one_line_error(capsys, ["train", str(config)], str(config), "duplicate key 'lr'", "line 4")
    assert "line 2" in line  # where the first one is
    config.write_text("data: {source: digits, source: synthetic}\n")  # two on one line, in a flow mapping
    with pytest.raises(UserError, match="duplicate key 'source'"):
        load_config(config)


def _laughs(levels: int) -> str:
    """The "billion laughs" as one flow list: each level nine aliases of the one before, 9**levels values in all."""
    items = ["&l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    items += [f"&l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return f"[{', '.join(items)}]"


@pytest.mark.parametrize("command", ["train", "sweep", "report"])
def test_yaml_whose_aliases_expand_past_the_bound_is_refused_before_it_is_built(tmp_path, capsys, command):
    """A few lines of aliases stand for 9**9 values: refused in one line, in every command that reads YAML."""
    target = tmp_path / "laughs.yaml"
    if command == "report":  # a run directory whose config.yaml someone replaced
        (tmp_path / "run").mkdir()
        target = tmp_path / "run" / "config.yaml"
    where = "config: digits\ngrid: {optim.lr: %s}\n" if command == "sweep" else "optim: {lr: %s}\n"
    target.write_text(where % _laughs(9))
    argv = [command, str(target.parent if command == "report" else target)]
    one_line_error(capsys, argv, str(target), "more than 10,000 values with each alias (*name) counted")
    target.write_text(where % "&x [*x]")  # an alias inside its own anchor
    one_line_error(capsys, argv, str(target), "or an alias inside itself")


def test_yaml_size_is_bounded_and_aliases_within_the_bound_still_work(tmp_path, capsys):
    config = tmp_path / "big.yaml"
    config.write_text("# " + "x" * (1 << 20) + "\noptim: {lr: 1.0e-3}\n")
    size = f"{config.stat().st_size:,} bytes"
    one_line_error(capsys, ["train", str(config)], str(config), size, "at most 1,048,576 bytes")
    config.write_text("optim: {lr: " + "[" * 5000 + "]" * 5000 + "}\n")
    one_line_error(capsys, ["train", str(config)], str(config), "nested too deeply to read")
    config.write_text("data: {mean: &half [0.5], std: *half}\noptim: {lr: 2.0e-3}\n")  # an alias, as YAML allows
    cfg = load_config(config)
    assert cfg.optim.lr == 2.0e-3 and list(cfg.data.std) == [0.5]
    config.write_text(f"optim: {{lr: {list(range(10_001))}}}\n")  # no alias at all, just too many values
    one_line_error(capsys, ["train", str(config)], str(config), "more than 10,000 values")


def test_a_long_error_is_printed_as_its_two_ends(tmp_path, capsys):
    """An error quoting a large value (a config's list of 5,000 numbers for one number) stays a readable line."""
    config = tmp_path / "list.yaml"
    config.write_text(f"optim: {{lr: {list(range(5000))}}}\n")
    line = one_line_error(capsys, ["train", str(config)], str(config), "optim.lr", "characters ...]")
    assert len(line) < 2200


def test_yaml_merge_keys_may_still_be_overridden():
    # a merged mapping's keys are defaults the mapping itself may override; that is not a duplicate
    doc = yaml.load("a: &b {lr: 1, x: 2}\nc:\n  <<: *b\n  lr: 2\n", Loader=_UniqueKeyLoader)
    assert doc["c"] == {"lr": 2, "x": 2}


def test_invalid_yaml_is_one_line(tmp_path, capsys):
    config = tmp_path / "broken.yaml"
    config.write_text("optim:\n  lr: [1, 2\nrun: 3\n")
    one_line_error(capsys, ["train", str(config)], str(config), "not valid YAML", "line ")


def test_a_bug_while_loading_a_config_keeps_its_traceback(monkeypatch, capsys):
    import vitkit.train.overrides as overrides_mod

    def broken_coerce(value, tp, key):  # an internal invariant breaking, not a bad value from the user
        raise ValueError("internal: coercion table out of step")

    monkeypatch.setattr(overrides_mod, "_coerce", broken_coerce)
    with pytest.raises(ValueError, match="internal: coercion table") as caught:
        load_config("digits", ["optim.lr=3e-4"])
    assert not isinstance(caught.value, UserError)  # not dressed up as the user's mistake
    with pytest.raises(ValueError, match="internal: coercion table"):  # the command line shows the traceback too
        main(["train", "digits", "optim.lr=3e-4"])


def test_a_bug_inside_a_section_check_keeps_its_traceback(monkeypatch):
    import vitkit.train.config as config_mod

    def broken_check(self):
        raise TypeError("internal: a check compared a str with an int")

    monkeypatch.setattr(config_mod.OptimConfig, "__post_init__", broken_check)
    with pytest.raises(TypeError, match="internal: a check compared") as caught:
        load_config("digits")
    assert not isinstance(caught.value, UserError)


def test_a_user_error_while_loading_names_where_it_came_from_and_keeps_its_kind(tmp_path):
    from vitkit.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^command line: unknown config key 'optim\.lrr'; did you mean optim\.lr"):
        load_config("digits", ["optim.lrr=1"])
    config = tmp_path / "typo.yaml"
    config.write_text("optim:\n  lrr: 1\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(config))}: unknown config key 'optim\.lrr'"):
        load_config(config)
