"""What a run will do, said before it starts: its source, data, optimizer, batch and steps, and on a CPU the
duration its FLOPs take at a rough rate per thread (the measured one follows: vitkit.train.metrics.Pace)."""

from __future__ import annotations

from collections.abc import Sized

import torch
from torch import nn

from ..data import DatasetInfo, build_datasets
from ..hub import read_checkpoint
from ..models import count_params
from .config import TrainConfig
from .metrics import format_duration
from .model import build_model
from .recipe import run_length

# A rough training rate of one CPU thread in FLOP/s (fp32), for the duration a CPU run is told before it starts;
# what a machine reaches is measured by benchmarks/main_job_step.py
CPU_FLOPS_PER_THREAD = 40e9


def describe_plan(cfg: TrainConfig) -> str:
    """The plan of a run (module docstring), its data and model built for it (the model on the meta device)."""
    model, info, train_set, eval_set = _planned(cfg)
    return plan_text(cfg, model, info, len(train_set), len(eval_set), run_length(cfg, len(train_set)))


def planned_flops(cfg: TrainConfig) -> float:
    """The run's training FLOPs (models.flops.training_flops) before it starts, for the images its steps will take."""
    from ..models.flops import training_flops

    model, info, train_set, _ = _planned(cfg)
    return training_flops(model, info.img_size, cfg.optim.batch_size * run_length(cfg, len(train_set)))


def _planned(cfg: TrainConfig) -> tuple[nn.Module, DatasetInfo, Sized, Sized]:
    """The run's model on the meta device (shapes only: no memory, no init time), its data's info and both sets."""
    train_set, eval_set, info = build_datasets(cfg.data)
    assert isinstance(train_set, Sized) and isinstance(eval_set, Sized)
    source = read_checkpoint(cfg.run.init_from) if cfg.run.init_from else None
    with torch.device("meta"):
        model = build_model(cfg, info, source)
    return model, info, train_set, eval_set


def plan_text(cfg: TrainConfig, model: nn.Module, info: DatasetInfo, num_train: int, num_eval: int, steps: int) -> str:
    """describe_plan's text for a run whose model and data are built already (the Trainer's, at its start)."""
    from ..models.flops import training_flops

    o, s, d = cfg.optim, cfg.schedule, cfg.data
    what = f"fine-tuning {cfg.run.init_from}" if cfg.run.init_from else f"training {cfg.model.name} from scratch"
    if cfg.run.objective == "mpp":  # no classes are learnt: the model is the ViT without its MPP head
        what = f"pretraining {cfg.model.name} by masked patch prediction (no labels)"
    extras = [f"layer decay {o.layer_decay:g}"] if o.layer_decay < 1 else []
    extras += [f"mixup {d.mixup_alpha:g}"] if d.mixup_alpha > 0 else []
    extras += [f"cutmix {d.cutmix_alpha:g}"] if d.cutmix_alpha > 0 else []
    lines = [
        f"{what} ({count_params(model):,} params) on {d.source}{f' ({d.root})' if d.root else ''}: "
        f"{info.num_classes} classes, {num_train:,} train / {num_eval:,} eval images at {info.img_size} px",
        f"  {o.name} lr {o.lr:g}, weight decay {o.weight_decay:g}{''.join(', ' + e for e in extras)}; batch "
        f"{o.batch_size}{f' ({o.accum_steps} micro-batches)' if o.accum_steps > 1 else ''}; {steps:,} steps "
        f"(warmup {s.warmup_steps}, {s.decay}); evaluated "
        + (f"every {cfg.run.eval_every} steps" if 0 < cfg.run.eval_every < steps else "at the end")
        + (f"; keeps the weights that score best on {d.select_images:,} selection images" if d.select_images else ""),
    ]
    device = cfg.run.device
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if on_cpu:
        threads = cfg.run.threads or torch.get_num_threads()
        step = training_flops(model, info.img_size, o.batch_size)
        seconds = step * steps / (threads * CPU_FLOPS_PER_THREAD)
        long = " -- a long job for a CPU; a GPU (run.device=cuda) is the place for it" if seconds > 3600 else ""
        lines.append(
            f"  on this CPU ({threads} thread{'s' if threads > 1 else ''}): about {format_duration(seconds)} by its "
            f"FLOPs ({step / 1e9:.3g} GFLOP a step at ~{CPU_FLOPS_PER_THREAD / 1e9:.0f} GFLOP/s a "
            f"thread){long}"
        )
    return "\n".join(lines)
