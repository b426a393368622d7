"""A sweep's cells run seed by seed, the largest planned training first within a seed, and a time limit stops the
running cells with their state saved, starts no other and tabulates those that finished (exit status 3)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml
from test_sweep import tiny_digits

import vitkit.sweep.pool as pool
from vitkit.cli import main
from vitkit.sweep import load_spec
from vitkit.sweep.aggregate import run_compute
from vitkit.sweep.run import plan_cell, run_status
from vitkit.train.plan import planned_flops

TINY = tiny_digits(run={"log_every": 2, "save_every": 2, "eval_batch_size": 512})


def _spec(path: Path, **changes) -> Path:
    doc = {"config": TINY, "seeds": [0, 1], "metrics": ["eval_top1"], **changes}
    path.write_text(yaml.safe_dump(doc))
    return path


def test_cells_run_seed_by_seed_and_the_largest_training_first(tmp_path):
    """Depth 2 trains more FLOPs than depth 1 for the same steps, and 12 steps more than 6: within each seed the
    order is by the product, and every setting of seed 3 (the spec's first) runs before any of seed 1."""
    grid = {"model.depth": [1, 2], "schedule.steps": [6, 12]}
    spec = load_spec(_spec(tmp_path / "s.yaml", grid=grid, seeds=[3, 1]))
    plans = [plan_cell(spec, cell, tmp_path / "out", threads=1) for cell in spec.expand()]
    order = [(p.seed, p.first.model.fields["depth"], p.first.schedule.steps) for p in pool.run_order(plans)]
    # forward FLOPs of an image, by the paper's formulas (float64, independent of vitkit.models.flops)
    flops = {depth: _vit_forward_flops(depth) for depth in (1, 2)}
    assert flops[2] * 6 > flops[1] * 12 or flops[2] * 6 < flops[1] * 12  # no tie, so the order is defined
    expected = []
    for seed in (3, 1):
        settings = [(d, s) for d in (1, 2) for s in (6, 12)]
        expected += [(seed, d, s) for d, s in sorted(settings, key=lambda ds: -flops[ds[0]] * ds[1])]
    assert order == expected


def _vit_forward_flops(depth: int) -> float:
    """TINY's ViT (width 16, MLP 32, patch 4) on the digits (16 px, one channel, ten classes): 16 patches and a class
    token, 2 FLOPs per multiply-add in the patch embedding, the q/k/v/out projections, attention's two products, the
    MLP and the head."""
    width, mlp, patch, chans, classes = 16, 32, 4, 1, 10
    patches = (16 // patch) ** 2
    tokens = patches + 1
    embed = 2 * patches * (patch * patch * chans) * width
    block = 2 * tokens * (4 * width * width + 2 * width * mlp) + 2 * 2 * tokens * tokens * width
    return embed + depth * block + 2 * width * classes


def test_the_planned_flops_are_what_the_finished_run_counts(tmp_path):
    """Two paths to a run's training FLOPs: planned from its config (train.plan) and counted from the finished run
    (the sweep's compute metric), both 3 x the forward FLOPs an image counted by hand x 4 steps of 32 images."""
    spec = load_spec(_spec(tmp_path / "s.yaml", overrides=["schedule.steps=4"], seeds=[0]))
    out = tmp_path / "out"
    assert main(["sweep", str(tmp_path / "s.yaml"), "--out", str(out)]) == 0
    (cell,) = spec.expand()
    plan = plan_cell(spec, cell, out, threads=1)
    assert planned_flops(plan.first) == run_compute(out / cell.name) == 3 * _vit_forward_flops(1) * 32 * 4


def test_a_time_limit_stops_the_running_cells_saved_starts_no_other_and_tabulates_the_finished(
    tmp_path, monkeypatch, capsys
):
    """Two workers: seed 0's long cell (100,000 steps) and short one (4) start together; once the short one has
    finished and the long one has saved a state, the sweep's clock passes its limit. The long cell stops with its
    state saved, seed 1's cells do not finish (the one a freed worker may have taken is stopped too, the last never
    starts), the table holds the finished cell alone, and the command says so with exit status 3."""
    spec_path = _spec(tmp_path / "s.yaml", grid={"schedule.steps": [4, 100000]})
    out = tmp_path / "out"
    cells = {(c.seed, dict(c.values)["schedule.steps"]): out / c.name for c in load_spec(spec_path).expand()}
    started = time.monotonic()

    def clock() -> float:  # past any limit once the state to test is reached (or after 3 minutes: then it fails)
        reached = run_status(cells[0, 4]) == "finished" and run_status(cells[0, 100000]) == "partial"
        return 1e9 if reached or time.monotonic() - started > 180 else 0.0

    monkeypatch.setattr(pool, "monotonic", clock)
    status = main(["sweep", str(spec_path), "--out", str(out), "--jobs", "2", "--time-limit", "5"])
    captured = capsys.readouterr()
    assert status == 3, captured.err
    assert captured.err.strip().splitlines()[-1] == (
        "vitkit sweep: stopped at the time limit (5 min): 1 of 4 cells finished, tabulated; the same sweep command "
        "goes on"
    )
    assert run_status(cells[0, 4]) == "finished" and run_status(cells[0, 100000]) == "partial"
    assert run_status(cells[1, 100000]) in ("absent", "partial", "started") and not cells[1, 4].exists()
    assert "time limit reached" in captured.out and f"{cells[1, 4].name}: not started" in captured.out
    doc = json.loads((out / "sweep.json").read_text())
    assert [(row["schedule.steps"], row["n"]) for row in doc["rows"]] == [(4, 1), (100000, 0)]
    assert main(["sweep", str(spec_path), "--out", str(out), "--aggregate-only", "--time-limit", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "vitkit sweep: error: --time-limit: --aggregate-only trains nothing to stop, got 1"
    )


def test_a_cell_whose_data_cannot_be_read_runs_last_and_fails_alone(tmp_path, capsys):
    """Ordering reads each cell's data: a missing folder is no error of the whole sweep before any work, but that
    cell's own, in one line, once the others have run."""
    missing = tmp_path / "missing"
    spec_path = _spec(tmp_path / "s.yaml", grid={"data.source": ["folder", "digits"]}, seeds=[0])
    doc = yaml.safe_load(spec_path.read_text())
    doc["overrides"] = [f"data.root={missing}", "schedule.steps=4"]
    spec_path.write_text(yaml.safe_dump(doc))
    spec = load_spec(spec_path)
    plans = [plan_cell(spec, cell, tmp_path / "out", threads=1) for cell in spec.expand()]
    assert [p.first.data.source for p in pool.run_order(plans)] == ["digits", "folder"]
    assert main(["sweep", str(spec_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"vitkit sweep: error: {plans[0].name}: {missing}: data directory does not exist"]
    assert run_status(tmp_path / "out" / plans[1].name) == "finished"
