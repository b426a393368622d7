"""The `vitkit` command line: thin wrappers over the library, one function per command (@command), each taking the
argparse namespace its cli_args.py `add_<name>` declared.

A user error (UserError, or a file the system refuses) is one line and exit status 2 (VITKIT_DEBUG=1 shows its
traceback); anything else is a bug and keeps its traceback. A warning is one line, `vitkit CMD: warning: ...`. A
command that writes a result refuses to replace an earlier one without --force.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sized
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from . import cli_args
from .errors import UserError
from .optional import require

if TYPE_CHECKING:  # the commands import what they run when they run it: `vitkit --help` stays fast
    from .train.config import TrainConfig

Command = Callable[[argparse.Namespace], int | None]

_COMMANDS: dict[str, tuple[str, Command]] = {}
ONNX_MODULES = ("onnx", "onnxscript", "onnxruntime")  # what `vitkit export` needs
ERROR_HALF = 1000  # a user error longer than twice this is printed as its two ends


def command(name: str, help: str) -> Callable[[Command], Command]:
    def deco(fn: Command) -> Command:
        _COMMANDS[name] = (help, fn)
        return fn

    return deco


@command("models", "list the registered models with their parameter counts, or (--pretrained) released weights")
def cmd_models(args: argparse.Namespace) -> int:
    if args.pretrained:
        from .pretrained import cache_status, get_pretrained, list_pretrained
        from .pretrained.cache import CHECKS

        tags = list_pretrained(args.pattern)
        if not tags:
            raise UserError(f"no pretrained weights match {args.pattern!r}; see `vitkit models --pretrained`")
        rows = [get_pretrained(t) for t in tags]
        width = max(len(t) for t in tags)
        print(f"{'tag':<{width}}  {'res':>4}  {'classes':<12}  {'cached':<24}  source")
        for row in rows:
            cached = cache_status(row)  # "no", "cached (size+arch)", "cached (unreadable)", ...
            print(f"{row.tag:<{width}}  {row.img_size:>4}  {row.classes:<12}  {cached:<24}  {row.source}")
        print(CHECKS)
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


@command("fewshot", "few-shot linear evaluation of a frozen model (closed-form ridge regression, paper sec 4.1)")
def cmd_fewshot(args: argparse.Namespace) -> int:
    import json

    from .data import build_datasets
    from .evaluate import fewshot
    from .io import atomic_write_text
    from .predict import load_for_inference
    from .train.run_eval import checkpoint_data

    ckpt = Path(args.checkpoint)
    out = Path(args.out) if args.out else (ckpt if ckpt.is_dir() else ckpt.parent) / "fewshot.json"
    if out.exists() and not args.force:  # before the model and the features are computed
        raise UserError(f"{out}: exists; pass --force to replace it")
    model, prep, metadata = load_for_inference(args.checkpoint, **cli_args.model_overrides(args))
    cfg = checkpoint_data(args.checkpoint, metadata, prep, args.data, cli_args.data_overrides(args))
    train, test, info = build_datasets(cfg)
    assert isinstance(train, Sized)  # every data set vitkit builds has a length
    result = fewshot(model, train, test, args.shots, args.seeds, args.l2, args.batch_size, info.num_classes)
    print(f"few-shot linear accuracy of {args.checkpoint} on {cfg.source} ({len(train)} train images to draw from)")
    print(result.table())
    atomic_write_text(out, json.dumps(result.record(str(args.checkpoint), cfg.to_dict()), indent=2) + "\n")
    print(f"wrote {out}")
    return 0


@command("inspect", "write the paper's inspection figures: attention maps, rollout, distance, embeddings")
def cmd_inspect(args: argparse.Namespace) -> int:
    from .inspect.report import inspect_checkpoint

    items, args.overrides = cli_args.split_files(args.images)
    index = inspect_checkpoint(
        args.checkpoint,
        args.out,
        cli_args.image_files(items),
        labels=args.labels,
        data=args.data,
        data_overrides=cli_args.data_overrides(args),
        num_images=args.num_images,
        distance_images=args.distance_images,
        force=args.force,
        **cli_args.model_overrides(args),
    )
    for err in index["unread"]:
        print(f"vitkit inspect: error: {err}", file=sys.stderr)
    if index["without_images"]:
        print(f"vitkit inspect: {index['without_images']}", file=sys.stderr)
    for entry in index["written"]:
        print(f"wrote {args.out}/{entry['file']}  ({entry['figure']})")
    for entry in index["skipped"]:
        print(f"skipped {entry['figure']}: {entry['reason']}")
    for name in index["removed"]:
        print(f"removed {args.out}/{name}  (a figure of the previous index)")
    print(f"index: {args.out}/index.md")
    return 1 if index["unread"] else 0


@command("predict", "top-k classes with probabilities for image files (or every image in a folder)")
def cmd_predict(args: argparse.Namespace) -> int:
    import json

    from .predict import format_predictions, load_for_inference, predict_files, read_labels
    from .train.run_eval import untrained_head

    items, args.overrides = cli_args.split_files(args.images)
    if not items:
        raise UserError("no image files given")
    args.images = cli_args.image_files(items)  # a missing file is an error before the model is loaded
    model, prep, metadata = load_for_inference(args.checkpoint, **cli_args.model_overrides(args))
    if untrained := untrained_head(args.checkpoint, metadata):
        print(f"vitkit predict: warning: {untrained}", file=sys.stderr)
    names = read_labels(args.labels) if args.labels else None
    if args.fast or args.int8:
        from .accel.inference import optimize_for_inference

        model = optimize_for_inference(model, precision="int8" if args.int8 else "auto")
    results = predict_files(model, args.images, prep, args.top_k, args.batch_size, names)
    for r in results:
        if r.error is not None:
            print(f"vitkit predict: error: {r.error}", file=sys.stderr)
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
    elif any(r.error is None for r in results):
        print(format_predictions(results))
    return 2 if any(r.error is not None for r in results) else 0  # an unreadable image: a user error, each named


@command("export", "export a checkpoint to ONNX (dynamic batch) and check it against onnxruntime")
def cmd_export(args: argparse.Namespace) -> int:
    from .export import check_onnx, export_onnx
    from .hub import load_model, preprocessing_of

    for module in ONNX_MODULES:  # before the model is loaded (or downloaded)
        require(module, "ONNX export")
    size = {"img_size": args.img_size} if args.img_size is not None else {}
    model = load_model(args.checkpoint, **cli_args.model_overrides(args), **size)
    prep = preprocessing_of(model)  # the record load_model keeps on the model
    path = export_onnx(model, args.onnx, opset=args.opset, force=args.force, int8=args.int8, preprocessing=prep)
    # int8 moves logits by a few percent: a check against gross errors (its accuracy: benchmarks/bench_vit.py)
    err = check_onnx(path, model, batch_sizes=(1, 3), rtol=0.2 if args.int8 else 0.0)
    if args.int8:
        print(f"wrote {path} (int8, opset {args.opset}, dynamic batch); onnxruntime vs torch fp32 max |diff| {err:.2e}")
    else:
        print(f"wrote {path} (opset {args.opset}, dynamic batch); onnxruntime vs torch max |diff| {err:.2e} (<= 1e-4)")
    return 0


def _run_training(cfg: TrainConfig, command: str) -> int:
    from .report.run import REPORT_HOOKS
    from .train import NonFiniteLossError, TrainingInterrupted, train

    if cfg.run.accel == "auto":  # this process trains and nothing else: freed activations stay for the next step
        from .accel.training import tune_cpu_allocator

        tune_cpu_allocator()
    try:
        result = train(cfg, REPORT_HOOKS)  # report.html at evaluations and at the end (with run.plots)
    except NonFiniteLossError as e:
        print(f"vitkit {command}: stopped: {e}", file=sys.stderr)
        return 1
    except TrainingInterrupted as e:
        print(f"vitkit {command}: interrupted: {e}", file=sys.stderr)
        return 128 + e.signum  # the shell's code for a process ended by that signal
    if os.environ.get("RANK", "0") == "0":
        print(result.summary())  # the final metrics; the wall time is the whole command's, the steps' their own
    return 0


@command("train", "train or fine-tune a model from a config (default: a small ViT on the embedded digits)")
def cmd_train(args: argparse.Namespace) -> int:
    from .train import load_config

    config, overrides = cli_args.split_spec(args.spec)
    cfg = load_config(config, [*cli_args.data_as_overrides(args.data), *overrides])
    return _run_training(cfg, "train")


@command(
    "finetune",
    "fine-tune a checkpoint on a data set with the paper's recipe, in one command (a run directory's run settings "
    "kept: threads, device, amp, plots, ...)",
)
def cmd_finetune(args: argparse.Namespace) -> int:
    from .train.recipe import finetune_config

    cfg = finetune_config(args.source, args.data, args.overrides)
    return _run_training(cfg, "finetune")


@command("config", "every training config key with its type, value (default or the given config's) and meaning")
def cmd_config(args: argparse.Namespace) -> int:
    from .train.config import describe_config
    from .train.recipe import load_config_for_listing

    if not args.spec:
        print(describe_config())
        return 0
    config, overrides = cli_args.split_spec(args.spec)
    cfg, required = load_config_for_listing(config, overrides)
    print(describe_config(cfg, required))
    if required:
        fine_tune = cfg.run.init_from or "run.init_from" in required
        then = "; the fine-tuning recipe then fills what it leaves open" if fine_tune else ""
        print(f"\n<required>: give {', '.join(f'{k}=...' for k in required)} to train with this config{then}")
    return 0


@command("eval", "score a run or checkpoint: top-1, top-5 and loss on held-out data")
def cmd_eval(args: argparse.Namespace) -> int:
    from .train.run_eval import evaluate_checkpoint

    data, model = cli_args.data_overrides(args), cli_args.model_overrides(args)
    m = evaluate_checkpoint(args.checkpoint, args.data, data, args.device, args.batch_size, **model)
    print(
        f"{args.checkpoint}: top-1 {100 * m['eval_top1']:.2f}%  top-5 {100 * m['eval_top5']:.2f}%  "
        f"loss {m['eval_loss']:.4f}  ({m['eval_images']} images, {m['data']})"
    )
    return 0


@command("sweep", "run a grid of configs x seeds (finished cells skipped), then tabulate and plot their metrics")
def cmd_sweep(args: argparse.Namespace) -> int:
    from functools import partial

    from .report.run import REPORT_HOOKS
    from .report.sweep import write_sweep_report
    from .sweep import run_sweep
    from .train import TrainingInterrupted

    page = partial(write_sweep_report, write_missing=False)  # the runs wrote their own pages (REPORT_HOOKS)
    try:
        result = run_sweep(
            args.spec,
            args.out,
            args.jobs,
            args.aggregate_only,
            args.quick,
            overrides=[*args.overrides, *([f"run.device={args.device}"] if args.device else [])],
            run_hooks=REPORT_HOOKS,
            page=page,
            force=args.force,
            scale=args.scale,
            time_limit=None if args.time_limit is None else 60 * args.time_limit,
        )
    except TrainingInterrupted as e:
        print(f"vitkit sweep: interrupted: {e}; the same sweep command resumes it", file=sys.stderr)
        return 128 + e.signum
    for path in result.files:
        print(f"wrote {path}")
    for name, error in result.failed.items():
        print(f"vitkit sweep: error: {name}: {error}", file=sys.stderr)
    if result.timed_out:
        done = f"{result.finished} of {result.cells} cells finished, tabulated; the same sweep command goes on"
        print(f"vitkit sweep: stopped at the time limit ({args.time_limit:g} min): {done}", file=sys.stderr)
    return 2 if result.failed else 3 if result.timed_out else 0


@command("report", "one self-contained HTML page of a run (result, config, curves, evaluation) or of a sweep")
def cmd_report(args: argparse.Namespace) -> int:
    from .report import write_report

    print(f"wrote {write_report(args.run, args.out, args.device)}")
    return 0


@command("shard", "write any data source as WebDataset shards (train-*.tar, val-*.tar) with a manifest.json")
def cmd_shard(args: argparse.Namespace) -> int:
    from .data.shard import write_shards
    from .train.config_files import data_section
    from .train.recipe import config_from_dict

    cfg = config_from_dict({"data": data_section(args.source)}, args.overrides).data
    doc = write_shards(cfg, args.out_dir, args.shard_size)
    parts = ", ".join(f"{k} {v['total']} in {len(v['shards'])} shards" for k, v in doc["splits"].items())
    print(f"wrote {args.out_dir}: {parts}, {len(doc['classes'])} classes; train with --data wds:{args.out_dir}")
    print(f"  preprocessing of the source: {' '.join(doc['overrides'])}")
    return 0


@contextlib.contextmanager
def _warnings_as_lines(command: str) -> Iterator[None]:
    """Each warning as one line, ``vitkit CMD: warning: ...``, a text once (a config built several times warns each
    time); the warning filters stay as they are (-W error still raises)."""
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
    parser.add_argument("--version", action="version", version=f"vitkit {cli_args.version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (help_text, _) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name in cli_args.ARGUMENTS:
            cli_args.ARGUMENTS[name](p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse takes no positionals after an option (`eval RUN --data D data.img_size=32`): they are the overrides
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
        if len(msg) > 2 * ERROR_HALF:  # a value quoted whole (a huge list in a config) must not flood the terminal
            msg = f"{msg[:ERROR_HALF]} [... {len(msg) - 2 * ERROR_HALF:,} characters ...] {msg[-ERROR_HALF:]}"
        print(f"vitkit {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"vitkit {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
