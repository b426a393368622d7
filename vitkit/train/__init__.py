"""Training: configs (config.py, parsed by overrides.py from the files of config_files.py), the run set up
(setup.py) and its loop (engine.py), objectives (objectives.py, mpp.py), optimizers and schedules (optim.py),
seeded data order (sampling.py), run directories (rundir.py), resume state (state.py), torchrun/DDP
(distributed.py), metrics and plots (metrics.py), the fine-tuning recipe and config loading (recipe.py), the model
and its starting weights (model.py), the plan said before a run (plan.py) and `vitkit eval` (run_eval.py).

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
