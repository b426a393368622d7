"""The command line as a newcomer meets it: on the PATH after the set-up, --version, warnings as one line each,
`train --data`, and a missing optional package named with the pip line that installs it."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

import vitkit
from vitkit import cli, cli_args
from vitkit.checkpoint.native import save_pretrained
from vitkit.cli import main
from vitkit.models import VisionTransformer
from vitkit.optional import EXTRAS, PACKAGES, MissingDependencyError, require
from vitkit.train import load_config

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "vitkit"
TINY = dict(img_size=16, patch_size=4, width=32, depth=1, num_heads=2, mlp_dim=64, num_classes=3)


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="Python >= 3.11 reads TOML")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def one_line_error(capsys, argv: list[str]) -> str:
    """Run the command line: exit status 2 and exactly one stderr line, the command's error, no traceback."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"vitkit {argv[0]}: error: "), err
    return lines[0]


# ------------------------------------------------------------------------------------------ set-up, version
def test_version_is_the_distributions_and_the_packages(capsys, monkeypatch):
    declared = pyproject()["project"]["version"]
    assert vitkit.__version__ == declared  # the fallback for a source tree says the same as pyproject
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"vitkit {cli_args.version()}\n"

    import importlib.metadata

    def not_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert cli_args.version() == declared


def test_the_readme_examples_run_in_a_new_shell_after_activating_the_venv():
    """What the README tells a newcomer after `make train`, in a new shell that inherits nothing from make."""
    if not (ROOT / ".venv" / "bin" / "activate").is_file():
        pytest.skip("no .venv here (made by `make train` / `make test`)")
    fresh = {"HOME": os.environ.get("HOME", "/tmp"), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1"}
    script = "source .venv/bin/activate && command -v vitkit && vitkit --version && vitkit models vit_ti16"
    proc = subprocess.run(["bash", "-c", script], cwd=ROOT, env=fresh, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    where, version, header, row = proc.stdout.splitlines()[:4]
    assert Path(where).resolve() == (ROOT / ".venv" / "bin" / "vitkit").resolve()
    assert version == f"vitkit {pyproject()['project']['version']}"
    assert header.split()[:2] == ["name", "params"] and row.split()[:2] == ["vit_ti16", "5,717,416"]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("target", ["install", "install-dev", "train"])
def test_the_set_up_targets_end_by_saying_how_to_put_vitkit_on_the_path(target):
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}  # not under make's
    argv = ["make", "--no-print-directory", "-n", target]
    dry = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout
    last = dry.strip().splitlines()[-1]
    printed = subprocess.run(["bash", "-c", last], capture_output=True, text=True, check=True).stdout
    assert "source .venv/bin/activate" in printed and "PATH" in printed


# ------------------------------------------------------------------------------------------------ warnings
def odd_size_checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    """A ViT at 18 px over 4 px patches (a 2-pixel border is dropped: a warning), and an image to predict."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the border warning, here as the command line will show it
        model = VisionTransformer(**{**TINY, "img_size": 18})
    ckpt = save_pretrained(model, tmp_path / "odd", metadata={"img_size": 18})
    image = tmp_path / "image.png"
    Image.fromarray(np.full((10, 12, 3), 99, np.uint8)).save(image)
    return ckpt, image


def test_a_warning_is_one_line_shown_once_and_the_handler_is_restored(tmp_path, capsys):
    ckpt, image = odd_size_checkpoint(tmp_path)
    handler, filters = warnings.showwarning, list(warnings.filters)
    assert main(["predict", str(ckpt), str(image)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "vitkit predict: warning: ViTConfig: img_size (18, 18) is not a multiple of the (4, 4) pixels per token; "
        "the border that does not fill a patch is dropped"
    ]
    assert warnings.showwarning is handler and warnings.filters == filters  # nothing left behind
    with warnings.catch_warnings():  # the filters are the caller's: an ignored warning stays ignored
        warnings.simplefilter("ignore")
        assert main(["predict", str(ckpt), str(image)]) == 0
    assert capsys.readouterr().err == ""


def test_importing_the_cli_changes_no_warning_setting():
    code = (  # torch and numpy add filters of their own when imported: they are imported first
        "import warnings, numpy, torch; handler, filters = warnings.showwarning, list(warnings.filters); "
        "import vitkit.cli; print(warnings.showwarning is handler and warnings.filters == filters)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "True"


# ------------------------------------------------------------------------------------------------- outputs
def test_bench_is_no_command_the_benchmarks_are_scripts(capsys):
    """The benchmark harness left the package (python benchmarks/bench_vit.py): `vitkit bench` is argparse's
    unknown-command error, as any other word would be."""
    with pytest.raises(SystemExit) as info:
        main(["bench", "--model", "vit_ti16"])
    assert info.value.code == 2
    assert "invalid choice: 'bench'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- train --data
def image_folder(root: Path) -> Path:
    rng = np.random.default_rng(0)
    for c in range(2):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(5):
            pixels = np.full((12, 12, 3), 100 * c, np.uint8) + rng.integers(0, 40, (12, 12, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / f"c{c}" / f"{i}.png")
    return root


@pytest.fixture
def captured_training(monkeypatch):
    """The config `vitkit train` would train, without training it."""
    seen = []
    monkeypatch.setattr(cli, "_run_training", lambda cfg, command: seen.append(cfg) or 0)
    return seen


def test_train_data_is_the_data_section_other_commands_read(tmp_path, captured_training):
    folder = image_folder(tmp_path / "images")
    assert main(["train", "--data", str(folder)]) == 0
    assert main(["train", "digits", "--data", str(folder), "data.val_fraction=0.4"]) == 0  # overrides after it win
    by_hand = load_config("digits", ["data.source=folder", f"data.root={folder}"])
    assert captured_training[0] == by_hand
    assert captured_training[1] == load_config(
        "digits", ["data.source=folder", f"data.root={folder}", "data.val_fraction=0.4"]
    )

    recipe = tmp_path / "recipe.yaml"  # a config's data section, lists and nulls included
    section = {"source": "synthetic", "img_size": 12, "mean": [0.4, 0.5, 0.6], "flip": True, "root": None}
    recipe.write_text(yaml.safe_dump({"data": section, "optim": {"lr": 0.5}}))
    assert main(["train", "--data", str(recipe)]) == 0
    data = captured_training[2].data.to_dict()
    assert {key: data[key] for key in section} == section
    assert captured_training[2].optim == load_config("digits").optim  # only the data section is taken
    assert main(["train", "--data", "cifar10", "data.root=/data/c10"]) == 0
    assert (captured_training[3].data.source, captured_training[3].data.root) == ("cifar10", "/data/c10")


def test_train_data_that_is_not_a_source_folder_or_config_is_one_line(tmp_path, capsys, captured_training):
    """A --data that reads as a path and is not there says so first; a word that is no source lists what is."""
    for given, said in ((str(tmp_path / "nothing"), "no such folder"), ("./nothing", "no such folder")):
        line = one_line_error(capsys, ["train", "--data", given])
        assert line.startswith(f"vitkit train: error: --data {given!r}: {said} (expected a source (")
    line = one_line_error(capsys, ["train", "--data", "configs/none.yaml"])
    assert "--data 'configs/none.yaml': no such file (" in line
    line = one_line_error(capsys, ["train", "--data", "nothing"])
    assert line.startswith("vitkit train: error: --data 'nothing': expected a source (") and "no such" not in line
    assert captured_training == []


@pytest.mark.parametrize("command", ["train", "finetune", "eval", "fewshot", "inspect"])
def test_data_help_names_every_kind_of_data(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    data = text.split("--data DATA", 1)[1]
    assert all(kind in data for kind in ("digits", "shapes", "cifar10", "hf:NAME", "wds:DIR", "manifest:FILE", ".yaml"))


def test_train_on_an_image_folder_end_to_end(tmp_path, capsys):
    folder = image_folder(tmp_path / "images")
    out = tmp_path / "runs"
    argv = ["train", "--data", str(folder), "schedule.steps=1", "schedule.epochs=none", f"run.out_dir={out}"]
    assert main([*argv, "optim.batch_size=4", "run.plots=false", "run.progress=false"]) == 0
    assert "final held-out accuracy" in capsys.readouterr().out
    (run,) = out.iterdir()
    written = yaml.safe_load((run / "config.yaml").read_text())["data"]
    assert (written["source"], written["root"]) == ("folder", str(folder))
    model, metadata = vitkit.load_model(run, return_metadata=True)
    assert model.config.in_chans == 3 and metadata["class_names"] == ["c0", "c1"]  # the folder's RGB classes


# ---------------------------------------------------------------------------------------- optional packages
def test_every_optional_module_is_provided_by_the_extra_named():
    extras = pyproject()["project"]["optional-dependencies"]
    for module, extra in EXTRAS.items():
        package = PACKAGES.get(module, module)
        names = {re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0].lower() for req in extras[extra]}
        assert package.lower() in names, (module, extra, extras[extra])


def _optional_imports(path: Path) -> list[tuple[str, int, set[str]]]:
    """(optional module imported, line, modules require()d earlier in the same function) for a file.

    torch.utils.tensorboard counts as tensorboard; imports under `if TYPE_CHECKING:` are not run."""

    def top(name: str) -> str:
        return "tensorboard" if name.startswith("torch.utils.tensorboard") else name.split(".")[0]

    found = []
    tree = ast.parse(path.read_text())
    type_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    in_functions = {id(n) for f in functions for n in ast.walk(f)}
    module_level = [n for n in ast.walk(tree) if id(n) not in in_functions]
    for body in [module_level, *(list(ast.walk(f)) for f in functions)]:
        required = {
            n.args[0].value: n.lineno
            for n in body
            if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Name)
            and n.func.id in ("require", "_require")  # export.py's _require hands its module to require()
            and n.args
            and isinstance(n.args[0], ast.Constant)
        }
        for node in body:
            if id(node) in type_only or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                if top(name) in EXTRAS and (node.level if isinstance(node, ast.ImportFrom) else 0) == 0:
                    earlier = {m for m, line in required.items() if line < node.lineno}
                    found.append((top(name), node.lineno, earlier))
    return found


def test_every_optional_import_goes_through_require():
    checked = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        for module, line, required in _optional_imports(path):
            assert module in required, f"{path.relative_to(ROOT)}:{line} imports {module} without require({module!r})"
            checked += 1
    assert checked >= 5  # hf (2), augment, metrics, digits, and export's dynamic imports go through require()


def test_without_any_optional_package_every_module_imports_and_the_cli_starts():
    """An environment made by `make train` (no extras): nothing optional is imported before it is used."""
    code = (
        f"import sys; sys.modules.update(dict.fromkeys({sorted(EXTRAS)!r} + ['timm'])); "
        "import importlib, pkgutil, vitkit; "
        "names = [m.name for m in pkgutil.walk_packages(vitkit.__path__, 'vitkit.')]; "
        "[importlib.import_module(n) for n in names]; "
        "from vitkit.cli import build_parser, main; build_parser(); "
        "print(len(names), main(['models', 'vit_ti16']))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    count, status = proc.stdout.split()[-2:]
    assert int(count) > 40 and status == "0"


def test_require_names_the_package_and_its_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    with pytest.raises(MissingDependencyError) as info:
        require("sklearn", "regenerating digits.npz")
    assert str(info.value) == "regenerating digits.npz needs the scikit-learn package: pip install 'vitkit[dev]'"
    assert isinstance(info.value, ImportError) and isinstance(info.value, vitkit.UserError)
    with pytest.raises(KeyError, match="not an optional dependency"):
        require("numpy", "anything")  # a module missing from the table is a bug here, not a hint to the user


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return save_pretrained(VisionTransformer(**TINY), tmp_path_factory.mktemp("ckpt"))


@pytest.mark.parametrize(
    "argv, missing, expected",
    [
        (["export", "{ckpt}", "--onnx", "{tmp}/m.onnx"], "onnx", "ONNX export needs the onnx"),
        (["export", "{ckpt}", "--onnx", "{tmp}/m.onnx"], "onnxscript", "ONNX export needs the onnxscript"),
        (["export", "{ckpt}", "--onnx", "{tmp}/m.onnx"], "onnxruntime", "ONNX export needs the onnxruntime"),
        (["convert", "{ckpt}", "{tmp}/hf", "--to", "hf"], "transformers", "--to hf needs the transformers"),
    ],
    ids=["export-onnx", "export-onnxscript", "export-onnxruntime", "convert-hf"],
)
def test_a_missing_optional_package_is_one_line_with_the_pip_line(
    tiny_checkpoint, tmp_path, capsys, monkeypatch, argv, missing, expected
):
    monkeypatch.setitem(sys.modules, missing, None)  # as if not installed
    argv = [a.format(ckpt=tiny_checkpoint, tmp=tmp_path) for a in argv]
    line = one_line_error(capsys, argv)
    assert line == f"vitkit {argv[0]}: error: {expected} package: pip install 'vitkit[{EXTRAS[missing]}]'"
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


@pytest.mark.parametrize(
    "override, missing",
    [("data.randaugment_ops=2", "kornia"), ("run.tensorboard=true", "tensorboard")],
)
def test_a_training_lever_without_its_package_is_one_line(tmp_path, capsys, monkeypatch, override, missing):
    monkeypatch.setitem(sys.modules, missing, None)
    run = ["schedule.steps=1", "schedule.epochs=none", "schedule.warmup_steps=0", f"run.out_dir={tmp_path}"]
    argv = ["train", "digits", override, *run]
    line = one_line_error(capsys, argv)
    assert line.endswith(f"{override} needs the {missing} package: pip install 'vitkit[{EXTRAS[missing]}]'")


def test_the_library_raises_the_same_error_where_the_package_is_used(tmp_path, monkeypatch):
    """The routes below the command line: the export, the transformers model, the levers, the digits' source."""
    from vitkit.checkpoint.hf import save_hf, to_hf_model
    from vitkit.data.augment import load_randaugment
    from vitkit.data.digits import write_digits_npz
    from vitkit.export import export_onnx, onnx_session
    from vitkit.train.metrics import MetricsLog

    model = VisionTransformer(**TINY)
    for name in ("onnx", "onnxruntime", "transformers", "kornia", "tensorboard", "sklearn"):
        monkeypatch.setitem(sys.modules, name, None)
    calls = {
        "onnx": lambda: export_onnx(model, tmp_path / "m.onnx"),
        "onnxruntime": lambda: onnx_session(tmp_path / "m.onnx"),
        "transformers": lambda: to_hf_model(model),
        "kornia": lambda: load_randaugment(2, 10),
        "tensorboard": lambda: MetricsLog(tmp_path).open_tensorboard(),
        "sklearn": lambda: write_digits_npz(tmp_path / "digits.npz"),
    }
    for name, call in [*calls.items(), ("transformers", lambda: save_hf(model, tmp_path / "hf"))]:
        with pytest.raises(MissingDependencyError, match=re.escape(f"pip install 'vitkit[{EXTRAS[name]}]'")):
            call()
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_the_train_command_keeps_freed_memory_for_its_process_the_python_api_does_not(tmp_path, monkeypatch):
    """`vitkit train` (and `vitkit finetune`, through the same _run_training) owns its process and tunes its
    allocator before training (unless run.accel=none); `vitkit.train.train` leaves the process of whoever calls it as
    it is."""
    import vitkit.accel.training
    import vitkit.train
    from vitkit.train import TrainingInterrupted

    calls = []

    def fake_train(cfg, hooks):
        calls.append("train")
        raise TrainingInterrupted("stopped", 2)

    monkeypatch.setattr(vitkit.accel.training, "tune_cpu_allocator", lambda: calls.append("tune") or True)
    monkeypatch.setattr(vitkit.train, "train", fake_train)
    assert main(["train", "schedule.steps=1", f"run.out_dir={tmp_path}"]) == 130
    assert calls == ["tune", "train"]
    calls.clear()
    assert main(["train", "schedule.steps=1", f"run.out_dir={tmp_path}", "run.accel=none"]) == 130
    assert calls == ["train"]

    monkeypatch.undo()
    calls.clear()
    monkeypatch.setattr(vitkit.accel.training, "tune_cpu_allocator", lambda: calls.append("tune") or True)
    overrides = ["schedule.steps=2", "schedule.warmup_steps=0", "run.eval_every=0", "run.plots=false"]
    cfg = load_config("digits", [*overrides, f"run.out_dir={tmp_path}"])
    assert vitkit.train.train(cfg).step == 2
    assert calls == []
