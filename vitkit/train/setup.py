"""A training run set up: ``RunSetup(cfg)`` builds everything its steps use, and ``Trainer`` (engine.py) trains it.

In order: the data, its seeded batch order and the schedule; the run a resume continues and the checkpoint the model
starts from; the model and optimizer; the run directory (claimed by rank 0) and a resume's state. A set-up that
fails leaves no directory behind and gives back the threads, the process group and the lock it took.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sized
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.utils.data import Dataset

from ..checkpoint.loader import Checkpoint
from ..data import build_datasets, build_selection
from ..data.augment import build_augment
from ..device import bf16_is_fast, usable_cores
from ..errors import ConfigError, UserError
from ..hub import read_checkpoint
from ..io import DirectoryLock
from ..models import VisionTransformer
from . import distributed as dist_utils
from .config import TrainConfig
from .metrics import METRICS_NAME, MetricsLog
from .model import build_model, channels_mismatch, init_from_checkpoint
from .objectives import build_objective
from .optim import build_optimizer, polyak_average, run_schedule
from .recipe import run_length
from .rundir import claim_run_dir, discard_run_dir, find_resume_dir, write_config
from .sampling import StepPlan, mix_seed, run_batches
from .select import Selection
from .state import STATE_NAME, load_train_state

if TYPE_CHECKING:
    from ..accel.training import ContiguousParams

Batch = tuple[torch.Tensor, torch.Tensor]


def dataset_size(dataset: Dataset[Any]) -> int:
    """A data set's length; one without is a UserError (a run's length and order need it)."""
    if not isinstance(dataset, Sized):
        raise UserError(f"a {type(dataset).__name__} has no length: training needs data sets of known size")
    return len(dataset)


class RunSetup:
    """Data, model, optimizer and run directory built from a TrainConfig, released by ``close()``."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.lock: DirectoryLock | None = None
        self.fresh_dir = False  # rank 0 made the run directory (see _discard_unstarted)
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

    def _setup(self) -> None:
        cfg = self.cfg
        self.device = self.dist.device
        if cfg.run.amp == "fp16" and self.device.type != "cuda":
            raise UserError("run.amp=fp16 needs CUDA (GradScaler); use run.amp=bf16 on CPU")
        self._setup_data()
        source = self._find_source()
        torch.manual_seed(mix_seed(cfg.run.seed, 0x1417))  # model init
        self.objective = build_objective(cfg, self.info)
        info, smoothing = self.info, cfg.optim.label_smoothing
        self.augment = build_augment(
            cfg.data, info.num_classes, info.mean, info.std, label_smoothing=smoothing, objective=cfg.run.objective
        )
        self._build_model_and_optimizer(source)
        self.run_dir = self._claim_run_dir()
        self.state_path = self.run_dir / STATE_NAME
        self.metrics = MetricsLog(self.run_dir)
        self._start_or_resume()
        if cfg.run.tensorboard and self.dist.is_main:
            self.metrics.open_tensorboard(purge_step=self.step)

    def _setup_data(self) -> None:
        """The data sets, the order of their batches, the run's length and its schedule."""
        cfg, o = self.cfg, self.cfg.optim
        self.train_ds, self.eval_ds, self.info = build_datasets(cfg.data)
        chooser = build_selection(cfg.data)
        if chooser is not None and cfg.run.eval_every == 0:
            raise UserError(
                f"data.select_images={cfg.data.select_images} chooses among the run's evaluations, and "
                "run.eval_every=0 evaluates only at the end: set run.eval_every (steps between evaluations)"
            )
        self.selection = Selection(chooser) if chooser is not None else None
        num_train = dataset_size(self.train_ds)
        self.plan = StepPlan(num_train, o.batch_size, o.accum_steps, self.dist.world_size, self.dist.rank, cfg.run.seed)
        self.total_steps = run_length(cfg, num_train)
        self.schedule = run_schedule(cfg.schedule, self.total_steps, o.lr)
        if cfg.run.amp == "bf16" and self.device.type == "cpu" and not bf16_is_fast(self.device):
            warnings.warn(
                "run.amp=bf16 on a CPU without native bf16 (AMX or AVX512-BF16): bf16 is emulated here, several "
                "times slower than fp32 for the same steps; run.amp=none is faster on this machine",
                stacklevel=2,
            )

    def _find_source(self) -> Checkpoint | None:
        """The run to resume, and the checkpoint the model starts from, read once. A resume takes every weight from
        its state and the architecture from the run's own checkpoint: run.init_from is read only to start a run."""
        run = self.cfg.run
        self.resume_dir: Path | None = None
        self.other_runs: list[Path] = []
        if not run.resume:
            return read_checkpoint(run.init_from) if run.init_from else None
        self.resume_dir, self.other_runs = find_resume_dir(run)
        if self.cfg.model.name is None and run.init_from:  # killed before its first model was saved: the source
            saved = (self.resume_dir / "model.safetensors").is_file()
            return read_checkpoint(str(self.resume_dir) if saved else run.init_from)
        return None

    def _build_model_and_optimizer(self, source: Checkpoint | None) -> None:
        """Every piece the training step uses, built here and nowhere else: the model (a fine-tune's weights, token
        merging, the objective's wrapper) on the device, its optimizer, Polyak average, scaler, DDP and compilation."""
        cfg, o = self.cfg, self.cfg.optim
        fine_tune = source if self.resume_dir is None else None  # a resume's weights come from its state
        chans = fine_tune.preprocessing.in_chans if fine_tune is not None else self.info.in_chans
        if chans != self.info.in_chans:  # before the weights are loaded: name the key to change, not a shape
            raise UserError(channels_mismatch(str(cfg.run.init_from), chans, self.info.in_chans))
        self.model = build_model(cfg, self.info, source)
        self.init_report = None
        if fine_tune is not None:
            self.init_report = init_from_checkpoint(self.model, fine_tune, self.info.num_classes)
        if cfg.model.token_merge:
            self._merge_tokens(cfg.model.token_merge)
        self.network = self.model  # the model as built (what the plan describes), before any objective wraps it
        self.model = self.objective.wrap(self.model)  # mpp: the ViT inside an MPPModel
        self.model.to(self.device)
        if cfg.run.accel == "auto":  # the same function, faster on this device (benchmarks/main_job_step.py)
            from ..accel.training import optimize_for_training

            optimize_for_training(self.model)
        # fused kernels exist on CUDA and CPU, and beat the per-tensor (foreach) path (benchmarks/main_job_step.py)
        self.optimizer = build_optimizer(self.model, o, fused=self.device.type in ("cuda", "cpu"))
        self.averaged = polyak_average(self.model, o.polyak, o.polyak_warmup, self.total_steps)
        self.scaler = torch.amp.GradScaler("cuda", enabled=cfg.run.amp == "fp16")
        self.ddp = None  # DDP wrapper (multi-process); compiled after wrapping, as PyTorch recommends
        if self.dist.enabled:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.ddp = nn.parallel.DistributedDataParallel(self.model, device_ids=ids)
        self.train_model: nn.Module = self.ddp or self.model
        self.layout: ContiguousParams | None = None
        if cfg.run.contiguous_params and self.ddp is None:  # not under DDP, whose buckets hold the gradients
            from ..accel.training import ContiguousParams  # speed, loaded only when a run asks for it

            self.layout = ContiguousParams(self.optimizer)
        self.params = self.layout.params if self.layout is not None else list(self.model.parameters())  # clipped
        if cfg.run.compile:
            # static shapes: every training batch of a run has one shape, and shape-generic kernels are slower
            mode = "default" if cfg.run.compile is True else cfg.run.compile
            self.train_model = cast(nn.Module, torch.compile(self.train_model, mode=mode, dynamic=False))

    def _merge_tokens(self, r: int) -> None:
        """model.token_merge: the token-merging patch on the built ViT (vitkit.accel.tome, loaded only when asked)."""
        from ..accel.tome import apply_token_merging

        if not isinstance(self.model, VisionTransformer):
            raise UserError(f"model.token_merge={r}: token merging needs a ViT, not a {type(self.model).__name__}")
        try:
            apply_token_merging(self.model, r)
        except ConfigError as e:
            raise ConfigError(f"model.{e}") from None

    def _start_or_resume(self) -> None:
        """Step 0, or a resume's step, weights, optimizer, metrics and history from its training state."""
        self.step, self.last_saved, self.last_eval = 0, None, {}
        self.window: list[float] = []  # train losses since the last record, saved with the state (see save)
        self.time_before = 0.0  # seconds the run trained before this process (a resume)
        self.finished = False  # resumed at its end: nothing to train, evaluate or record again
        if not self.cfg.run.resume:
            return
        best: dict[str, torch.Tensor] = {}
        doc = load_train_state(self.state_path, self.model, self.optimizer, self.scaler, self.averaged, best)
        if self.selection is not None:
            self.selection.restore(doc, best, self.state_path)
        self.step, self.last_saved, self.last_eval = doc["step"], doc["step"], doc.get("metrics", {})
        self.window = [float(v) for v in doc.get("loss_window", [])]
        self.time_before = float(doc.get("time", 0.0))
        self.finished = self.step >= self.total_steps and bool(self.last_eval)
        if self.dist.is_main:
            self.metrics.truncate(self.step)
            # only now that the state has loaded: a failed resume leaves the run as it was
            write_config(self.run_dir, self.cfg, resumed_at=self.step)

    @property
    def eval_model(self) -> nn.Module:
        """What is evaluated and saved as the run's model: the averaged weights when optim.polyak is on."""
        return self.averaged.module if self.averaged is not None else self.model

    def _claim_run_dir(self) -> Path:
        """Rank 0 claims the run directory (rundir.claim_run_dir) and writes a new run's config.yaml."""
        run_dir = None
        if self.dist.is_main:
            self.fresh_dir = self.resume_dir is None  # made by this run: removed if it fails before its first step
            run_dir, self.lock = claim_run_dir(self.cfg, self.resume_dir)
            if self.fresh_dir:
                self.run_dir = run_dir
                write_config(run_dir, self.cfg)
        return Path(dist_utils.broadcast_object(str(run_dir), self.dist))

    def _discard_unstarted(self) -> None:
        """A new run that failed before anything of it was recorded (no state, no records) leaves no directory."""
        run_dir = getattr(self, "run_dir", None)
        if not self.fresh_dir or run_dir is None or not self.dist.is_main:
            return
        if (run_dir / STATE_NAME).exists() or (run_dir / METRICS_NAME).exists():
            return
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()  # its TensorBoard writer, whose empty event file goes with the directory
        discard_run_dir(run_dir, self.lock)
        self.lock = None

    def batches(self, start_step: int) -> Iterator[Batch]:
        """This rank's micro-batches from start_step to the end, in the seeded order."""
        pin = self.device.type == "cuda"
        yield from run_batches(self.train_ds, self.plan, start_step, self.total_steps, self.cfg.data.num_workers, pin)

    def close(self) -> None:
        """Leave the process group, restore torch's thread count and release the run directory."""
        dist_utils.cleanup(self.dist)
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()
        torch.set_num_threads(self._threads)
        if self.lock is not None:
            self.lock.release()
            self.lock = None
