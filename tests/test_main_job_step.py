"""benchmarks/main_job_step.py: the replay of a training step's operator calls (every ATen call of one step recorded
below autograd and timed alone), and the shipped step of two checkouts side by side."""

from __future__ import annotations

import re
import shutil
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


def test_two_checkouts_are_timed_side_by_side_each_in_its_own_process(script, tmp_path, capsys):
    """--other-tree: the shipped step of this checkout and of another (here a copy of this one's vitkit), each in a
    process that imports its own tree's vitkit, round by round; both medians and the paired ratio are printed."""
    package = Path(script.__file__).resolve().parents[1] / "vitkit"
    shutil.copytree(package, tmp_path / "vitkit", ignore=shutil.ignore_patterns("__pycache__"))
    script.main(["--other-tree", str(tmp_path), "--rounds", "2", "--steps", "1", "--results", str(tmp_path / "r.md")])
    out = capsys.readouterr().out
    this, other = (line for line in out.splitlines() if "ms a step" in line)
    assert this.strip().startswith("this tree") and this.endswith(f"vitkit from {package}")
    assert other.strip().startswith("other tree") and other.endswith(f"vitkit from {tmp_path / 'vitkit'}")
    assert re.search(r"this tree / other tree, step time: [\d.]+x \(95% CI .*, 2 rounds\)", out), out
    assert "this tree / other tree, step time: " in (tmp_path / "r.md").read_text()


def test_another_tree_must_be_a_checkout_and_is_timed_alone(script, tmp_path):
    with pytest.raises(SystemExit):
        script.main(["--other-tree", str(tmp_path)])  # no vitkit package there
    (tmp_path / "vitkit").mkdir()
    (tmp_path / "vitkit" / "__init__.py").write_text("")
    with pytest.raises(SystemExit):
        script.main(["--other-tree", str(tmp_path), "--arm", "a=model.gelu=exact"])
