"""The training engine: ``Trainer(cfg).fit()`` runs a TrainConfig end to end; ``evaluate`` scores a model.

One optimizer step = ``accum_steps`` micro-batches (forward, backward; DDP syncs gradients on the last),
a non-finite-loss check, gradient-norm clipping, the optimizer step at the scheduled lr. The loss is the
objective's (run.objective): cross-entropy on the labels (``Classification``), or masked patch prediction
(mpp.py), which wraps the ViT and ignores the labels. Every random choice derives from (seed, step): data order
and augmentation (sampling.py), and dropout and MPP's corruption, re-seeded before each micro-batch. So the
saved state is the weights, the optimizer and the step, and a resumed run ends with the same weights as one
never interrupted.

Run directory (rank 0 writes):
    config.yaml                resolved config, paths absolute; header lines keep what each resume changed
    model.safetensors          weights + config.json (vitkit.checkpoint.native: loadable by
    config.json                read_native / load_pretrained), metadata = DatasetInfo + step + metrics
    train_state.safetensors    resume state (state.py)
    metrics.jsonl              train/eval records (metrics.py); loss.png, accuracy.png

run.resume=true continues the newest out_dir/name[-N] with a state, run.resume=DIR that directory (where it is
now: its location is no part of its config), and says which. A new run that fails before it records anything
leaves no directory; a finished one holds no lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shutil
import signal
import threading
import time
import warnings
from collections.abc import Iterator, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel
from torch.utils.data import DataLoader, Dataset

from ..checkpoint.loader import Checkpoint
from ..checkpoint.native import save_pretrained
from ..data import DatasetInfo, TensorImageDataset, WebDatasetStream, build_datasets
from ..data.augment import build_augment
from ..device import autocast, bf16_is_fast, seed_rng, usable_cores
from ..errors import ConfigError, UserError, UserFileNotFoundError
from ..evaluate.loop import batches, evaluating
from ..io import DirectoryLock, atomic_write_text, remove_stale_temp_files
from ..models import count_params, create_model
from ..models.common import check_fields
from ..models.registry import config_class, model_from_config
from . import distributed as dist_utils
from .config import RunConfig, ScheduleConfig, TrainConfig, flat_keys, load_config
from .contiguous import ContiguousParams
from .metrics import METRICS_NAME, TENSORBOARD_DIR, MetricsLog, Pace, plot_metrics, topk_correct
from .mpp import MaskedPatchPrediction
from .optim import build_optimizer, lr_at, set_lr
from .recipe import channels_mismatch, default_steps, init_from_checkpoint, plan_text, read_source
from .sampling import SeededBatches, SeededItems, StepPlan, mix_seed
from .state import STATE_NAME, load_train_state, read_train_state, save_train_state

Batch = tuple[torch.Tensor, torch.Tensor]


class NonFiniteLossError(RuntimeError):
    """Training stopped because the loss, the gradient norm or the updated weights became NaN or infinite."""


class TrainingInterrupted(RuntimeError):
    """SIGINT or SIGTERM stopped training at a step boundary, after a resumable checkpoint was saved."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum


DEFAULT_EPOCHS = 10  # a run from scratch that gives no length

# What a resume may change: the length of the run and how it is run, logged and shown; everything else must
# match the run's config.yaml (or run.resume_with_changes=true must say the change is meant).
RESUMABLE = frozenset(
    {
        "schedule.steps",
        "schedule.epochs",
        "run.resume",
        "run.resume_with_changes",
        "run.progress",
        "run.plots",
        "run.log_every",
        "run.eval_every",
        "run.save_every",
        "run.eval_batch_size",
        "run.threads",
        "run.device",
        "run.compile",
        "run.contiguous_params",
        "run.tensorboard",
        "data.num_workers",
    }
)


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    metrics: dict[str, float] = field(default_factory=dict)  # the final evaluation
    wall_s: float = 0.0  # this process, from set-up to the run page written
    num_params: int = 0
    steps_run: int = 0  # the steps this process trained (fewer than step after a resume)
    steps_s: float = 0.0  # the seconds they took, the evaluations between them included


def _size(dataset: Dataset[Any]) -> int:
    if not isinstance(dataset, Sized):
        raise UserError(f"a {type(dataset).__name__} has no length: training needs data sets of known size")
    return len(dataset)


def polyak_label(decay: float, warmup: bool) -> str:
    """What the run's model is, for its metadata, its eval records and its plots."""
    return f"polyak average {decay:g}" + (" (warm-up (1+t)/(10+t))" if warmup else "")


def polyak_decay(decay: float, t: int, warmup: bool = True) -> float:
    """The averaging factor of Polyak update t (0 for the first): decay, or with the warm-up
    min(decay, (1 + t) / (10 + t))."""
    return min(decay, (1 + t) / (10 + t)) if warmup else decay


# ------------------------------------------------------------------------------------------------ model
def build_model(cfg: TrainConfig, info: DatasetInfo, source: Checkpoint | None = None) -> nn.Module:
    """The configured model, its image size, channels and classes those of the data.

    The architecture is the registry row model.name, or without a name the one run.init_from holds (read from
    ``source`` when the caller has it already); model fields change either.
    """
    fields = dict(cfg.model.fields)
    for key, data_key, value in (
        ("img_size", "data.img_size", info.img_size),
        ("in_chans", "data.in_chans", info.in_chans),
        ("num_classes", "the data's class count", info.num_classes),
    ):
        given = fields.setdefault(key, value)
        if (tuple(given) if isinstance(given, (list, tuple)) else (given, given)) != (value, value):
            raise UserError(f"model.{key}={given} but the data gives {value} ({data_key}); the model follows the data")
    try:
        if cfg.model.name is not None:
            return create_model(cfg.model.name, **fields)
        if not cfg.run.init_from:
            raise UserError(
                "model.name: not set; give a registered model (`vitkit models`), or run.init_from=CHECKPOINT to "
                "fine-tune the model it holds"
            )
        base = dict((source or read_source(cfg.run.init_from)).config)
        arch = base.pop("arch", "vit")
        check_fields(config_class(arch), fields)
        return model_from_config({"arch": arch, **base, **fields})
    except ConfigError as e:
        raise ConfigError(f"model: {e}") from None


# ------------------------------------------------------------------------------------------- evaluation
def evaluate(
    model: nn.Module,
    dataset: Dataset[Any],
    device: torch.device | str = "cpu",
    batch_size: int = 512,
    amp: str = "none",
    num_workers: int = 0,
) -> dict[str, float]:
    """Top-1, top-5 (capped at the class count) and mean cross-entropy of model on dataset."""
    loss_sum, top1, top5, n = 0.0, 0, 0, 0
    with evaluating(model):
        for x, y in batches(dataset, batch_size, device, num_workers=num_workers):
            with autocast(x.device, amp):
                logits = model(x)
            logits = logits.float()
            loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
            c1, c5 = topk_correct(logits, y, (1, 5))
            top1, top5, n = top1 + c1, top5 + c5, n + len(y)
    return {"eval_loss": loss_sum / n, "eval_top1": top1 / n, "eval_top5": top5 / n, "eval_images": n}


class Classification:
    """The supervised objective: cross-entropy on the labels, scored by top-1 / top-5 (``evaluate``)."""

    def __init__(self, label_smoothing: float = 0.0) -> None:
        self.label_smoothing = label_smoothing

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y: (B,) labels, smoothed here; or (B, K) soft targets (mixup / cutmix), which carry the smoothing."""
        if y.is_floating_point():
            return F.cross_entropy(model(x).float(), y)
        return F.cross_entropy(model(x).float(), y, label_smoothing=self.label_smoothing)

    def evaluate(self, model: nn.Module, dataset: Dataset, *args: Any) -> dict[str, float]:
        return evaluate(model, dataset, *args)

    def export(self, model: nn.Module) -> tuple[nn.Module, dict[str, torch.Tensor], dict[str, Any]]:
        return model, {}, {}


def build_objective(cfg: TrainConfig, info: DatasetInfo) -> Classification | MaskedPatchPrediction:
    """The objective run.objective names: what the model is trained to do, and how it is scored and saved."""
    if cfg.run.objective == "mpp":
        return MaskedPatchPrediction(cfg.mpp, info, cfg.run.seed)
    return Classification(cfg.optim.label_smoothing)


# ---------------------------------------------------------------------------------------- run directory
LOCATION = frozenset({"run.out_dir", "run.name"})  # where a run is, not what it is: never a change
PATH_KEYS = ("data.root", "data.val_root", "run.init_from", "run.out_dir")  # stored absolute in config.yaml
HISTORY_PREFIX = "# resumed at step "  # config.yaml's header lines that keep what a resume changed


def _runs_of(out_dir: str | Path, name: str) -> list[Path]:
    """out_dir/name and its taken name-1, name-2, ... in the order they were made."""
    base = Path(out_dir) / name
    taken = [base] if base.exists() else []
    k = 1
    while (base.parent / f"{name}-{k}").exists():
        taken.append(base.parent / f"{name}-{k}")
        k += 1
    return taken


def find_resume_dir(run: RunConfig) -> tuple[Path, list[Path]]:
    """The run directory run.resume names, and the other resumable runs of the same name (for the message).

    run.resume=DIR resumes that directory wherever it is (moved or copied); run.resume=true the newest of
    out_dir/name, name-1, name-2, ... that holds a training state.
    """
    if isinstance(run.resume, str):
        run_dir = Path(run.resume)
        if not (run_dir / STATE_NAME).is_file():
            raise UserFileNotFoundError(f"run.resume={run.resume}: no {STATE_NAME} in it to resume from")
        return run_dir, []
    base = Path(run.out_dir) / (run.name or "run")
    with_state = [d for d in _runs_of(run.out_dir, run.name or "run") if (d / STATE_NAME).is_file()]
    if not with_state:
        raise UserFileNotFoundError(f"run.resume=true but no {STATE_NAME} under {base} or {base}-N to resume")
    return with_state[-1], with_state[:-1]


def choose_run_dir(out_dir: str | Path, name: str, resume: bool | str = False) -> Path:
    """A new out_dir/name, or name-1, name-2, ... if taken (never reuse silently); resume: find_resume_dir's."""
    if resume:
        return find_resume_dir(RunConfig(out_dir=str(out_dir), name=name, resume=resume))[0]
    base = Path(out_dir) / name
    taken = _runs_of(out_dir, name)
    base.parent.mkdir(parents=True, exist_ok=True)
    k = len(taken)
    run_dir = base if not taken else base.parent / f"{name}-{k}"
    while True:  # mkdir is the claim: of two processes choosing the same name, one moves on to the next
        try:
            run_dir.mkdir()
            return run_dir
        except FileExistsError:
            k += 1
            run_dir = base.parent / f"{name}-{k}"


def _absolute(value: str) -> str:
    """A path as an absolute one, so that it resolves from anywhere; a pretrained tag stays as it is."""
    path = Path(value)
    if "://" in value or path.is_absolute() or not (path.exists() or len(path.parts) > 1 or value.startswith(".")):
        return value
    return str(path.absolute())


def with_absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """cfg with its paths (PATH_KEYS) absolute: what config.yaml stores, and what a resume compares."""
    sections: dict[str, dict[str, Any]] = {}
    for key in PATH_KEYS:
        section, _, name = key.partition(".")
        value = getattr(getattr(cfg, section), name)
        if isinstance(value, str) and value:
            sections.setdefault(section, {})[name] = _absolute(value)
    return dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **v) for s, v in sections.items()})


def config_changes(saved: TrainConfig, current: TrainConfig, allowed: frozenset[str] = RESUMABLE) -> list[str]:
    """``key: saved -> current`` for each setting that differs, apart from those in allowed (default: what a
    resume may change, RESUMABLE) and the run's location; paths compare as absolute ones."""
    old, new = flat_keys(with_absolute_paths(saved).to_dict()), flat_keys(with_absolute_paths(current).to_dict())
    keys = sorted((set(old) | set(new)) - allowed - LOCATION)
    return [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


# -------------------------------------------------------------------------------------------------- trainer
class Trainer:
    """Sets up data, model, optimizer and run directory from a TrainConfig; ``fit()`` trains to the end."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.t_start = time.perf_counter()
        self.lock: DirectoryLock | None = None
        self.fresh_dir = False  # rank 0 made the run directory (see _discard_unstarted)
        self._signal: int | None = None  # set by SIGINT / SIGTERM during fit(): stop at the next step boundary
        self.pace: Pace | None = None  # fit(): the duration measured on the first steps, said once
        self._threads = torch.get_num_threads()  # restored by close()
        if cfg.run.threads > 0:  # never more than the cores: a thread that waits for a core stalls every op
            torch.set_num_threads(min(cfg.run.threads, usable_cores()))
        self.dist = dist_utils.setup(cfg.run.device)
        try:
            self._setup()
        except BaseException:
            self._discard_unstarted()
            self.close()
            raise

    # ----------------------------------------------------------------------------------------- setup
    def _setup(self) -> None:
        cfg = self.cfg
        self.device = self.dist.device
        if cfg.run.amp == "fp16" and self.device.type != "cuda":
            raise UserError("run.amp=fp16 needs CUDA (GradScaler); use run.amp=bf16 on CPU")

        self.train_ds, self.eval_ds, self.info = build_datasets(cfg.data)
        o = cfg.optim
        self.plan = StepPlan(
            _size(self.train_ds), o.batch_size, o.accum_steps, self.dist.world_size, self.dist.rank, cfg.run.seed
        )
        self.total_steps = self._run_length()
        self.schedule = self._schedule()
        if cfg.run.amp == "bf16" and self.device.type == "cpu" and not bf16_is_fast(self.device):
            warnings.warn(
                "run.amp=bf16 on a CPU without native bf16 (AMX or AVX512-BF16): bf16 is emulated here, several "
                "times slower than fp32 for the same steps; run.amp=none is faster on this machine",
                stacklevel=2,
            )

        # a resume takes every weight from its state, and the architecture from the run's own checkpoint: a
        # fine-tune resumes without its source (run.init_from is read only to start one)
        self.resume_dir: Path | None = None
        self.other_runs: list[Path] = []
        if cfg.run.resume:
            self.resume_dir, self.other_runs = find_resume_dir(cfg.run)
        source = None  # read once: architecture, weights
        if self.resume_dir is not None:
            if cfg.model.name is None and cfg.run.init_from:  # killed before its first model was saved: the source
                saved = (self.resume_dir / "model.safetensors").is_file()
                source = read_source(str(self.resume_dir) if saved else cfg.run.init_from)
        elif cfg.run.init_from:
            source = read_source(cfg.run.init_from)
        torch.manual_seed(mix_seed(cfg.run.seed, 0x1417))  # model init
        self.objective = build_objective(cfg, self.info)
        self.augment = build_augment(
            cfg.data,
            self.info.num_classes,
            self.info.mean,
            self.info.std,
            label_smoothing=cfg.optim.label_smoothing,
            objective=cfg.run.objective,
        )
        if source is not None and self.resume_dir is None:
            chans = source.preprocessing.in_chans
            if chans != self.info.in_chans:  # before the weights are loaded: name the key to change, not a shape
                raise UserError(channels_mismatch(str(cfg.run.init_from), chans, self.info.in_chans))
        self.model = build_model(cfg, self.info, source)
        self.init_report = None
        if source is not None and self.resume_dir is None:
            self.init_report = init_from_checkpoint(self.model, source, self.info.num_classes)
        self.network = self.model  # the model as built (what the plan describes), before any objective wraps it
        self.model = self.objective.wrap(self.model)  # mpp: the ViT inside an MPPModel
        self.model.to(self.device)
        # fused kernels exist on CUDA and CPU; on CPU they are ~5x faster than the per-tensor (foreach) path
        self.optimizer = build_optimizer(self.model, o, fused=self.device.type in ("cuda", "cpu"))
        self.averaged = self._polyak(o.polyak)
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.run.amp == "fp16")
        self.ddp = None  # DDP wrapper (multi-process); compiled after wrapping, as PyTorch recommends
        if self.dist.enabled:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = nn.parallel.DistributedDataParallel(self.model, device_ids=ids)
        self.train_model: nn.Module = self.ddp or self.model
        # run.contiguous_params: not under DDP, whose own buckets hold the gradients it all-reduces
        contiguous = cfg.run.contiguous_params and self.ddp is None
        self.layout = ContiguousParams(self.optimizer) if contiguous else None
        self.params = self.layout.params if self.layout is not None else list(self.model.parameters())  # clipped
        if cfg.run.compile:
            # static shapes: every training batch of a run has one shape, and shape-generic kernels are slower
            mode = "default" if cfg.run.compile is True else cfg.run.compile
            self.train_model = cast(nn.Module, torch.compile(self.train_model, mode=mode, dynamic=False))

        self.run_dir = self._prepare_run_dir()
        self.state_path = self.run_dir / STATE_NAME
        self.metrics = MetricsLog(self.run_dir)
        self.step, self.last_saved, self.last_eval = 0, None, {}
        self.window: list[float] = []  # train losses since the last record, saved with the state (see save)
        self.time_before = 0.0  # seconds the run trained before this process (a resume)
        self.t_window, self.images = time.perf_counter(), 0  # images since the last record, for its throughput
        self.finished = False  # resumed at its end: nothing to train, evaluate or record again
        if cfg.run.resume:
            doc = load_train_state(self.state_path, self.model, self.optimizer, self.scaler, self.averaged)
            self.step, self.last_saved, self.last_eval = doc["step"], doc["step"], doc.get("metrics", {})
            self.window = [float(v) for v in doc.get("loss_window", [])]
            self.time_before = float(doc.get("time", 0.0))
            self.finished = self.step >= self.total_steps and bool(self.last_eval)
            if self.dist.is_main:
                self.metrics.truncate(self.step)
                self._write_config(resumed_at=self.step)  # only now that the state has loaded: a failed resume
                # leaves the run as it was
        if cfg.run.tensorboard and self.dist.is_main:
            self.metrics.open_tensorboard(purge_step=self.step)

    def _polyak(self, decay: float) -> AveragedModel | None:
        """The Polyak-averaged copy of the model (optim.polyak), starting from the initial weights.

        Update t (0 for the first) moves it towards the new weights with the factor ``polyak_decay(decay, t)``:
        with optim.polyak_warmup, min(decay, (1 + t) / (10 + t)) as TensorFlow's ExponentialMovingAverage with
        num_updates and timm's EMA warmup, so the initial weights are forgotten in a run of any length. One
        fused lerp over all parameters; each rank does the same on identical weights, so it is DDP-safe.
        """
        if not decay:
            return None
        warmup = self.cfg.optim.polyak_warmup
        horizon = round(1 / (1 - decay))
        if self.total_steps < horizon:
            if warmup:
                last = polyak_decay(decay, self.total_steps - 1)
                what = f"the average stays in its warm-up (factor (1 + t) / (10 + t), at most {last:.4f} here)"
            else:
                what = f"{100 * decay**self.total_steps:.1f}% of the average is still the initial weights at the end"
            warnings.warn(
                f"optim.polyak={decay:g} averages over about {horizon} steps, more than this run's "
                f"{self.total_steps}: {what}",
                stacklevel=3,
            )

        @torch.no_grad()
        def update(
            averaged: list[torch.Tensor] | tuple[torch.Tensor, ...],
            current: list[torch.Tensor] | tuple[torch.Tensor, ...],
            num_averaged: torch.Tensor | int,
        ) -> None:
            # num_averaged counts the initial copy: update t is the (t + 1)-th average
            torch._foreach_lerp_(averaged, current, 1 - polyak_decay(decay, int(num_averaged) - 1, warmup))

        averaged = AveragedModel(self.model, multi_avg_fn=update)
        averaged.update_parameters(self.model)  # the first update copies: the average starts at the initial weights
        return averaged

    @property
    def eval_model(self) -> nn.Module:
        """What is evaluated and saved as the run's model: the averaged weights when optim.polyak is on."""
        return self.averaged.module if self.averaged is not None else self.model

    def _run_length(self) -> int:
        """Optimizer steps of the run: schedule.steps, or schedule.epochs; with neither, a fine-tune takes the
        paper's length for the data's size and a run from scratch 10 epochs."""
        s, plan = self.cfg.schedule, self.plan
        if s.steps is not None:
            return s.steps
        if s.epochs is not None:
            return math.ceil(s.epochs * plan.steps_per_epoch)
        if self.cfg.run.init_from:
            return default_steps(_size(self.train_ds), self.cfg.optim.batch_size)
        return math.ceil(DEFAULT_EPOCHS * plan.steps_per_epoch)

    def _schedule(self) -> ScheduleConfig:
        """The schedule as run: a warmup as long as the run would never reach optim.lr, so it is halved to fit."""
        s = self.cfg.schedule
        if s.warmup_steps < self.total_steps:
            return s
        warmup = self.total_steps // 2
        warnings.warn(
            f"schedule.warmup_steps={s.warmup_steps} is not shorter than the run ({self.total_steps} steps), so the "
            f"learning rate would never reach optim.lr={self.cfg.optim.lr:g}; warming up over {warmup} steps instead",
            stacklevel=3,
        )
        return dataclasses.replace(s, warmup_steps=warmup)

    def _prepare_run_dir(self) -> Path:
        """Rank 0 claims the run directory (its lock, for the life of this process), clears what a killed save
        left behind, and for a resume checks the state and the config before anything in the run is touched."""
        run = self.cfg.run
        run_dir = None
        if self.dist.is_main:
            self.fresh_dir = self.resume_dir is None  # made by this run: removed if it fails before its first step
            run_dir = self.resume_dir or choose_run_dir(run.out_dir, run.name or "run")
            self.lock = DirectoryLock(run_dir).acquire()
            remove_stale_temp_files(run_dir)
            if run.resume:
                read_train_state(run_dir / STATE_NAME)
                self._check_resumed_config(run_dir)
            else:
                self.run_dir = run_dir
                self._write_config()
        return Path(dist_utils.broadcast_object(str(run_dir), self.dist))

    def _check_resumed_config(self, run_dir: Path) -> None:
        saved_path = run_dir / "config.yaml"
        if not saved_path.is_file() or self.cfg.run.resume_with_changes:
            return
        changes = config_changes(load_config(saved_path), self.cfg)
        if changes:
            raise UserError(
                f"{run_dir}: run.resume with a config that differs from the run's ({'; '.join(changes)}); "
                "resume with the run's own config, or add run.resume_with_changes=true if the change is meant"
            )

    def _write_config(self, resumed_at: int | None = None) -> None:
        """config.yaml: the resolved config, its paths absolute; a resume keeps the earlier header's history and
        adds a line with what it changed (the values before and after), so no earlier value is lost."""
        path = self.run_dir / "config.yaml"
        history: list[str] = []
        if resumed_at is not None and path.is_file():
            old = path.read_text(encoding="utf-8", errors="replace").splitlines()
            history = [line for line in old if line.startswith(HISTORY_PREFIX)]
            changes = config_changes(load_config(path), self.cfg, frozenset({"run.resume", "run.resume_with_changes"}))
            if changes:
                history.append(f"{HISTORY_PREFIX}{resumed_at} with changes: {'; '.join(changes)}")
        where = str(self.run_dir.parent.absolute())  # where the run is now: it may have been moved
        cfg = with_absolute_paths(
            dataclasses.replace(self.cfg, run=dataclasses.replace(self.cfg.run, resume=False, out_dir=where))
        )
        header = "".join(line + "\n" for line in [f"# resolved config of {self.run_dir}", *history])
        atomic_write_text(path, header + cfg.to_yaml())

    def _discard_unstarted(self) -> None:
        """A new run that failed before anything of it was recorded (no state, no records) leaves no directory."""
        run_dir = getattr(self, "run_dir", None)
        if not self.fresh_dir or run_dir is None or not self.dist.is_main:
            return
        if (run_dir / STATE_NAME).exists() or (run_dir / METRICS_NAME).exists():
            return
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()  # its TensorBoard writer, whose empty event file goes with the directory
        (run_dir / "config.yaml").unlink(missing_ok=True)
        shutil.rmtree(run_dir / TENSORBOARD_DIR, ignore_errors=True)
        if self.lock is not None:
            self.lock.release()
            self.lock = None
        with contextlib.suppress(OSError):  # anything else in it (not this run's) keeps it
            run_dir.rmdir()

    def batches(self, start_step: int) -> Iterator[Batch]:
        """This rank's micro-batches from start_step to the end, in the seeded order."""
        ds, plan, seed = self.train_ds, self.plan, self.cfg.run.seed
        if isinstance(ds, TensorImageDataset):  # in memory: vectorised augmentation, no DataLoader
            shard = plan.micro_batch_size // plan.world_size
            rows = slice(plan.rank * shard, (plan.rank + 1) * shard)
            epoch = start_step // plan.steps_per_epoch
            perm = plan.permutation(epoch)
            for step in range(start_step, self.total_steps):
                if step // plan.steps_per_epoch != epoch:
                    epoch = step // plan.steps_per_epoch
                    perm = plan.permutation(epoch)
                for micro in range(plan.accum_steps):
                    idx = plan.global_micro_batch(step, micro, perm)
                    seed_rng(mix_seed(seed, step, micro, 0xA06))  # CPU tensors; the same on every rank
                    yield ds.augment_batch(ds.images[idx])[rows], ds.labels[idx][rows]
            return
        if isinstance(ds, WebDatasetStream):  # shards: the stream follows the same plan (vitkit.data.wds)
            o, d = self.cfg.optim, self.dist
            yield from ds.batches(
                batch_size=o.batch_size,
                accum_steps=o.accum_steps,
                world_size=d.world_size,
                rank=d.rank,
                seed=seed,
                start_step=start_step,
                total_steps=self.total_steps,
                num_workers=self.cfg.data.num_workers,
                pin_memory=self.device.type == "cuda",
            )
            return
        loader = DataLoader(
            SeededItems(ds),
            batch_sampler=SeededBatches(plan, start_step, self.total_steps),
            num_workers=self.cfg.data.num_workers,
            pin_memory=self.device.type == "cuda",
        )
        yield from loader

    # -------------------------------------------------------------------------------------- training
    def train_step(self, batches: Iterator[Batch]) -> float:
        """One optimizer step over accum_steps micro-batches; returns the mean loss (over ranks)."""
        cfg, step = self.cfg, self.step
        set_lr(self.optimizer, lr_at(step, self.total_steps, cfg.optim.lr, self.schedule))
        accum = cfg.optim.accum_steps
        loss_sum = torch.zeros((), device=self.device)
        if cfg.run.compile == "reduce-overhead":  # a new step: the CUDA graphs' last outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        for micro in range(accum):
            x, y = next(batches)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            if self.augment.enabled:  # RandAugment, mixup / cutmix: on the device, from the seeded global RNG
                seed_rng(mix_seed(cfg.run.seed, step, micro, self.dist.rank, 0xA06B), self.device)
                x, y = self.augment(x, y)
            seed_rng(mix_seed(cfg.run.seed, step, micro, self.dist.rank, 0xD0), self.device)  # dropout
            last = micro == accum - 1
            sync = self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext()
            with sync:
                with autocast(self.device, cfg.run.amp):
                    loss = self.objective.loss(self.train_model, x, y)
                self.scaler.scale(loss / accum).backward()
            loss_sum += loss.detach()
        loss_mean = dist_utils.all_reduce_mean(loss_sum / accum, self.dist)
        self.scaler.unscale_(self.optimizer)
        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else math.inf
        norm = nn.utils.clip_grad_norm_(self.params, max_norm)
        # read back together: one wait for the device a step, not two; nothing is applied before the checks
        loss_value, grad_norm = torch.stack([loss_mean.float(), norm.float().to(loss_mean.device)]).tolist()
        if not math.isfinite(loss_value):
            self._stop_non_finite("loss", loss_value)
        if not math.isfinite(grad_norm) and not self.scaler.is_enabled():  # fp16: the scaler skips the step
            self._stop_non_finite("gradient norm", grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.layout is not None:
            self.layout.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        if self.averaged is not None:
            self.averaged.update_parameters(self.model)
        self.step += 1
        return loss_value

    def _last_good(self) -> str:
        if self.last_saved is not None:
            return f"{self.state_path} (step {self.last_saved})"
        return "none was saved yet (set run.save_every to keep one)"

    def _stop_non_finite(self, what: str, value: float) -> None:
        raise NonFiniteLossError(
            f"non-finite {what} ({value}) at step {self.step + 1} (epoch {self.step // self.plan.steps_per_epoch}); "
            f"training stopped without applying it. Last good checkpoint: {self._last_good()}. Try a lower "
            "optim.lr, optim.grad_clip, or run.amp=none"
        )

    def evaluate(self) -> dict[str, float]:
        """Rank 0 scores the held-out set (the other ranks wait); logs and returns the metrics."""
        metrics: dict[str, float] = {}
        if self.dist.is_main:
            metrics = self.objective.evaluate(
                self.eval_model,
                self.eval_ds,
                self.device,
                self.cfg.run.eval_batch_size,
                self.cfg.run.amp,
                self.cfg.data.num_workers,
            )
            weights = (
                {"weights": polyak_label(self.cfg.optim.polyak, self.cfg.optim.polyak_warmup)}
                if self.averaged is not None
                else {}
            )
            self.metrics.write({"kind": "eval", "step": self.step, "epoch": self.epoch, **metrics, **weights})
        dist_utils.barrier(self.dist)
        self.last_eval = metrics
        return metrics

    @property
    def epoch(self) -> float:
        return round(self.step / self.plan.steps_per_epoch, 4)

    def _stop_requested(self) -> bool:
        """Whether a signal asked to stop (on any rank: every rank must stop at the same step)."""
        if self.dist.enabled:
            flag = torch.tensor(0.0 if self._signal is None else float(self._signal), device=self.device)
            signum = int(dist_utils.all_reduce_max(flag, self.dist).item())
            self._signal = self._signal or signum or None
        return self._signal is not None

    def _stop_on_signal(self, progress: Any) -> None:
        if self.step != self.last_saved:
            self.save()
        if progress is not None:
            progress.close()
        signum = self._signal
        assert signum is not None, "called once a signal asked to stop"
        raise TrainingInterrupted(
            f"{signal.Signals(signum).name} at step {self.step} of {self.total_steps}: saved {self.state_path}; "
            f"continue with `vitkit train {self.run_dir / 'config.yaml'} run.resume=true`",
            signum,
        )

    @contextlib.contextmanager
    def _signals_stop_at_step_boundary(self) -> Iterator[None]:
        """SIGINT / SIGTERM set a flag that the loop reads after each step (then save, stop); a second one acts
        at once, as the previous handler would. Handlers are installed only for the duration of fit()."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

        def request_stop(signum: int, frame: Any) -> None:
            self._signal = signum
            for s, handler in previous.items():
                signal.signal(s, handler)

        for s in previous:
            signal.signal(s, request_stop)
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def save(self) -> None:
        """Training state and the model (+ config.json with metadata), each written atomically; weights that are
        not finite are never saved (the last good checkpoint stays the last one written)."""
        named = [*self.model.named_parameters()]
        if self.averaged is not None:
            named += [(f"averaged {n}", p) for n, p in self.averaged.module.named_parameters()]
        if not all(bool(torch.isfinite(p).all()) for _, p in named):
            bad = [n for n, p in named if not bool(torch.isfinite(p).all())]
            raise NonFiniteLossError(
                f"non-finite weights after step {self.step} ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}); "
                f"not saved. Last good checkpoint: {self._last_good()}. Try a lower optim.lr or optim.grad_clip"
            )
        if self.dist.is_main:
            info = {
                "step": self.step,
                "epoch": self.epoch,
                "total_steps": self.total_steps,
                "metrics": self.last_eval,
                "loss_window": self.window,  # so a resumed run's next record averages the same steps
                "time": self.elapsed,
            }
            save_train_state(self.state_path, self.model, self.optimizer, info, self.scaler, self.averaged)
            meta = {**self.info.to_dict(), "step": self.step, "epoch": self.epoch, "metrics": self.last_eval}
            if self.averaged is not None:  # the run's model is the averaged one; the raw weights are in the state
                meta["weights"] = polyak_label(self.cfg.optim.polyak, self.cfg.optim.polyak_warmup)
            model, extra, about = self.objective.export(self.eval_model)  # mpp: the ViT, its head kept as extras
            save_pretrained(model, self.run_dir, metadata={**meta, **about}, extra=extra)
        dist_utils.barrier(self.dist)
        self.last_saved = self.step

    def train_one_epoch(self, batches: Iterator[Batch], progress: Any = None) -> None:
        """Optimizer steps up to the end of the current epoch (or of the run), with logging/eval/saving."""
        run = self.cfg.run
        end = min(self.total_steps, (self.step // self.plan.steps_per_epoch + 1) * self.plan.steps_per_epoch)
        while self.step < end:
            self.window.append(self.train_step(batches))
            self.images += self.cfg.optim.batch_size
            if progress is not None:
                progress.update(1)
            if self.pace is not None and (line := self.pace.tick(self.step)):
                (progress.write if progress is not None else print)(line)
            log_now = run.log_every > 0 and self.step % run.log_every == 0
            if log_now or self.step == self.total_steps:
                elapsed = time.perf_counter() - self.t_window
                record = {
                    "kind": "train",
                    "step": self.step,
                    "epoch": self.epoch,
                    "loss": sum(self.window) / len(self.window),  # since the previous record, across a resume
                    "lr": lr_at(self.step - 1, self.total_steps, self.cfg.optim.lr, self.schedule),  # the head's
                    "images_per_s": self.images / max(elapsed, 1e-9),  # this process's steps, evaluations aside
                    "time": round(self.elapsed, 3),
                }
                if self.dist.is_main:
                    self.metrics.write(record)
                if progress is not None:
                    progress.set_postfix(
                        loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}", img_s=f"{record['images_per_s']:.0f}"
                    )
                self.t_window, self.images, self.window = time.perf_counter(), 0, []
            paused = time.perf_counter()
            if run.eval_every > 0 and self.step % run.eval_every == 0 and self.step < self.total_steps:
                self.evaluate()
                if progress is not None:
                    progress.set_description(_headline(self.last_eval))
                if self.dist.is_main and run.plots:  # report.html again, at most every REFRESH_SECONDS
                    from ..report.run import refresh_run_report

                    refresh_run_report(self.run_dir, self.t_start, self.device)
            if run.save_every > 0 and self.step % run.save_every == 0 and self.step < self.total_steps:
                self.save()
            self.t_window += time.perf_counter() - paused  # a record's images/s is training's: no evaluation or save
            if self._stop_requested():
                self._stop_on_signal(progress)

    @property
    def elapsed(self) -> float:
        """Seconds the run has taken, those before a resume included."""
        return self.time_before + time.perf_counter() - self.t_start

    def fit(self) -> TrainResult:
        """Train from the current step to the end, evaluate, save, plot; returns the final metrics."""
        try:
            return self._fit()
        except BaseException:
            self._discard_unstarted()  # a new run that failed before it recorded anything leaves no directory
            raise

    def _fit(self) -> TrainResult:
        from tqdm.auto import tqdm

        show = self.cfg.run.progress and self.dist.is_main
        if self.dist.is_main:
            if self.resume_dir is not None:
                others = f" (also resumable: {', '.join(map(str, self.other_runs))}; name one with run.resume=DIR)"
                print(f"resuming {self.run_dir} at step {self.step}" + (others if self.other_runs else ""))
            num_train, num_eval = _size(self.train_ds), _size(self.eval_ds)
            # the plan, from the data and model this run built (nothing is read a second time for it)
            print(plan_text(self.cfg, self.network, self.info, num_train, num_eval, self.total_steps), flush=True)
            sizes = f"{num_train} train / {num_eval} eval images"
            print(
                f"{self.run_dir}: {count_params(self.model):,} params, {self.total_steps} steps of "
                f"{self.cfg.optim.batch_size} images, {sizes}"
            )
            if self.init_report:
                print(f"run.init_from: {self.init_report}")
        progress = tqdm(total=self.total_steps, initial=self.step, unit="step", dynamic_ncols=True, disable=not show)
        self.pace = Pace(self.step, self.total_steps) if self.dist.is_main else None
        batches = self.batches(self.step)
        self.t_window, self.images = time.perf_counter(), 0  # throughput is this process's
        first_step, t_steps = self.step, time.perf_counter()
        try:
            with self._signals_stop_at_step_boundary():
                while self.step < self.total_steps:
                    self.train_one_epoch(batches, progress)
        finally:
            progress.close()
        steps_run, steps_s = self.step - first_step, time.perf_counter() - t_steps
        if self.finished:  # a finished run resumed: its final evaluation is recorded already
            final = self.last_eval
        else:
            final = self.evaluate()
            self.save()
        if self.dist.is_main and self.cfg.run.plots:
            smoothing = self.cfg.optim.label_smoothing if self.cfg.run.objective == "classification" else 0.0
            d, classifies = self.cfg.data, self.cfg.run.objective == "classification"
            mixing = {"mixup": d.mixup_alpha, "cutmix": d.cutmix_alpha} if classifies else {}
            plot_metrics(self.metrics.records(), self.run_dir, label_smoothing=smoothing, **mixing)
            from ..report import write_run_report  # report/ sits above train/: imported where it is used

            write_run_report(self.run_dir, device=self.device)  # report.html: the run on one page
        wall = time.perf_counter() - self.t_start
        return TrainResult(self.run_dir, self.step, final, wall, count_params(self.model), steps_run, steps_s)

    def close(self) -> None:
        """Leave the process group, restore torch's thread count and release the run directory."""
        dist_utils.cleanup(self.dist)
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
        torch.set_num_threads(self._threads)
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def _headline(metrics: dict[str, float]) -> str:
    if "eval_mpp_acc" in metrics:
        return f"mpp colour acc {100 * metrics['eval_mpp_acc']:.1f}%"
    return f"top-1 {100 * metrics.get('eval_top1', 0):.1f}%"


def train(cfg: TrainConfig) -> TrainResult:
    """Run a training config end to end (also under torchrun)."""
    trainer = Trainer(cfg)
    try:
        return trainer.fit()
    finally:
        trainer.close()
