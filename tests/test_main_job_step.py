"""benchmarks/main_job_step.py's replay of a training step's operator calls: every ATen call of one step recorded
below autograd and timed alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "main_job_step.py"  # conftest's ``script``


@pytest.fixture
def threads():
    kept = torch.get_num_threads()
    yield
    torch.set_num_threads(kept)  # the trainer sets its own


def test_the_replay_holds_every_operator_call_of_a_step_and_times_each(script, threads):
    """The recorded calls are the step's: more than its matmuls (which the profiler finds, the script's matmul
    floor), with the matmuls, the LayerNorms' gradients and the optimizer's update among them, each timed."""
    with script.trainer(["optim.batch_size=8", "run.threads=1"]) as (step, n_threads, _, _):
        _, matmuls, _ = script.matmul_floor(step, n_threads, rounds=1)
        count, seconds = script.replayed_ops(step, n_threads, repeats=1)
    assert count > matmuls > 0
    assert {"mm", "addmm", "bmm", "_fused_adamw_", "native_layer_norm_backward"} <= set(seconds)
    assert all(s > 0 for s in seconds.values())
