"""The `vitkit` command line: thin wrappers over the library, one function pair per command.

Each command is a function decorated with @command(name, help) that receives the argparse namespace; its
arguments are declared by an `add_<name>` function registered with @arguments(name). A user error (the
library's UserError: a bad path, key or value; or a file the system refuses, such as a full disk) is printed
as one line and exits with status 2 (VITKIT_DEBUG=1 shows its traceback); anything else is a bug and keeps
its traceback. A missing optional package is such an error, naming the `pip install 'vitkit[extra]'` that
provides it. While a command runs, a warning is one line, `vitkit CMD: warning: ...`, each text shown once.

Every command that writes a result (convert, export, fewshot, inspect, bench --json) refuses to replace an
earlier one without --force, in one line naming the file.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from .errors import UserError, UserFileNotFoundError
from .optional import require

if TYPE_CHECKING:  # the commands import what they run when they run it: `vitkit --help` stays fast
    from .predict import Preprocessing
    from .train.config import TrainConfig
    from .train.engine import TrainResult

Command = Callable[[argparse.Namespace], int | None]
AddArguments = Callable[[argparse.ArgumentParser], None]

_COMMANDS: dict[str, tuple[str, Command]] = {}
_ARGUMENTS: dict[str, AddArguments] = {}


def command(name: str, help: str) -> Callable[[Command], Command]:
    def deco(fn: Command) -> Command:
        _COMMANDS[name] = (help, fn)
        return fn

    return deco


def arguments(name: str) -> Callable[[AddArguments], AddArguments]:
    def deco(fn: AddArguments) -> AddArguments:
        _ARGUMENTS[name] = fn
        return fn

    return deco


def _refuse_existing(path: Path, force: bool) -> None:
    """The one rule for every output a command writes: an existing file is replaced only with --force."""
    if path.exists() and not force:
        raise UserError(f"{path}: exists; pass --force to replace it")


def _image_files(items: Sequence[str]) -> list[str]:
    """Image paths as given, a folder standing for the image files inside it (its subfolders too, hidden ones
    skipped, sorted by path, as a folder data source reads them). A path that does not exist, or a folder
    without images, is a UserError naming it."""
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


# ------------------------------------------------------------------------------------------ models, convert
@arguments("models")
def add_models(p: argparse.ArgumentParser) -> None:
    p.add_argument("pattern", nargs="?", default="", help="a glob such as 'vit_b*' or '*gap' (or a part of the name)")
    p.add_argument("--num-classes", type=int, default=1000, help="head size used for the counts (default 1000)")
    p.add_argument(
        "--pretrained", action="store_true", help="list the released weights (tags such as vit_b16.augreg_in21k)"
    )


@command("models", "list the registered models with their parameter counts, or (--pretrained) released weights")
def cmd_models(args: argparse.Namespace) -> int:
    if args.pretrained:
        from .pretrained import cache_status, get_pretrained, list_pretrained

        tags = list_pretrained(args.pattern)
        if not tags:
            raise UserError(f"no pretrained weights match {args.pattern!r}; see `vitkit models --pretrained`")
        rows = [get_pretrained(t) for t in tags]
        width = max(len(t) for t in tags)
        print(f"{'tag':<{width}}  {'res':>4}  {'classes':<12}  {'cached':<19}  source")
        for row in rows:
            cached = cache_status(row)  # "no", "cached (verified)", "cached (unreadable)", ...
            print(f"{row.tag:<{width}}  {row.img_size:>4}  {row.classes:<12}  {cached:<19}  {row.source}")
        return 0

    import torch

    from .models import MODELS, count_params, create_model, list_models
    from .models.registry import unknown_model

    names = list_models(args.pattern)
    if not names:
        raise UserError(f"no model matches {args.pattern!r}; {str(unknown_model(args.pattern)).split('; ', 1)[1]}")
    with torch.device("meta"):  # counts only: no memory, no init time
        built = [(n, create_model(n, num_classes=args.num_classes)) for n in names]
    print(f"{'name':<14} {'params':>14}  config")
    for name, model in built:
        spec = {k: v for k, v in MODELS[name].items() if k != "arch"}
        print(f"{name:<14} {count_params(model):>14,}  {spec}")
    return 0


# ---- checkpoints: convert ----
@arguments("convert")
def add_convert(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="official .npz, Hugging Face ViT dir, timm .pth/.safetensors or vitkit dir")
    p.add_argument("dst", help="output directory (or .safetensors file for timm, .npz file for official)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="model config changes, e.g. img_size=384")
    p.add_argument("--to", default="vitkit", choices=("vitkit", "hf", "timm", "official"), help="output format")
    p.add_argument("--force", action="store_true", help="replace existing output files")


@command("convert", "convert a checkpoint between the official, Hugging Face, timm and vitkit formats")
def cmd_convert(args: argparse.Namespace) -> int:
    from .checkpoint.loader import convert, parse_overrides
    from .hub import resolve_checkpoint

    if args.to == "hf":  # before any download or conversion
        require("transformers", "--to hf")
    src = resolve_checkpoint(args.src)  # a pretrained tag is downloaded first
    out = convert(src, args.dst, to=args.to, force=args.force, **parse_overrides(args.overrides))
    print(f"wrote {out} ({args.to})")
    return 0


# ---- inspection: fewshot, inspect, predict ----
def _add_data_source(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data",
        metavar="DATA",
        help="a source (digits, synthetic, folder, cifar10, cifar100), an image folder DIR/<class>/<images> or a "
        "training config .yaml (its data section); default: the checkpoint's own data (its run's config.yaml, "
        "or the source in its metadata)",
    )
    p.add_argument("--root", help="the data directory (same as data.root=...)")
    p.add_argument("--val-root", help="a separate evaluation tree (same as data.val_root=...)")


def _data_overrides(args: argparse.Namespace) -> list[str]:
    """--root / --val-root and the trailing data.key=value items, as overrides of the data section."""
    given = [f"data.{k}={v}" for k, v in (("root", args.root), ("val_root", args.val_root)) if v is not None]
    return given + [o for o in getattr(args, "overrides", []) if o.strip().startswith("data.")]


def _model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The trailing key=value items that are not data.key=value: fields of the checkpoint's model config
    (num_heads=4, gelu=tanh, img_size=384), applied where the file does not say them or says them otherwise."""
    from .checkpoint.loader import parse_overrides

    return parse_overrides([o for o in getattr(args, "overrides", []) if not o.strip().startswith("data.")])


def _split_files(items: list[str]) -> tuple[list[str], list[str]]:
    """Positional items -> (files, key=value overrides): a key=value item that is not an existing file."""
    import re

    overrides = [i for i in items if re.match(r"^[A-Za-z_][\w.]*=", i) and not Path(i).exists()]
    return [i for i in items if i not in overrides], overrides


def _checkpoint_data(args: argparse.Namespace, metadata: dict[str, Any], prep: Preprocessing) -> tuple[Any, ...]:
    """(DataConfig, train set, evaluation set, DatasetInfo) of the checkpoint, as --data and overrides say."""
    from .data import build_datasets
    from .train.run_eval import checkpoint_data

    cfg = checkpoint_data(args.checkpoint, metadata, prep, args.data, _data_overrides(args))
    return (cfg, *build_datasets(cfg))


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


@command("fewshot", "few-shot linear evaluation of a frozen model (closed-form ridge regression, paper sec 4.1)")
def cmd_fewshot(args: argparse.Namespace) -> int:
    import json

    from .evaluate import fewshot
    from .io import atomic_write_text
    from .predict import load_for_inference

    ckpt = Path(args.checkpoint)
    out = Path(args.out) if args.out else (ckpt if ckpt.is_dir() else ckpt.parent) / "fewshot.json"
    _refuse_existing(out, args.force)  # before the model and the features are computed
    model, prep, metadata = load_for_inference(args.checkpoint, **_model_overrides(args))
    cfg, train, test, info = _checkpoint_data(args, metadata, prep)
    result = fewshot(model, train, test, args.shots, args.seeds, args.l2, args.batch_size, info.num_classes)
    print(f"few-shot linear accuracy of {args.checkpoint} on {cfg.source} ({len(train)} train images to draw from)")
    print(result.table())
    atomic_write_text(out, json.dumps(result.record(str(args.checkpoint), cfg.to_dict()), indent=2) + "\n")
    print(f"wrote {out}")
    return 0


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


@command("inspect", "write the paper's inspection figures: attention maps, rollout, distance, embeddings")
def cmd_inspect(args: argparse.Namespace) -> int:
    import torch

    from .inspect.report import check_output_dir, images_from_dataset, images_from_files, write_inspection
    from .predict import load_for_inference, read_labels
    from .train.run_eval import NO_DATA, records_data

    items, args.overrides = _split_files(args.images)
    args.images = _image_files(items)
    check_output_dir(args.out, args.force)  # before the model is loaded and the figures drawn
    model, prep, metadata = load_for_inference(args.checkpoint, **_model_overrides(args))
    names = read_labels(args.labels) if args.labels else prep.class_names
    notes: list[str] = []
    status, distance_inputs = 0, None
    if args.images:
        images, errors = images_from_files(args.images, prep)
        for err in errors:
            print(f"vitkit inspect: error: {err}", file=sys.stderr)
            notes.append(f"not read: {err}")
        status = 1 if errors else 0
    elif args.data is None and not _data_overrides(args) and not records_data(args.checkpoint, metadata):
        images, distance_inputs = [], None  # nothing to draw images from: the figures that need none
        notes.append(f"no images given, and {NO_DATA}")
        print(f"vitkit inspect: {notes[-1]}", file=sys.stderr)
    else:  # the checkpoint's data: data that cannot be read is an error, not a smaller report
        cfg, _, eval_set, info = _checkpoint_data(args, metadata, prep)
        count = max(args.num_images, args.distance_images)
        sample = images_from_dataset(eval_set, prep, count, names or info.class_names)
        images, distance_inputs = sample[: args.num_images], torch.stack([im.input for im in sample])
        notes.append(f"images: evaluation images of the {cfg.source} data ({len(sample)} for the distance)")
    index = write_inspection(model, args.out, images, names, distance_inputs, notes=notes, force=args.force)
    for entry in index["written"]:
        print(f"wrote {args.out}/{entry['file']}  ({entry['figure']})")
    for entry in index["skipped"]:
        print(f"skipped {entry['figure']}: {entry['reason']}")
    for name in index["removed"]:
        print(f"removed {args.out}/{name}  (a figure of the previous index)")
    print(f"index: {args.out}/index.md")
    return status


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
    p.add_argument("--fast", action="store_true", help="optimise the model for inference first (vitkit.fast)")
    p.add_argument(
        "--int8",
        action="store_true",
        help="CPU: Linear layers in int8 (implies --fast; slightly different probabilities)",
    )


@command("predict", "top-k classes with probabilities for image files (or every image in a folder)")
def cmd_predict(args: argparse.Namespace) -> int:
    import json

    from .predict import format_predictions, load_for_inference, predict_files, read_labels

    items, args.overrides = _split_files(args.images)
    if not items:
        raise UserError("no image files given")
    args.images = _image_files(items)  # a missing file is an error before the model is loaded
    model, prep, metadata = load_for_inference(args.checkpoint, **_model_overrides(args))
    from .train.run_eval import untrained_head

    if untrained := untrained_head(args.checkpoint, metadata):
        print(f"vitkit predict: warning: {untrained}", file=sys.stderr)
    names = read_labels(args.labels) if args.labels else None
    if args.fast or args.int8:
        from .fast import optimize_for_inference

        model = optimize_for_inference(model, precision="int8" if args.int8 else "auto")
    results = predict_files(model, args.images, prep, args.top_k, args.batch_size, names)
    for r in results:
        if r.error is not None:
            print(f"vitkit predict: error: {r.error}", file=sys.stderr)
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        print(format_predictions(results))
    return 1 if any(r.error is not None for r in results) else 0


# ---- speed: bench, export ----
_PEER_MODULES = {"hf": ("transformers",), "onnx": ("onnx", "onnxscript", "onnxruntime")}


@arguments("bench")
def add_bench(p: argparse.ArgumentParser) -> None:
    from .bench import ATTN_IMPLS, DTYPES, MODES, PEERS
    from .fast import COMPILE_MODES

    p.add_argument("--model", default="vit_b16", help="a registered model (default vit_b16)")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="bf16 = bf16 weights; bf16-autocast = mixed")
    p.add_argument(
        "--attn", choices=ATTN_IMPLS, default="auto", help="attention path (auto: explicit in bf16 on a CPU)"
    )
    p.add_argument("--compile", choices=COMPILE_MODES, default="none", help="torch.compile mode (infer: + freezing)")
    p.add_argument("--mode", choices=MODES, default="infer", help="inference forward, or a full AdamW train step")
    p.add_argument("--compare", choices=PEERS, action="append", default=[], help="time a peer alongside; repeatable")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--force", action="store_true", help="replace an existing --json file")
    p.add_argument("--max-batch", action="store_true", help="find the largest batch within --memory-budget")
    p.add_argument("--memory-budget", default="8GB")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")


@command("bench", "images/s, FLOPs, utilisation and memory of a model, optionally side by side with peers")
def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import BenchConfig, run_bench
    from .fast import tune_cpu_allocator

    if args.json:
        _refuse_existing(Path(args.json), args.force)  # before minutes of timing
    for peer in dict.fromkeys(args.compare):  # a missing peer library is named before anything is built
        for module in _PEER_MODULES.get(peer, ()):
            require(module, f"--compare {peer}")
    tune_cpu_allocator()  # a benchmark measures the fast setting (freed tensor memory kept for reuse; vitkit.fast)

    fields = {k: getattr(args, k) for k in ("model", "img_size", "batch_size", "dtype", "attn", "compile", "mode")}
    cfg = BenchConfig(
        **fields,
        compare=tuple(dict.fromkeys(args.compare)),
        repeats=args.repeats,
        warmup=args.warmup,
        max_batch=args.max_batch,
        memory_budget=args.memory_budget,
        **({"device": args.device} if args.device else {}),
    )
    report = run_bench(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(report.table())
    if args.json:
        print(f"wrote {report.save_json(args.json)}")
    return 0


@arguments("export")
def add_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a checkpoint in any format vitkit reads (vitkit dir, official .npz, HF, timm)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="model fields (num_heads=4, gelu=tanh)")
    p.add_argument("--onnx", required=True, metavar="OUT", help="the .onnx file to write")
    p.add_argument("--opset", type=int, default=18)
    p.add_argument("--img-size", type=int, help="export at this resolution (position embeddings resampled)")
    p.add_argument("--force", action="store_true", help="replace an existing output file")
    p.add_argument("--int8", action="store_true", help="dynamically quantise the MatMul weights to int8 (onnxruntime)")


@command("export", "export a checkpoint to ONNX (dynamic batch) and check it against onnxruntime")
def cmd_export(args: argparse.Namespace) -> int:

    from .export import check_onnx, export_onnx
    from .hub import load_model
    from .predict import preprocessing_for

    for module in _PEER_MODULES["onnx"]:  # before the model is loaded (or downloaded)
        require(module, "ONNX export")
    size = {"img_size": args.img_size} if args.img_size is not None else {}
    model, metadata = load_model(args.checkpoint, return_metadata=True, **_model_overrides(args), **size)
    prep = preprocessing_for(model, metadata, source=args.checkpoint, square=False)
    path = export_onnx(model, args.onnx, opset=args.opset, force=args.force, int8=args.int8, preprocessing=prep)
    if args.int8:
        # int8 moves logits by a few percent: a check against gross errors (its accuracy: benchmarks/bench_vit.py)
        err = check_onnx(path, model, batch_sizes=(1, 3), rtol=0.2)
        print(f"wrote {path} (int8, opset {args.opset}, dynamic batch); onnxruntime vs torch fp32 max |diff| {err:.2e}")
        return 0
    err = check_onnx(path, model, batch_sizes=(1, 3))
    print(f"wrote {path} (opset {args.opset}, dynamic batch); onnxruntime vs torch max |diff| {err:.2e} (<= 1e-4)")
    return 0


# ---- training: train, eval ----
@arguments("train")
def add_train(p: argparse.ArgumentParser) -> None:
    from .train.config import describe_shipped_configs

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
        help="the data, as in eval and finetune: a source (digits, synthetic, folder, cifar10, cifar100), an image "
        "folder DIR/<class>/<images> or a training config .yaml (its data section); applied as data.key=value "
        "overrides of the config, before the ones given",
    )
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = "shipped configs (vitkit config NAME lists one's values):\n" + describe_shipped_configs()


def _split_spec(spec: list[str]) -> tuple[str | None, list[str]]:
    """[CONFIG] key=value ... -> (config or None, overrides)."""
    if spec and "=" not in spec[0]:
        return spec[0], spec[1:]
    return None, spec


def _run_training(cfg: TrainConfig, command: str) -> int:
    from .fast import tune_cpu_allocator
    from .train import NonFiniteLossError, TrainingInterrupted, train

    tune_cpu_allocator()  # this process trains and nothing else: freed activations stay for the next step (vitkit.fast)
    try:
        result = train(cfg)
    except NonFiniteLossError as e:
        print(f"vitkit {command}: stopped: {e}", file=sys.stderr)
        return 1
    except TrainingInterrupted as e:
        print(f"vitkit {command}: interrupted: {e}", file=sys.stderr)
        return 128 + e.signum  # the shell's code for a process ended by that signal
    if os.environ.get("RANK", "0") != "0":
        return 0
    m = result.metrics
    if "eval_mpp_acc" in m:  # masked patch prediction: no labels, the colour prediction is what is scored
        print(
            f"final held-out masked patch prediction: colour accuracy {100 * m['eval_mpp_acc']:.2f}% loss "
            f"{m['eval_mpp_loss']:.4f} on {m['eval_images']} images | {result.step} steps, {result.num_params:,} "
            f"params, {_timing(result)} | run: {result.run_dir}"
        )
        return 0
    print(
        f"final held-out accuracy: top-1 {100 * m['eval_top1']:.2f}% top-5 {100 * m['eval_top5']:.2f}% "
        f"loss {m['eval_loss']:.4f} on {m['eval_images']} images | {result.step} steps, {result.num_params:,} "
        f"params, {_timing(result)} | run: {result.run_dir}"
    )
    return 0


def _timing(result: TrainResult) -> str:
    """``wall time W s (S steps in T s)``: the whole command, then the training steps alone (the evaluations between
    them included; set-up, the final evaluation, the checkpoint and the plots are the rest)."""
    return f"wall time {result.wall_s:.1f} s ({result.steps_run:,} steps in {result.steps_s:.1f} s)"


@command("train", "train or fine-tune a model from a config (default: a small ViT on the embedded digits)")
def cmd_train(args: argparse.Namespace) -> int:
    from .train import load_config
    from .train.config import data_section

    config, overrides = _split_spec(args.spec)
    if args.data is not None:
        overrides = [*_as_overrides("data", data_section(args.data)), *overrides]
    cfg = load_config(config, overrides)
    return _run_training(cfg, "train")


def _as_overrides(section: str, values: dict[str, Any]) -> list[str]:
    """A config section's values as section.key=value strings, in the form the config parser reads."""

    def text(value: Any) -> str:
        if value is None:
            return "null"
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, (list, tuple)):
            return ",".join(text(v) for v in value)
        return str(value)

    return [f"{section}.{key}={text(value)}" for key, value in values.items()]


@arguments("finetune")
def add_finetune(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="a pretrained tag (vitkit models --pretrained), a checkpoint file or a run directory")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="changes to the recipe (vitkit config)")
    p.add_argument(
        "--data",
        required=True,
        metavar="DATA",
        help="an image folder DIR/<class>/<images>, a source (digits, synthetic, folder, cifar10, cifar100; files "
        "through data.root=DIR) or a training config .yaml (its data section)",
    )


@command(
    "finetune",
    "fine-tune a checkpoint on a data set with the paper's recipe, in one command (a run directory's run settings "
    "kept: threads, device, amp, plots, ...)",
)
def cmd_finetune(args: argparse.Namespace) -> int:
    from .train.recipe import finetune_config

    cfg = finetune_config(args.source, args.data, args.overrides)
    return _run_training(cfg, "finetune")


@arguments("config")
def add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", nargs="*", metavar="CONFIG | section.key=value", help="show this config's values")


@command("config", "every training config key with its type, value (default or the given config's) and meaning")
def cmd_config(args: argparse.Namespace) -> int:
    from .train.config import describe_config, load_config_for_listing

    if not args.spec:
        print(describe_config())
        return 0
    config, overrides = _split_spec(args.spec)
    cfg, required = load_config_for_listing(config, overrides)
    print(describe_config(cfg, required))
    if required:
        fine_tune = cfg.run.init_from or "run.init_from" in required
        then = "; the fine-tuning recipe then fills what it leaves open" if fine_tune else ""
        print(f"\n<required>: give {', '.join(f'{k}=...' for k in required)} to train with this config{then}")
    return 0


@arguments("eval")
def add_eval(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a training run directory or any checkpoint vitkit.load_model reads")
    p.add_argument(
        "overrides", nargs="*", metavar="key=value", help="model fields (num_heads=4) or data changes (data.key=v)"
    )
    _add_data_source(p)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--device", default="auto")


@command("eval", "score a run or checkpoint: top-1, top-5 and loss on held-out data")
def cmd_eval(args: argparse.Namespace) -> int:
    from .train.run_eval import evaluate_checkpoint

    m = evaluate_checkpoint(
        args.checkpoint, args.data, _data_overrides(args), args.device, args.batch_size, **_model_overrides(args)
    )
    print(
        f"{args.checkpoint}: top-1 {100 * m['eval_top1']:.2f}%  top-5 {100 * m['eval_top5']:.2f}%  "
        f"loss {m['eval_loss']:.4f}  ({m['eval_images']} images, {m['data']})"
    )
    return 0


# ---- sweep ----
@arguments("sweep")
def add_sweep(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="a sweep spec .yaml, or a shipped one by name (data_regime, posemb, mpp, hybrids)")
    p.add_argument(
        "overrides", nargs="*", metavar="section.key=value", help="for every run: how this machine runs them"
    )
    p.add_argument("--jobs", type=int, default=1, help="cells run at once, each on cores/jobs threads (default 1)")
    p.add_argument("--out", help="the sweep's folder: one run directory per cell (default runs/sweeps/SPEC)")
    p.add_argument("--aggregate-only", action="store_true", help="only read the runs there: table and figures")
    p.add_argument("--quick", action="store_true", help="the spec's quick variant (seconds; what the tests run)")


@command("sweep", "run a grid of configs x seeds (finished cells skipped), then tabulate and plot their metrics")
def cmd_sweep(args: argparse.Namespace) -> int:
    from .sweep import run_sweep
    from .train import TrainingInterrupted

    try:
        result = run_sweep(args.spec, args.out, args.jobs, args.aggregate_only, args.quick, overrides=args.overrides)
    except TrainingInterrupted as e:
        print(f"vitkit sweep: interrupted: {e}; the same sweep command resumes it", file=sys.stderr)
        return 128 + e.signum
    for path in result.files:
        print(f"wrote {path}")
    for name, error in result.failed.items():
        print(f"vitkit sweep: error: {name}: {error}", file=sys.stderr)
    return 2 if result.failed else 0


# ---- report ----
@arguments("report")
def add_report(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="PATH", help="a training run directory (vitkit train) or a sweep's (vitkit sweep)")
    p.add_argument("--out", help="the HTML file to write (default: PATH/report.html)")
    p.add_argument("--device", default="auto", help="where the model is evaluated and inspected (default: auto)")


@command("report", "one self-contained HTML page of a run (result, config, curves, evaluation) or of a sweep")
def cmd_report(args: argparse.Namespace) -> int:
    from .report import write_run_report
    from .report.sweep import is_sweep_dir, write_sweep_report

    path = Path(args.run)
    if is_sweep_dir(path):  # a sweep's directory: its table, figures and a page per run (written where missing)
        print(f"wrote {write_sweep_report(path, args.out, device=args.device)}")
    elif (path / "config.yaml").is_file():
        print(f"wrote {write_run_report(path, args.out, args.device)}")
    else:
        what = "no such directory" if not path.is_dir() else "neither config.yaml nor sweep.json in it"
        raise UserError(f"{path}: not a training run directory or a sweep directory ({what})")
    return 0


@arguments("shard")
def add_shard(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="any --data vitkit reads: digits, an image folder, hf:NAME, manifest:FILE, ...")
    p.add_argument("out_dir", help="the directory to write the shards and manifest.json into (created)")
    p.add_argument("overrides", nargs="*", metavar="data.key=value", help="changes to the data section")
    p.add_argument("--shard-size", type=int, default=1000, help="samples per shard (1000)")


@command("shard", "write any data source as WebDataset shards (train-*.tar, val-*.tar) with a manifest.json")
def cmd_shard(args: argparse.Namespace) -> int:
    from .data.shard import write_shards
    from .train.config import config_from_dict, data_section

    cfg = config_from_dict({"data": data_section(args.source)}, args.overrides).data
    doc = write_shards(cfg, args.out_dir, args.shard_size)
    parts = ", ".join(f"{k} {v['total']} in {len(v['shards'])} shards" for k, v in doc["splits"].items())
    print(f"wrote {args.out_dir}: {parts}, {len(doc['classes'])} classes; train with --data wds:{args.out_dir}")
    print(f"  preprocessing of the source: {' '.join(doc['overrides'])}")
    return 0


# ------------------------------------------------------------------------------------------------- main
def version() -> str:
    """The installed distribution's version, or the package's own when it runs from a source tree."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as distribution_version

    try:
        return distribution_version("vitkit")
    except PackageNotFoundError:
        from . import __version__

        return __version__


@contextlib.contextmanager
def _warnings_as_lines(command: str) -> Iterator[None]:
    """While a command runs, each warning is one line, ``vitkit CMD: warning: ...``, without the file and source
    line, and a text already shown is not repeated (a config built several times warns each time). The warning
    filters are left as they are (-W error still raises); the previous handler is back when the command ends."""
    seen: set[tuple[type[Warning], str]] = set()

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        text = " ".join(str(message).split())  # one line, whatever the message's own line breaks
        if (category, text) in seen:
            return
        seen.add((category, text))
        kind = "" if issubclass(category, UserWarning) else f"{category.__name__}: "
        print(f"vitkit {command}: warning: {kind}{text}", file=file if file is not None else sys.stderr)

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vitkit", description="Vision Transformers, faithful to the official code.")
    parser.add_argument("--version", action="version", version=f"vitkit {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (help_text, _) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name in _ARGUMENTS:
            _ARGUMENTS[name](p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse matches no positionals after an option (`vitkit eval RUN --data D data.img_size=32`): key=value
    # items left over belong to the command's trailing `overrides` (train's `spec`)
    if extra:
        trailing = next((name for name in ("overrides", "spec") if hasattr(args, name)), None)
        if trailing is not None and all("=" in e and not e.startswith("-") for e in extra):
            setattr(args, trailing, [*getattr(args, trailing), *extra])
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _, fn = _COMMANDS[args.command]
    try:
        with _warnings_as_lines(args.command):
            return int(fn(args) or 0)
    except BrokenPipeError:  # the reader went away (`vitkit models | head`): stop quietly, as a piped tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's own flush at exit must not fail
        return 141  # 128 + SIGPIPE, the shell's code for it
    except (UserError, OSError) as e:
        # the system refused a file it names (missing, unwritable, disk full); an OSError naming none is a bug
        if os.environ.get("VITKIT_DEBUG") or not (isinstance(e, UserError) or e.filename):
            raise
        msg = str(e) if isinstance(e, UserError) else f"{e.filename}: {e.strerror}"
        print(f"vitkit {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"vitkit {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
