"""The training loop: ``Trainer(cfg).fit()``, or ``train(cfg)``, runs a TrainConfig end to end.

One optimizer step is accum_steps micro-batches (DDP syncs gradients on the last), a non-finite check, gradient
clipping and the step at the scheduled lr. Every random choice derives from (seed, step) -- data order and
augmentation (sampling.py), dropout and MPP's corruption re-seeded before each micro-batch -- so the saved state is
the weights, the optimizer and the step, and a resumed run ends with the same weights as one never interrupted.
Rank 0 writes the run directory; a report page is the caller's, through RunHooks.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint.native import save_pretrained
from ..device import autocast, seed_rng
from ..models import count_params
from . import distributed as dist_utils
from .config import TrainConfig
from .metrics import Pace, plot_metrics
from .objectives import headline
from .optim import lr_at, polyak_label, set_lr
from .plan import plan_text
from .sampling import mix_seed
from .select import selection_metrics
from .setup import Batch, RunSetup, dataset_size
from .state import save_train_state


class NonFiniteLossError(RuntimeError):
    """Training stopped because the loss, the gradient norm or the updated weights became NaN or infinite."""


class TrainingInterrupted(RuntimeError):
    """SIGINT or SIGTERM stopped training at a step boundary, after a resumable checkpoint was saved."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = signum

    def __reduce__(self) -> tuple[type, tuple[str, int]]:  # crosses from a sweep's --jobs worker to the sweep
        return type(self), (str(self), self.signum)


@dataclass(frozen=True)
class RunHooks:
    """What the caller wants done as the run goes, called on the main rank when run.plots is on: the command line
    rewrites the run's report.html through them (vitkit.report.run.REPORT_HOOKS), so train/ imports no report."""

    evaluated: Callable[[Path, float, torch.device], object] | None = None  # (run_dir, started, device): mid-run
    finished: Callable[[Path, torch.device], object] | None = None  # (run_dir, device): after the final plots
    writes: tuple[str, ...] = ()  # the names of the files they write in the run directory


NO_HOOKS = RunHooks()  # a run that writes its own files only


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    metrics: dict[str, float] = field(default_factory=dict)  # the final evaluation
    wall_s: float = 0.0  # this process, from set-up to the run page written
    num_params: int = 0
    steps_run: int = 0  # the steps this process trained (fewer than step after a resume)
    steps_s: float = 0.0  # the seconds they took, the evaluations between them included

    def summary(self) -> str:
        """The run in one line: the final held-out metrics, the steps, the parameters, the timing and where it is."""
        m, timing = self.metrics, f"wall time {self.wall_s:.1f} s ({self.steps_run:,} steps in {self.steps_s:.1f} s)"
        run = f"{self.step} steps, {self.num_params:,} params, {timing} | run: {self.run_dir}"
        final = "final" if "selected_step" not in m else f"chosen (step {m['selected_step']}, data.select_images)"
        if "eval_mpp_acc" in m:  # masked patch prediction: no labels, the colour prediction is what is scored
            return (
                f"{final} held-out masked patch prediction: colour accuracy {100 * m['eval_mpp_acc']:.2f}% loss "
                f"{m['eval_mpp_loss']:.4f} on {m['eval_images']} images | {run}"
            )
        return (
            f"{final} held-out accuracy: top-1 {100 * m['eval_top1']:.2f}% top-5 {100 * m['eval_top5']:.2f}% "
            f"loss {m['eval_loss']:.4f} on {m['eval_images']} images | {run}"
        )


class Trainer(RunSetup):
    """A run set up from a TrainConfig (RunSetup); ``fit()`` trains it to the end at the config's cadences."""

    def __init__(self, cfg: TrainConfig, hooks: RunHooks = NO_HOOKS) -> None:
        self.hooks = hooks
        self.t_start = time.perf_counter()  # the run's clock starts with its set-up
        self.t_window, self.images = self.t_start, 0  # images since the last record, for its throughput
        self._signal: int | None = None  # set by SIGINT / SIGTERM during fit(): stop at the next step boundary
        self.pace: Pace | None = None  # fit(): the duration measured on the first steps, said once
        super().__init__(cfg)

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
            run = self.cfg.run
            scoring = (self.device, run.eval_batch_size, run.amp, self.cfg.data.num_workers)
            metrics = self.objective.evaluate(self.eval_model, self.eval_ds, *scoring)
            if self.selection is not None:  # data.select_images: scored apart, and the weights kept if the best
                metrics |= selection_metrics(self.objective.evaluate(self.eval_model, self.selection.dataset, *scoring))
                self.selection.offer(self.step, metrics, self.eval_model)
            record = {"kind": "eval", "step": self.step, "epoch": self.epoch, **metrics}
            if self.averaged is not None:
                record["weights"] = polyak_label(self.cfg.optim.polyak, self.cfg.optim.polyak_warmup)
            self.metrics.write(record)
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
        """Training state and model (+ config.json), each written atomically; non-finite weights are never saved."""
        named = [*self.model.named_parameters()]
        if self.averaged is not None:
            named += [(f"averaged {n}", p) for n, p in self.averaged.module.named_parameters()]
        bad = [n for n, p in named if not bool(torch.isfinite(p).all())]
        if bad:
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
            best = None
            if self.selection is not None:
                info["best"], best = self.selection.state(), self.selection.weights
            save_train_state(self.state_path, self.model, self.optimizer, info, self.scaler, self.averaged, best)
            meta = {**self.info.to_dict(), "step": self.step, "total_steps": self.total_steps, "epoch": self.epoch}
            meta["metrics"] = self.last_eval
            if self.averaged is not None:  # the run's model is the averaged one; the raw weights are in the state
                meta["weights"] = polyak_label(self.cfg.optim.polyak, self.cfg.optim.polyak_warmup)
            chosen: contextlib.AbstractContextManager[nn.Module] = contextlib.nullcontext(self.eval_model)
            if self.selection is not None and self.selection.step is not None:  # the run's model: the chosen weights
                meta["metrics"], chosen = self.selection.result(), self.selection.chosen(self.eval_model)
            with chosen as saved:
                model, extra, about = self.objective.export(saved)  # mpp: the ViT, its head kept as extras
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
                    progress.set_description(headline(self.last_eval))
                if self.dist.is_main and run.plots and self.hooks.evaluated is not None:
                    self.hooks.evaluated(self.run_dir, self.t_start, self.device)
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
            num_train, num_eval = dataset_size(self.train_ds), dataset_size(self.eval_ds)
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
        threads = torch.get_num_threads() if self.device.type == "cpu" else None
        self.pace = Pace(self.step, self.total_steps, threads=threads) if self.dist.is_main else None
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
            if self.selection is not None:  # the run's result: the chosen weights' held-out scores, recorded last
                final = self.last_eval = self.selection.result()
                if self.dist.is_main:
                    self.metrics.write({"kind": "selected", "step": self.step, "epoch": self.epoch, **final})
            self.save()
        if self.dist.is_main and self.cfg.run.plots:
            d, classifies = self.cfg.data, self.cfg.run.objective == "classification"
            soft = {"label_smoothing": self.cfg.optim.label_smoothing, "mixup": d.mixup_alpha, "cutmix": d.cutmix_alpha}
            plot_metrics(self.metrics.records(), self.run_dir, **(soft if classifies else {}))
            if self.hooks.finished is not None:
                self.hooks.finished(self.run_dir, self.device)
        wall = time.perf_counter() - self.t_start
        return TrainResult(self.run_dir, self.step, final, wall, count_params(self.model), steps_run, steps_s)


def train(cfg: TrainConfig, hooks: RunHooks = NO_HOOKS) -> TrainResult:
    """Run a training config end to end (also under torchrun); ``hooks``: see RunHooks (the run's report page)."""
    trainer = Trainer(cfg, hooks)
    try:
        return trainer.fit()
    finally:
        trainer.close()
