"""The page of one training run: ``write_run_report(run_dir)`` writes run_dir/report.html: the result, the config,
the training curves, the evaluation and inspection of its model, few-shot results, the environment and the commands
that resume, rerun or re-score the run."""

from __future__ import annotations

import shlex
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from ..data import DatasetInfo, build_datasets
from ..errors import UserError, UserFileNotFoundError
from ..inspect.report import describe, images_from_dataset, write_inspection
from ..io import atomic_write_text
from ..models import VisionTransformer, count_params
from ..predict import Preprocessing, load_for_inference
from ..train.config import TrainConfig
from ..train.distributed import pick_device
from ..train.engine import RunHooks
from ..train.metrics import METRICS_NAME, MetricsLog
from ..train.recipe import load_config
from ..train.run_eval import checkpoint_data
from ..train.state import STATE_NAME, read_train_state
from .configs import config_section, show_value
from .curves import evaluations_table, training_charts
from .environment import environment
from .evaluation import MAX_EVAL_IMAGES, confusion_section, predict_held_out, worst_section
from .html import Html, Page, Row, code_block, definitions, fmt, image, join, percent, table, tag

REPORT_NAME = "report.html"
WEIGHTS_NAME = "model.safetensors"
ROLLOUT_IMAGES = 4  # held-out images shown with their attention rollout
DISTANCE_IMAGES = 128  # held-out images the mean attention distance is averaged over (the paper's count)
REFRESH_SECONDS = 600.0  # during training the page is rewritten at an evaluation this long after the last one
_refreshed: dict[str, float] = {}  # run directory -> when its page was last rewritten during training


@dataclass
class LoadedRun:
    """A run's model (on the report's device), its preprocessing and metadata, and its data."""

    model: nn.Module
    prep: Preprocessing
    metadata: dict[str, Any]
    train_set: Dataset[Any]
    eval_set: Dataset[Any]
    info: DatasetInfo


def write_run_report(
    run_dir: str | Path, out: str | Path | None = None, device: str | torch.device = "auto", during: bool = False
) -> Path:
    """Write the run's page (default run_dir/report.html); returns its path. ``during``: a page written while the
    run trains (no evaluation or inspection of a saved model: that is the end's, or ``vitkit report``'s)."""
    path = Path(out) if out is not None else Path(run_dir) / REPORT_NAME
    atomic_write_text(path, run_report(run_dir, device, during))
    return path


def refresh_run_report(run_dir: str | Path, started: float, device: str | torch.device = "cpu") -> Path | None:
    """At an evaluation during training: rewrite the page (curves and tables alone) when REFRESH_SECONDS have passed
    since its last rewrite or ``started`` (perf_counter); a page that cannot be written only warns."""
    key = str(Path(run_dir).resolve())
    now = time.perf_counter()
    if now - max(started, _refreshed.get(key, started)) < REFRESH_SECONDS:
        return None
    _refreshed[key] = now
    try:
        return write_run_report(run_dir, device=device, during=True)
    except Exception as e:  # noqa: BLE001 -- the page is a view of the run; training goes on without it
        warnings.warn(f"{run_dir}: {REPORT_NAME} not rewritten during training: {type(e).__name__}: {e}", stacklevel=2)
        return None


def write_final_run_report(run_dir: Path, device: torch.device) -> Path:
    """The run's page at the end of its training, on the device it trained on (RunHooks.finished)."""
    return write_run_report(run_dir, device=device)


# what `vitkit train` (and each run of `vitkit sweep`) passes to the training: the page at evaluations and at the end
REPORT_HOOKS = RunHooks(evaluated=refresh_run_report, finished=write_final_run_report, writes=(REPORT_NAME,))


def run_report(run_dir: str | Path, device: str | torch.device = "auto", during: bool = False) -> str:
    """The HTML of a run's page (``during``: see write_run_report)."""
    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        what = "no such directory" if not run.is_dir() else "no config.yaml in it"
        raise UserFileNotFoundError(
            f"{run}: not a training run directory ({what}); give the directory vitkit train wrote"
        )
    cfg = load_config(run / "config.yaml")
    records = MetricsLog(run).records()
    dev = device if isinstance(device, torch.device) else pick_device(device)
    loaded, no_data = None, None
    if (run / WEIGHTS_NAME).is_file() and not during:
        model, prep, metadata = load_for_inference(run)
        try:
            train_set, eval_set, info = build_datasets(checkpoint_data(run, metadata, prep))
        except UserError as e:  # the data moved or went: the page, without what needs its images
            no_data = tag("p", f"Not evaluated here: its data cannot be read ({e}).", cls="note")
        else:
            loaded = LoadedRun(model.to(dev), prep, metadata, train_set, eval_set, info)

    page = Page(f"vitkit run {run.name}", subtitle=str(run.resolve()))
    if during:
        steps = [int(r["step"]) for r in records if "step" in r]
        note = (
            f"Written during training (step {max(steps, default=0)}, {time.strftime('%Y-%m-%d %H:%M:%S')}): curves "
            f"and evaluations so far. The evaluation and inspection of the model come at the end of the run (or now "
            f"with vitkit report {shlex.quote(str(run))}, from its last saved model)."
        )
        page.add("result", "Result", tag("p", note, cls="note during"), headline(run, cfg, records, None, during))
    else:
        page.add("result", "Result", headline(run, cfg, records, loaded))
    page.add("config", "Config", config_section(cfg))
    charts = training_charts(records, cfg.optim.label_smoothing if cfg.run.objective == "classification" else 0.0)
    help_text = "Hover for values; drag across a plot (or Ctrl + wheel, or pinch) to zoom into steps; double-click "
    help_text += "to see the whole run."
    page.add(
        "curves",
        "Training curves",
        tag("p", help_text, cls="chart-help") if charts else tag("p", f"No {METRICS_NAME} records.", cls="note"),
        tag("div", join(page.chart(c) for c in charts), cls="charts"),
        evaluations_table(records),
    )
    later = tag("p", "Drawn at the end of the run (this page was written during training).", cls="note")
    page.add("evaluation", "Evaluation", later if during else no_data if no_data else evaluation(cfg, loaded, dev))
    page.add("inspection", "Inspection", later if during else no_data if no_data else inspection(loaded))
    if (run / "fewshot.json").is_file():
        page.add("fewshot", "Few-shot", fewshot_section(run / "fewshot.json"))
    settings = definitions(
        [(f"run.{k}", show_value(getattr(cfg.run, k))) for k in ("device", "threads", "amp", "compile")]
        + [("data.num_workers", str(cfg.data.num_workers))]
    )
    this = tag("p", "The process that wrote this page:", cls="note")
    own = tag("p", "The run's own settings (config.yaml):", cls="note")
    page.add("environment", "Environment", this, definitions(environment(dev)), own, settings)
    page.add("commands", "Resume or rerun", commands(run, cfg))
    return page.render()


# ---------------------------------------------------------------------------------------------- headline
def _card(value: str, label: str) -> Html:
    return tag("div", join([tag("span", value, cls="value"), tag("span", label, cls="label")]), cls="card")


def headline(
    run: Path, cfg: TrainConfig, records: list[dict[str, Any]], loaded: LoadedRun | None, during: bool = False
) -> Html:
    evals = [r for r in records if r.get("kind") == "eval"]
    train = [r for r in records if r.get("kind") == "train"]
    chosen = [r for r in records if r.get("kind") == "selected"]  # data.select_images: the weights the run kept
    final: dict[str, Any] = (chosen or evals)[-1] if evals else (loaded.metadata.get("metrics", {}) if loaded else {})
    cards = [_card(fmt(int(chosen[-1]["selected_step"])), "step of the weights kept")] if chosen else []
    if "eval_top1" in final:
        cards += [_card(percent(final["eval_top1"]), "held-out top-1"), _card(percent(final["eval_top5"]), "top-5")]
        cards.append(_card(f"{final['eval_loss']:.4f}", "held-out cross-entropy"))
    if "eval_mpp_acc" in final:
        cards += [_card(percent(final["eval_mpp_acc"]), "masked patch colour accuracy")]
        cards.append(_card(f"{final['eval_mpp_loss']:.4f}", "masked patch prediction loss"))
    if "eval_images" in final:
        cards.append(_card(fmt(int(final["eval_images"])), "held-out images"))

    step = int(train[-1]["step"]) if train else int(final.get("step", 0))
    total = None
    if (run / STATE_NAME).is_file():
        state = read_train_state(run / STATE_NAME)[0]
        total, step = state.get("total_steps"), max(step, int(state.get("step", step)))
    cards.append(_card(f"{fmt(step)}" + (f" / {fmt(int(total))}" if total else ""), "steps"))
    if train:
        cards.append(_card(f"{float(train[-1].get('epoch', 0)):g}", "epochs"))
        cards.append(_card(f"{float(train[-1].get('time', 0)):.1f} s", "training wall time"))
        speeds = [float(r["images_per_s"]) for r in train if "images_per_s" in r]
        if speeds:
            cards.append(_card(f"{statistics.median(speeds):,.0f}", "median train images/s"))
    facts: list[tuple[object, object]] = []
    if loaded is not None:
        cards.append(_card(fmt(count_params(loaded.model)), "parameters"))
        model = loaded.model
        about = describe(model) if isinstance(model, VisionTransformer) else type(model).__name__
        facts.append(("model", f"{cfg.model.name or 'from run.init_from'}: {about}"))
        sizes = f"{len(loaded.train_set):,} train / {len(loaded.eval_set):,} held-out images"  # type: ignore[arg-type]
        facts.append(("data", f"{loaded.info.source}, {loaded.info.num_classes} classes, {sizes}"))
    elif during:
        facts.append(("model", f"{cfg.model.name or 'from run.init_from'} (training)"))
    else:
        facts.append(("model", f"no {WEIGHTS_NAME} in the run yet: nothing to evaluate or inspect"))
    if during:
        facts.append(("status", f"training: step {step}" + (f" of {int(total)}" if total else "")))
    elif total and step < int(total):
        facts.append(("status", f"stopped at step {step} of {int(total)}: see Resume or rerun below"))
    elif evals:
        facts.append(("status", f"finished: {step} steps, final evaluation at step {evals[-1].get('step')}"))
    if cfg.run.init_from:
        facts.append(("initialised from", cfg.run.init_from))
    facts.append(("objective", cfg.run.objective))
    return join([tag("div", join(cards), cls="cards"), definitions(facts)])


def evaluation(cfg: TrainConfig, loaded: LoadedRun | None, device: torch.device) -> Html:
    if loaded is None:
        return tag("p", f"No {WEIGHTS_NAME} yet.", cls="note")
    if cfg.run.objective != "classification":
        return tag("p", "A masked patch prediction run has no class labels to score; see the headline.", cls="note")
    k = loaded.info.num_classes
    pred = predict_held_out(loaded.model, loaded.eval_set, k, device, max(1, min(cfg.run.eval_batch_size, 512)))
    names = list(loaded.prep.class_names or loaded.info.class_names)
    stream = isinstance(loaded.eval_set, IterableDataset)
    scored = f"the first {len(pred.labels):,} of" if stream else f"{len(pred.labels):,} (seeded sample) of"
    scored = f"all {pred.total:,}" if len(pred.labels) == pred.total else scored
    intro = (
        f"The run's model (model.safetensors) on {scored} held-out images, in fp32 on {device}: top-1 "
        f"{percent(pred.accuracy)}."
    )
    if len(pred.labels) < pred.total:
        intro += f" More than {MAX_EVAL_IMAGES:,} images: the numbers here are those of "
        intro += "the stream's first ones." if stream else "a random sample."
    return join(
        [
            tag("p", intro, cls="note"),
            confusion_section(pred, names),
            tag("h3", "Worst-classified held-out images"),
            worst_section(pred, loaded.prep, names),
        ]
    )


def inspection(loaded: LoadedRun | None) -> Html:
    """The figures of vitkit.inspect for the run's model and a few of its held-out images, embedded."""
    if loaded is None:
        return tag("p", f"No {WEIGHTS_NAME} yet.", cls="note")
    if not isinstance(loaded.model, VisionTransformer):
        return tag("p", f"{type(loaded.model).__name__}: attention inspection needs a ViT.", cls="note")
    names = list(loaded.prep.class_names or loaded.info.class_names)
    sample = images_from_dataset(loaded.eval_set, loaded.prep, DISTANCE_IMAGES, names)
    shown = sample[:ROLLOUT_IMAGES]
    with tempfile.TemporaryDirectory(prefix="vitkit-report-") as tmp:
        index = write_inspection(loaded.model, tmp, shown, names, torch.stack([im.input for im in sample]))
        figures: list[Html] = []
        maps: list[Html] = []
        for entry in index["written"]:
            png = (Path(tmp) / entry["file"]).read_bytes()
            alt = f"{entry['figure']}: {entry['description']}"
            fig = image(png, alt, f"{entry['description']} ({entry['figure']} of the paper)")
            (maps if entry["figure"] in ("attention maps", "MAP head attention") else figures).append(fig)
    note = f"{index['model']}; {len(shown)} held-out images, {len(sample)} for the attention distance."
    parts = [tag("p", note, cls="note"), tag("div", join(figures), cls="figures")]
    if maps:
        summary = tag("summary", f"Per-layer, per-head attention maps ({len(maps)} figures)")
        parts.append(tag("details", join([summary, tag("div", join(maps), cls="figures")])))
    parts += [tag("p", f"Not drawn: {s['figure']}: {s['reason']}", cls="note") for s in index["skipped"]]
    return join(parts)


def fewshot_section(path: Path) -> Html:
    import json

    try:
        doc = json.loads(path.read_text())
        results = doc["results"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{path}: not a vitkit fewshot result ({e})") from None
    rows = [
        Row([shots, percent(r["mean"]), percent(r["std"]), ", ".join(percent(v, 1) for v in r.get("per_seed", []))])
        for shots, r in results.items()
    ]
    data = doc.get("data", {})
    note = (
        f"Closed-form ridge regression on frozen features (l2={fmt(doc.get('l2'))}, {len(doc.get('seeds', []))} "
        f"seeds, {doc.get('num_classes')} classes, {doc.get('num_test')} test images, {doc.get('feature_dim')}-d "
        f"features; data {data.get('source', '?') if isinstance(data, dict) else data})."
    )
    header = ["shots per class", "accuracy", "std", "per seed"]
    return join([tag("p", note, cls="note"), table(header, rows, caption=path.name)])


# ---------------------------------------------------------------------------------------------- commands
def _start_dir(run: Path, out_dir: str) -> Path | None:
    """The directory the run was started from: where run.out_dir (when relative) leads to the run's parent."""
    out = Path(out_dir)
    if out.is_absolute():
        return None
    parent = run.resolve().parent
    parts = [p for p in out.parts if p != "."]
    if ".." in parts or tuple(parent.parts[len(parent.parts) - len(parts) :]) != tuple(parts):
        return None
    return Path(*parent.parts[: len(parent.parts) - len(parts)]) if parts else parent


def commands(run: Path, cfg: TrainConfig) -> Html:
    """The exact commands that resume, rerun and re-score this run."""
    start = _start_dir(run, cfg.run.out_dir)
    config = run.resolve() / "config.yaml"
    prefix = ""
    if start is not None:
        config = config.relative_to(start)
        prefix = f"cd {shlex.quote(str(start))}\n"
    q_run, q_cfg = shlex.quote(str(config.parent)), shlex.quote(str(config))
    parts: list[object] = []
    if (run / STATE_NAME).is_file():
        parts.append(tag("h3", "Resume"))
        parts.append(code_block(f"{prefix}vitkit train {q_cfg} run.resume=true", "resume"))
        note = "Continues from train_state.safetensors to the end of the schedule (a finished run has nothing left; "
        note += "a larger schedule.steps or schedule.epochs continues it, its learning-rate schedule stretched)."
        note += " A run's own config.yaml with run.resume=true resumes that run, wherever it has moved."
        parts.append(tag("p", note, cls="note"))
    else:
        parts.append(tag("p", f"No {STATE_NAME}: this run cannot be resumed.", cls="note"))
    parts += [
        tag("h3", "Rerun from scratch"),
        code_block(f"{prefix}vitkit train {q_cfg}", "rerun"),
        tag("p", "Same config and seed: the same weights, in a new directory beside this one.", cls="note"),
        tag("h3", "Score, inspect, report"),
        code_block(
            f"{prefix}vitkit eval {q_run}\nvitkit fewshot {q_run}\nvitkit inspect {q_run} --out "
            f"{shlex.quote(str(config.parent / 'inspect'))}\nvitkit report {q_run}",
            "re-score",
        ),
    ]
    return join(parts)
