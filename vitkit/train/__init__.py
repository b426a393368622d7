"""Training: configs (config.py), the engine (engine.py), optimizers and schedules (optim.py), seeded data
order (sampling.py), resume state (state.py), torchrun/DDP (distributed.py), metrics and plots (metrics.py),
the fine-tuning recipe and initialisation (recipe.py) and `vitkit eval` (run_eval.py).

    cfg = load_config("digits", ["optim.lr=2e-3"])
    result = train(cfg)          # -> TrainResult(run_dir, step, metrics, wall_s)
"""

from .config import (
    ModelConfig,
    OptimConfig,
    RunConfig,
    ScheduleConfig,
    TrainConfig,
    config_from_dict,
    load_config,
    shipped_configs,
)
from .engine import NonFiniteLossError, Trainer, TrainingInterrupted, TrainResult, build_model, evaluate, train
from .state import STATE_NAME, load_train_state, read_train_state, save_train_state

__all__ = [
    "STATE_NAME",
    "ModelConfig",
    "NonFiniteLossError",
    "OptimConfig",
    "RunConfig",
    "ScheduleConfig",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "TrainingInterrupted",
    "build_model",
    "config_from_dict",
    "evaluate",
    "load_config",
    "load_train_state",
    "read_train_state",
    "save_train_state",
    "shipped_configs",
    "train",
]
