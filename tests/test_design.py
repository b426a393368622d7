"""The house rules, each as behaviour: configs are values declared once, the floors of the package hold, user
errors and bugs look different, and nothing process-wide happens unless asked for."""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import subprocess
import sys
import typing
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from harness.memory import measure_step_memory  # benchmarks/harness: benchmarks/ is on sys.path (conftest.py)
from PIL import Image

import vitkit
from vitkit import ResNetConfig, UserError, VisionTransformer, ViTConfig
from vitkit.checkpoint import save_pretrained
from vitkit.cli import main
from vitkit.errors import ConfigError
from vitkit.hub import load_model
from vitkit.models.vit import attends_explicitly
from vitkit.train import build_model, config_from_dict, train
from vitkit.train.config import _section_types

PACKAGE = Path(vitkit.__file__).parent
TINY = dict(img_size=16, patch_size=4, width=32, depth=2, num_heads=2, mlp_dim=64, num_classes=3)


# ----------------------------------------------------------------------------------------- configs are values
def test_model_configs_are_frozen_values():
    cfg = ViTConfig(**TINY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.depth = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ResNetConfig().num_classes = 3  # type: ignore[misc]
    model = VisionTransformer(cfg)
    model.reset_classifier(5)
    assert cfg.num_classes == 3 and model.config.num_classes == 5  # a new value; the old one is untouched
    assert dataclasses.replace(cfg, img_size=[24, 24]).img_size == (24, 24)  # spellings normalised on every build


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("depth", 0, "depth=0: expected a positive integer"),
        ("depth", -1, "depth=-1"),
        ("width", 33, "not divisible by num_heads"),
        ("num_heads", 0, "num_heads=0"),
        ("mlp_dim", 0, "mlp_dim=0"),
        ("patch_size", 0, r"patch_size=\(0, 0\)"),
        ("in_chans", 0, "in_chans=0"),
        ("num_classes", -2, "num_classes=-2"),
        ("img_size", 3, "fewer pixels than one"),
        ("ln_eps", 0.0, "ln_eps=0.0"),
        ("dropout", 1.0, "dropout=1.0"),
        ("classifier", "cls", "classifier='cls'"),
        ("depth", 2.5, "depth=2.5"),
    ],
)
def test_model_config_rejects_bad_values_where_it_is_built(field, value, message):
    with pytest.raises(ConfigError, match=message):
        ViTConfig(**{**TINY, field: value})


def test_image_size_not_a_multiple_of_the_patch_warns_about_the_border():
    with pytest.warns(UserWarning, match="border"):
        ViTConfig(**{**TINY, "img_size": 18})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ViTConfig(**TINY)


def test_training_config_takes_every_model_config_field():
    vit_fields = set(_section_types(ViTConfig))
    for name in vit_fields:  # each field is a key of the model section, typed by ViTConfig itself
        value = getattr(ViTConfig(), name)
        cfg = config_from_dict(
            {"model": {"name": "vit_ti16", name: list(value) if isinstance(value, tuple) else value}}
        )
        assert name in cfg.model.fields
    resnet = config_from_dict(
        {"model": {"name": "hybrid_resnet_r26x1"}}, ["model.width_factor=0.5", "model.layers=1,1"]
    )
    assert resnet.model.fields == {"width_factor": 0.5, "layers": (1, 1)}
    with pytest.raises(ConfigError, match=r"unknown config key 'model.widht'; did you mean model.width\?"):
        config_from_dict({}, ["model.widht=3"])
    with pytest.raises(ConfigError, match="model: ViTConfig.gelu='fast'"):
        config_from_dict({}, ["model.name=vit_ti16", "model.gelu=fast"])


def test_hybrid_and_numerics_fields_train_from_key_value(tmp_path):
    overrides = [
        "model.name=r_vit_ti32",
        "model.resnet_layers=1",
        "model.resnet_width=0.5",
        "model.patch_size=1",
        "model.width=32",
        "model.depth=1",
        "model.num_heads=2",
        "model.mlp_dim=64",
        "model.ln_eps=1e-12",
        "model.gelu=exact",
        "data.source=synthetic",
        "data.img_size=16",
        "data.synthetic_size=32",
        "optim.batch_size=8",
        "schedule.steps=1",
        f"run.out_dir={tmp_path}",
        "run.progress=false",
        "run.plots=false",
    ]
    cfg = config_from_dict({}, overrides)
    result = train(cfg)
    model = load_model(result.run_dir)
    assert model.config.resnet_layers == (1,) and model.config.resnet_width == 0.5
    assert (model.config.ln_eps, model.config.gelu) == (1e-12, "exact")
    assert model.patch_embed.backbone is not None and model.grid == (4, 4)
    saved = yaml_model_section(result.run_dir)
    assert saved["resnet_layers"] == [1] and saved["name"] == "r_vit_ti32"


def yaml_model_section(run_dir: Path) -> dict:
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text())["model"]


def test_model_fields_that_contradict_the_data_are_errors():
    from vitkit.data import DatasetInfo

    info = DatasetInfo(num_classes=4, class_names=list("abcd"), in_chans=3, img_size=16, mean=[0.5] * 3, std=[0.5] * 3)
    ok = config_from_dict({"model": {"name": "vit_ti16", "patch_size": 4, "depth": 1}})
    assert build_model(ok, info).config.num_classes == 4
    for key, value in (("num_classes", 5), ("img_size", 32), ("in_chans", 1)):
        bad = config_from_dict({"model": {"name": "vit_ti16", "patch_size": 4, key: value}})
        with pytest.raises(UserError, match=f"model.{key}={value} but the data gives"):
            build_model(bad, info)


# ------------------------------------------------------------------------------------ the attention path
def test_attention_path_is_a_call_argument_not_a_switch_on_the_model():
    torch.manual_seed(0)
    model = VisionTransformer(**TINY).eval()
    torch.nn.init.normal_(model.head.weight)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        fused, explicit = model(x), model(x, attn_impl="explicit")
        features = model.forward_features(x, attn_impl="explicit")
    torch.testing.assert_close(fused, explicit, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.forward_head(features), fused, rtol=1e-5, atol=1e-5)
    assert model.config.attn_impl == "auto"
    with pytest.raises(ConfigError, match="attn_impl='flash'"):
        model(x, attn_impl="flash")


def test_auto_attention_is_written_out_in_bf16_on_a_cpu_and_fused_elsewhere():
    x = torch.randn(2, 5, 8)
    assert not attends_explicitly("auto", x) and attends_explicitly("auto", x.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attends_explicitly("auto", x)
    assert attends_explicitly("explicit", x) and not attends_explicitly("sdpa", x.bfloat16())
    torch.manual_seed(0)
    model = VisionTransformer(**TINY).eval()
    torch.nn.init.normal_(model.head.weight)
    images = torch.randn(2, 3, 16, 16)
    with torch.no_grad():  # the same path, so the same bits
        assert torch.equal(model(images), model(images, attn_impl="sdpa"))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(model(images), model(images, attn_impl="explicit"))
        model.bfloat16()
        assert torch.equal(model(images.bfloat16()), model(images.bfloat16(), attn_impl="explicit"))


def test_every_forward_runs_the_blocks_through_one_loop():
    """Hooks on each block fire for forward, forward_features and forward_intermediates alike."""
    model = VisionTransformer(**TINY).eval()
    seen: list[tuple[int, ...]] = []
    for blk in model.blocks:
        blk.register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        model(x)
        model.forward_features(x)
        out = model.forward_intermediates(x)
    assert seen == [(2, 17, 32)] * 6 and len(out["blocks"]) == 2  # every token, every block: the model as built


# ----------------------------------------------------------------------------------------------- floors
# DESIGN.md's floors: a module imports only from its own floor or below. Keys are the first name under vitkit/.
FLOORS = {
    **dict.fromkeys(("errors", "optional", "io", "device", "pixels", "preprocessing", "config_of"), 1),
    **dict.fromkeys(("models", "deploy"), 1),
    **dict.fromkeys(("checkpoint", "pretrained", "data", "evaluate"), 2),
    **dict.fromkeys(("hub", "predict", "export", "accel"), 3),
    **dict.fromkeys(("train", "inspect", "report", "sweep"), 4),
    **dict.fromkeys(("cli", "cli_args", "__main__", "__init__"), 5),  # the package's own __init__: lazy public names
}


def _imports(path: Path, package: str | None = None) -> set[str]:
    """The vitkit modules a file imports (absolute names), wherever in the file; ``package`` is the file's dotted
    module name (by default from its place under vitkit/)."""
    if package is None:
        package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if path.name == "__init__.py":
            package += ".__init__"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: -node.level] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            if node.module:
                found.add(module)
            else:  # from . import a, b: the modules a and b, or names the package itself defines
                found.update(_module_or_package(module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m == "vitkit" or m.startswith("vitkit.")}


def _module_or_package(package: str, name: str) -> str:
    """``from package import name``: the module package.name where there is one, else the package itself."""
    folder = PACKAGE.parent.joinpath(*package.split("."))
    is_module = (folder / f"{name}.py").exists() or (folder / name / "__init__.py").exists()
    return f"{package}.{name}" if is_module or not folder.is_dir() else package


def _floor(module: str) -> int:
    """The floor of a dotted vitkit module name; a module DESIGN.md's table does not place is a failure."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    assert top in FLOORS, f"{module}: no floor in DESIGN.md's table (add it to FLOORS)"
    return FLOORS[top]


def test_every_module_imports_only_its_own_floor_or_below():
    checked = 0
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        own = _floor(module)
        above = sorted(f"{m} (floor {_floor(m)})" for m in _imports(path) if _floor(m) > own)
        assert not above, f"{path.relative_to(PACKAGE)} (floor {own}) imports {above}"
        checked += 1
    assert checked > 50  # every module, not a few


def test_the_floor_check_sees_what_it_must_refuse(tmp_path):
    """The parser behind the floor test resolves every spelling of an import (an independent check of it)."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from .. import hub\nfrom ..predict import x\nimport vitkit.train\ndef f():\n    from vitkit import y\n"
    )
    found = _imports(probe, package="vitkit.checkpoint.probe")
    assert found == {"vitkit.hub", "vitkit.predict", "vitkit.train", "vitkit"}  # the package itself: floor 5
    assert [_floor(m) for m in sorted(found)] == [5, 3, 3, 4]


def test_importing_the_models_loads_no_checkpoint_code():
    code = "import sys, vitkit.models; print(sorted(m for m in sys.modules if m.startswith('vitkit.')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "vitkit.models" in loaded and "vitkit.checkpoint" not in loaded


# ----------------------------------------------------------------------------------------------- errors
def test_user_errors_are_one_line_and_bugs_keep_their_traceback(monkeypatch, capsys):
    import vitkit.cli as cli

    assert main(["models", "vit_q*"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no model matches 'vit_q*'" in err

    def bug(args):
        raise ValueError("an internal invariant broke")

    monkeypatch.setitem(cli._COMMANDS, "models", ("", bug))
    with pytest.raises(ValueError, match="internal invariant"):
        main(["models"])

    def refused(args):
        Path("/proc/no-such-dir/file").write_text("")

    monkeypatch.setitem(cli._COMMANDS, "models", ("", refused))
    assert main(["models"]) == 2
    assert "/proc/no-such-dir/file: No such file or directory" in capsys.readouterr().err


def test_models_pattern_is_a_glob_with_suggestions(capsys):
    assert main(["models", "vit_b*"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]]
    assert names == ["vit_b8", "vit_b16", "vit_b32", "vit_b16_gap", "vit_b32_gap"]
    assert main(["models", "gap"]) == 0  # no wildcard: a part of the name
    assert len(capsys.readouterr().out.splitlines()) == 5
    assert main(["models", "vit_b61"]) == 2
    assert "did you mean vit_b16" in capsys.readouterr().err


# ------------------------------------------------------------------------------ process-wide side effects
def test_commands_that_do_not_train_leave_the_allocator_alone(tmp_path):
    code = (
        "from vitkit.cli import main; import vitkit.accel.training as f; main(['models', 'vit_ti16']); "
        "print('tuned' if f.cpu_allocator_tuned() else 'default')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("default")


def test_measuring_memory_writes_to_proc_only_when_asked(monkeypatch):
    import builtins

    written = []
    real_open = builtins.open

    def recording_open(file, mode="r", *args, **kwargs):
        if "w" in mode:
            written.append(str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", recording_open)
    cpu = torch.device("cpu")
    assert measure_step_memory(lambda: torch.ones(1 << 20), cpu) is None and written == []
    if Path("/proc/self/clear_refs").exists():
        assert measure_step_memory(lambda: torch.ones(1 << 20), cpu, reset_cpu_peak=True) is not None
        assert written == ["/proc/self/clear_refs"]


# ------------------------------------------------------------------------- one reader of a checkpoint's data
def image_folder(root: Path, classes: int = 3, per_class: int = 6, size: int = 20, name: str = "c{}") -> Path:
    """root/<class>/<i>.png: per class a flat colour (60 levels apart) with noise, classes named name.format(c)."""
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / name.format(c)).mkdir(parents=True)
        for i in range(per_class):
            pixels = np.full((size, size, 3), 60 * c, np.uint8) + rng.integers(0, 30, (size, size, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / name.format(c) / f"{i}.png")
    return root


def test_data_means_the_same_in_every_command(tmp_path, capsys):
    folder = image_folder(tmp_path / "images")
    model = VisionTransformer(**TINY)
    ckpt = tmp_path / "ckpt"
    save_pretrained(model, ckpt, metadata={"class_names": ["c0", "c1", "c2"], "img_size": 16})
    # an image folder: split as a folder source is, in eval and fewshot alike
    assert main(["eval", str(ckpt), "--data", str(folder)]) == 0
    held_out = int(re.search(r"\((\d+) images, folder\)", capsys.readouterr().out).group(1))
    assert 0 < held_out < 18  # the folder's held-out split
    assert main(["eval", str(ckpt), "--data", str(folder), f"data.val_root={folder}"]) == 0
    assert "(18 images, folder)" in capsys.readouterr().out
    assert main(["fewshot", str(ckpt), "--data", str(folder), "--shots", "1", "--seeds", "1"]) == 0
    doc = json.loads((ckpt / "fewshot.json").read_text())  # the results go beside the checkpoint
    assert doc["data"]["source"] == "folder" and doc["num_test"] == held_out
    # a source name with its root as an option or an override, the same for every command
    for command in (["eval"], ["fewshot", "--shots", "1", "--seeds", "1", "--force"]):  # fewshot.json is there
        assert main([*command, str(ckpt), "--data", "folder", "--root", str(folder)]) == 0
        assert main([*command, str(ckpt), "--data", "folder", f"data.root={folder}"]) == 0
    # data that cannot be read fails every command, with the path named
    for command in (["eval"], ["fewshot", "--force"], ["inspect", "--out", str(tmp_path / "figs")]):
        capsys.readouterr()
        assert main([*command, str(ckpt), "--data", "folder", "--root", str(tmp_path / "none")]) == 2
        assert str(tmp_path / "none") in capsys.readouterr().err
    assert main(["eval", str(ckpt), "--data", "nonsense"]) == 2
    assert "expected a source" in capsys.readouterr().err


def test_model_section_types_are_the_model_config_types():
    hints = typing.get_type_hints(ViTConfig)
    assert _section_types(ViTConfig)["resnet_layers"] == hints["resnet_layers"]


def test_output_piped_into_a_reader_that_stops_early_ends_quietly():
    """`vitkit models | head -1`: the closed pipe ends the command without a traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "vitkit.cli", "models"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().split()[0] == "name"
    proc.stdout.close()
    _, err = proc.communicate(timeout=60)
    assert "Traceback" not in err and proc.returncode in (0, 141)


# ------------------------------------------------------------------------------------- rules of the house
def _module_names() -> dict[str, Path]:
    """Every module of the package by dotted name, a package by its own name (its __init__)."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _import_graph() -> dict[str, set[str]]:
    """module -> the vitkit modules it imports, anywhere in the file (a package's __init__ is the package)."""
    names = _module_names()
    graph = {}
    for name, path in names.items():
        package = f"{name}.__init__" if path.name == "__init__.py" else None
        found = {m.removesuffix(".__init__") for m in _imports(path, package)}
        graph[name] = {m for m in found if m in names and m != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_is_acyclic_counting_imports_inside_functions():
    graph = _import_graph()
    assert len(graph) > 60 and sum(map(len, graph.values())) > 150  # the whole package, every edge
    assert _cycles(graph) == []


def test_the_cycle_finder_sees_a_cycle_through_a_function_level_import(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from .hub import load_model\n")
    assert _imports(probe, package="vitkit.predict") == {"vitkit.hub"}


MODELS_FORBIDDEN = re.compile(
    r"autograd\.Function|torch\._C\b|torch\.ops\b|torch\._inductor|torch\.compile|mkldnn|_global_\w*hooks"
    r"|register_module_\w*hook"
)


def test_the_models_are_plain_pytorch():
    hits = [
        f"{path.relative_to(PACKAGE)}:{i}: {line.strip()}"
        for path in sorted((PACKAGE / "models").rglob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if MODELS_FORBIDDEN.search(line)
    ]
    assert hits == []
    assert MODELS_FORBIDDEN.search("torch.ops.mkldnn._linear_pointwise(x)")  # the pattern sees what it must


def test_importing_vitkit_and_building_a_model_loads_no_accel_module():
    code = (
        "import sys, torch, vitkit\n"
        "for name in ('vit_ti16', 'r_vit_ti32', 'bit_r50x1'):\n"
        "    m = vitkit.create_model(name, num_classes=3, img_size=32)\n"
        "    m(torch.randn(1, 3, 32, 32))\n"
        "vitkit.list_models(); vitkit.VisionTransformer(img_size=16, patch_size=4, width=32, depth=1, num_heads=2)\n"
        "print(sorted(m for m in sys.modules if m.startswith('vitkit.accel')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_model_as_built_is_stock_pytorch_modules():
    from vitkit.models import bit, common, heads, posemb, resnet, vit

    ours = {m.__name__ for m in (bit, common, heads, posemb, resnet, vit)}
    for name in ("vit_ti16", "r_vit_ti32", "bit_r50x1", "hybrid_resnet_r26x1"):
        model = vitkit.create_model(name, num_classes=3, img_size=32)
        for module in model.modules():
            cls = type(module)
            assert cls.__module__.startswith("torch.nn") or cls.__module__ in ours, f"{name}: {cls}"


# tests outside tests/accel that reach into vitkit.accel, and why: none of them tests what accel computes
ACCEL_OUTSIDE = {
    "conftest.py": "the onednn_bf16 marker, read only where a collected test carries it",
    "test_cli.py": "vitkit train tunes the allocator unless run.accel=none",
    "test_design.py": "these rules",
    "test_harness.py": "the benchmarks measure vitkit through its switches",
}


def test_accel_is_tested_in_tests_accel_and_the_rest_does_not_need_it():
    tests = Path(__file__).parent
    outside = [p for p in sorted(tests.rglob("*.py")) if "accel" not in p.relative_to(tests).parts]
    imports_accel = re.compile(r"^\s*(from vitkit\.accel\b|import vitkit\.accel\b|from vitkit import accel\b)", re.M)
    users = {p.name for p in outside if imports_accel.search(p.read_text())}
    assert users <= set(ACCEL_OUTSIDE), f"accel's tests live in tests/accel/: {sorted(users - set(ACCEL_OUTSIDE))}"
    leaning = [p.name for p in outside if re.search(r"^\s*(from|import) (tests\.)?accel\b", p.read_text(), re.M)]
    assert leaning == []  # nothing outside imports tests/accel: the suite runs without that folder
    assert len(list((tests / "accel").glob("test_*.py"))) >= 5


SIZE_EXCEPTIONS = {"models/vit.py": 450, "pretrained/table.py": None}  # a data table: rows, not code


def test_modules_functions_and_docstrings_fit_in_a_head():
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(PACKAGE))
        text = path.read_text()
        limit = SIZE_EXCEPTIONS.get(rel, 400)
        if limit is not None and len(text.splitlines()) > limit:
            too_long.append(f"{rel}: {len(text.splitlines())} lines > {limit}")
        tree = ast.parse(text)
        doc = ast.get_docstring(tree, clean=False) or ""
        if len(doc.splitlines()) > 15:
            too_long.append(f"{rel}: module docstring of {len(doc.splitlines())} lines > 15")
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > 60:
                    too_long.append(f"{rel}:{node.lineno} {node.name}: {n} lines > 60")
    assert too_long == []


def test_no_measurements_inside_the_package():
    ratio = re.compile(r"\b\d+\.\d+x\b")
    hits = [
        f"{path.relative_to(PACKAGE)}:{i}: {line.strip()[:80]}"
        for path in sorted(PACKAGE.rglob("*"))
        if path.suffix in (".py", ".yaml", ".md", ".txt")
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if ratio.search(line)
    ]
    assert hits == [], "figures live in benchmarks/results/, beside the command that made them"
