"""Training: configs (config.py, overrides.py, config_files.py, recipe.py), the run's set-up (setup.py) and loop
(engine.py), and the pieces they use, a module each.

    cfg = load_config("digits", ["optim.lr=2e-3"])
    result = train(cfg)          # -> TrainResult(run_dir, step, metrics, wall_s)
"""

from .config import ModelConfig, OptimConfig, RunConfig, ScheduleConfig, TrainConfig
from .config_files import shipped_configs
from .engine import NonFiniteLossError, RunHooks, Trainer, TrainingInterrupted, TrainResult, train
from .model import build_model
from .objectives import evaluate
from .recipe import config_from_dict, load_config
from .state import STATE_NAME, load_train_state, read_train_state, save_train_state

__all__ = [
    "STATE_NAME",
    "ModelConfig",
    "NonFiniteLossError",
    "OptimConfig",
    "RunConfig",
    "RunHooks",
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
