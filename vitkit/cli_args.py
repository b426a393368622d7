"""What each command of the command line takes (``ARGUMENTS``: a function per command that declares its arguments),
and how the items after them read: a config, overrides, image files, data and model changes."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .errors import UserError, UserFileNotFoundError

# what --data takes, in every command's help (vitkit.train.config_files.data_section reads it)
DATA_KINDS = (
    "a source (digits, shapes, synthetic, cifar10, cifar100, folder), an image folder DIR/<class>/<images>, "
    "hf:NAME (Hugging Face datasets), wds:DIR or wds:PATTERN (WebDataset shards), manifest:FILE (CSV or JSON of "
    "path,label[,split]) or a training config .yaml (its data section)"
)

AddArguments = Callable[[argparse.ArgumentParser], None]
ARGUMENTS: dict[str, AddArguments] = {}


def arguments(name: str) -> Callable[[AddArguments], AddArguments]:
    """Register the function that declares command ``name``'s arguments."""

    def deco(fn: AddArguments) -> AddArguments:
        ARGUMENTS[name] = fn
        return fn

    return deco


def image_files(items: Sequence[str]) -> list[str]:
    """Image paths as given, a folder standing for its image files (subfolders too, hidden ones skipped, sorted, as a
    folder source reads them); a missing path, or a folder without images, is a UserError naming it."""
    from .data import IMAGE_EXTENSIONS

    files: list[str] = []
    for item in items:
        path = Path(item)
        if path.is_dir():
            found = sorted(
                str(p)
                for p in path.rglob("*")
                if p.suffix.lower() in IMAGE_EXTENSIONS
                and p.is_file()
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
            if not found:
                raise UserError(f"{item}: no image files in this folder (expected {', '.join(IMAGE_EXTENSIONS)})")
            files += found
        elif not path.exists():
            raise UserFileNotFoundError(f"{item}: no such image file or folder")
        else:
            files.append(item)
    return files


@arguments("models")
def add_models(p: argparse.ArgumentParser) -> None:
    p.add_argument("pattern", nargs="?", default="", help="a glob such as 'vit_b*' or '*gap' (or a part of the name)")
    p.add_argument("--num-classes", type=int, default=1000, help="head size used for the counts (default 1000)")
    p.add_argument(
        "--pretrained", action="store_true", help="list the released weights (tags such as vit_b16.augreg_in21k)"
    )


@arguments("convert")
def add_convert(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="official .npz, Hugging Face ViT dir, timm .pth/.safetensors or vitkit dir")
    p.add_argument("dst", help="output directory (or .safetensors file for timm, .npz file for official)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="model config changes, e.g. img_size=384")
    p.add_argument("--to", default="vitkit", choices=("vitkit", "hf", "timm", "official"), help="output format")
    p.add_argument("--force", action="store_true", help="replace existing output files")


def _add_data_source(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data",
        metavar="DATA",
        help=f"{DATA_KINDS}; default: the checkpoint's own data (its run's config.yaml, or the source in its metadata)",
    )
    p.add_argument("--root", help="the data directory (same as data.root=...)")
    p.add_argument("--val-root", help="a separate evaluation tree (same as data.val_root=...)")


def data_overrides(args: argparse.Namespace) -> list[str]:
    """--root / --val-root and the trailing data.key=value items, as overrides of the data section."""
    given = [f"data.{k}={v}" for k, v in (("root", args.root), ("val_root", args.val_root)) if v is not None]
    return given + [o for o in getattr(args, "overrides", []) if o.strip().startswith("data.")]


def model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The trailing key=value items that are not data.key=value: fields of the checkpoint's model config
    (num_heads=4, gelu=tanh, img_size=384), applied where the file does not say them or says them otherwise."""
    from .checkpoint.loader import parse_overrides

    return parse_overrides([o for o in getattr(args, "overrides", []) if not o.strip().startswith("data.")])


def split_files(items: list[str]) -> tuple[list[str], list[str]]:
    """Positional items -> (files, key=value overrides): a key=value item that is not an existing file."""
    overrides = [i for i in items if re.match(r"^[A-Za-z_][\w.]*=", i) and not Path(i).exists()]
    return [i for i in items if i not in overrides], overrides


@arguments("fewshot")
def add_fewshot(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="any checkpoint vitkit reads (vitkit dir, official .npz, HF dir, timm file)")
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help="model fields (num_heads=4) or data changes (data.key=v)"
    )
    _add_data_source(p)
    p.add_argument("--shots", type=int, nargs="+", default=[1, 5, 10, 25], help="examples per class (1 5 10 25)")
    p.add_argument("--seeds", type=int, default=3, help="random subsets per shot count (default 3)")
    p.add_argument("--l2", type=float, default=2.0**10, help="ridge regularisation (default 2^10, as big_vision)")
    p.add_argument("--batch-size", type=int, default=128, help="images per forward pass for the features")
    p.add_argument(
        "--out", help="JSON results file (default: fewshot.json in the run directory, or beside the checkpoint file)"
    )
    p.add_argument("--force", action="store_true", help="replace an existing results file")


@arguments("inspect")
def add_inspect(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="any checkpoint vitkit reads")
    p.add_argument(
        "images",
        nargs="*",
        help="image files or folders of images to explain (default: a few from the checkpoint's own data); "
        "key=value items change model fields (num_heads=4) or the data (data.key=value)",
    )
    p.add_argument("--out", required=True, help="directory for the PNG figures and index.md / index.json")
    p.add_argument(
        "--force", action="store_true", help="replace an earlier inspection in --out (its figures are removed)"
    )
    _add_data_source(p)
    p.add_argument("--num-images", type=int, default=4, help="images explained when taken from the data (4)")
    p.add_argument("--distance-images", type=int, default=128, help="data images for the attention distance (128)")
    p.add_argument("--labels", help="class names, one per line (default: from the checkpoint metadata)")


@arguments("predict")
def add_predict(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="any checkpoint vitkit reads")
    p.add_argument(
        "images",
        nargs="+",
        help="image files or folders of images (any size: resized by the model's eval preprocessing); key=value "
        "items change model fields (num_heads=4, gelu=tanh)",
    )
    p.add_argument("--top-k", type=int, default=5, help="classes to show per image (default 5)")
    p.add_argument("--labels", help="class names, one per line (default: from the checkpoint metadata, else indices)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--batch-size", type=int, default=32, help="images per forward pass (default 32)")
    p.add_argument("--fast", action="store_true", help="optimise the model for inference first")
    p.add_argument(
        "--int8",
        action="store_true",
        help="CPU: Linear layers in int8 (implies --fast; slightly different probabilities)",
    )


@arguments("export")
def add_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint in any format vitkit reads (vitkit dir, official .npz, HF, timm)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="model fields (num_heads=4, gelu=tanh)")
    p.add_argument("--onnx", required=True, metavar="OUT", help="the .onnx file to write")
    p.add_argument("--opset", type=int, default=18)
    p.add_argument("--img-size", type=int, help="export at this resolution (position embeddings resampled)")
    p.add_argument("--force", action="store_true", help="replace an existing output file")
    p.add_argument("--int8", action="store_true", help="dynamically quantise the MatMul weights to int8 (onnxruntime)")


@arguments("train")
def add_train(p: argparse.ArgumentParser) -> None:
    from .train.config_files import describe_shipped_configs

    p.add_argument(
        "spec",
        nargs="*",
        metavar="CONFIG | section.key=value",
        help="a YAML config or a shipped one (below; default digits), then typed overrides such as optim.lr=3e-4 "
        "schedule.steps=400 run.resume=true (a length given here replaces the file's, in steps or epochs); every "
        "key, its type, default and meaning: vitkit config [CONFIG]",
    )
    p.add_argument(
        "--data",
        metavar="DATA",
        help=f"the data, as in eval and finetune: {DATA_KINDS}; applied as data.key=value overrides of the config, "
        "before the ones given",
    )
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = "shipped configs (vitkit config NAME lists one's values):\n" + describe_shipped_configs()


def split_spec(spec: list[str]) -> tuple[str | None, list[str]]:
    """[CONFIG] key=value ... -> (config or None, overrides)."""
    if spec and "=" not in spec[0]:
        return spec[0], spec[1:]
    return None, spec


def data_as_overrides(data: str | None) -> list[str]:
    """train's --data (a source, an image folder or a config's data section) as data.key=value overrides."""
    from .train.config_files import data_section
    from .train.overrides import value_text

    section = data_section(data) if data is not None else {}
    return [f"data.{key}={value_text(value)}" for key, value in section.items()]


@arguments("finetune")
def add_finetune(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="a pretrained tag (vitkit models --pretrained), a checkpoint file or a run directory")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="changes to the recipe (vitkit config)")
    p.add_argument(
        "--data",
        required=True,
        metavar="DATA",
        help=f"{DATA_KINDS} (a source's files through data.root=DIR)",
    )


@arguments("config")
def add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="*", metavar="CONFIG | section.key=value", help="show this config's values")


@arguments("eval")
def add_eval(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a training run directory or any checkpoint vitkit.load_model reads")
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help="model fields (num_heads=4) or data changes (data.key=v)"
    )
    _add_data_source(p)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--device", default="auto")


@arguments("sweep")
def add_sweep(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="a sweep spec .yaml, or a shipped one by name (data_regime, posemb, mpp, hybrids)")
    p.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help="for every run: how this machine runs them"
    )
    scales = "cpu: the spec as written, minutes on 2 cores (default); gpu: its gpu section, for one GPU"
    p.add_argument("--scale", choices=("cpu", "gpu"), default="cpu", help=scales)
    p.add_argument("--device", help="where every run trains (run.device; default auto: a GPU if there is one)")
    p.add_argument("--jobs", type=int, help="cells run at once, each on cores/jobs threads (default: the scale's; 1)")
    p.add_argument("--out", help="the sweep's folder: one run directory per cell (default runs/sweeps/SPEC[_gpu])")
    p.add_argument("--aggregate-only", action="store_true", help="only read the runs there: table and figures")
    p.add_argument("--quick", action="store_true", help="the spec's quick variant (seconds; what the tests run)")
    p.add_argument("--force", action="store_true", help="train again cells whose directories hold another run")
    p.add_argument(
        "--time-limit",
        type=float,
        metavar="MINUTES",
        help="then stop the running cells (state saved), start no other and tabulate the finished ones; exit status 3",
    )


@arguments("report")
def add_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="PATH", help="a training run directory (vitkit train) or a sweep's (vitkit sweep)")
    p.add_argument("--out", help="the HTML file to write (default: PATH/report.html)")
    p.add_argument("--device", default="auto", help="where the model is evaluated and inspected (default: auto)")


@arguments("shard")
def add_shard(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="any --data vitkit reads: digits, an image folder, hf:NAME, manifest:FILE, ...")
    p.add_argument("out_dir", help="the directory to write the shards and manifest.json into (created)")
    p.add_argument("overrides", nargs="*", metavar="data.key=value", help="changes to the data section")
    p.add_argument("--shard-size", type=int, default=1000, help="samples per shard (1000)")


def version() -> str:
    """The installed distribution's version, or the package's own when it runs from a source tree."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as distribution_version

    try:
        return distribution_version("vitkit")
    except PackageNotFoundError:
        from . import __version__

        return __version__
