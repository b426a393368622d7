"""Sweeps: specs expand to named cells, a killed sweep resumes without redoing finished cells, the table equals a
recomputation from the runs' own metrics, and every shipped experiment's quick variant runs."""

from __future__ import annotations

import csv
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from vitkit.cli import main
from vitkit.errors import UserError
from vitkit.sweep import load_spec, run_sweep, shipped_sweeps
from vitkit.sweep.run import default_threads, plan_cell, run_status
from vitkit.train import train
from vitkit.train.rundir import write_config

TINY_DIGITS = {
    "model": {"name": "vit_ti16", "patch_size": 4, "width": 16, "depth": 1, "num_heads": 2, "mlp_dim": 32},
    "data": {"source": "digits"},
    "optim": {"name": "adamw", "lr": 1e-3, "batch_size": 32},
    "schedule": {"steps": 30, "warmup_steps": 2},
    "run": {"log_every": 5, "eval_every": 0, "save_every": 10, "plots": False, "threads": 1},
}


def tiny_digits(**sections: dict) -> dict:
    """TINY_DIGITS with keyword sections updating its own (a new dict)."""
    return {name: {**values, **sections.get(name, {})} for name, values in TINY_DIGITS.items()}


def _write_spec(path: Path, **changes) -> Path:
    doc = {
        "config": TINY_DIGITS,
        "overrides": ["run.eval_batch_size=512"],
        "grid": {"model.depth": [1, 2], "optim.lr": [0.001, 0.003]},
        "seeds": [0, 1],
        "metrics": ["eval_top1", "eval_loss", "train.loss"],
        "figure": {"x": "optim.lr", "lines": ["model.depth"], "log_x": True},
        **changes,
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def test_a_grid_of_more_runs_than_a_sweep_takes_is_refused_before_any_work(tmp_path, capsys):
    """Five axes of 100 values are 10**10 runs: counted, not built, and refused in one line; nothing is written."""
    values = list(range(100))
    keys = ["optim.lr", "optim.weight_decay", "optim.grad_clip", "optim.label_smoothing", "model.depth"]
    spec = _write_spec(tmp_path / "huge.yaml", grid=dict.fromkeys(keys, values), seeds=[0], figure={})
    out = tmp_path / "out"
    assert main(["sweep", str(spec), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    axes = " x ".join(f"100 {k}" for k in sorted(keys))  # the spec's order (safe_dump sorts the keys)
    assert err.endswith(f"10,000,000,000 runs ({axes} x 1 seeds); a sweep runs at most 10,000"), err
    assert not out.exists()
    at_most = _write_spec(tmp_path / "s.yaml", grid={"optim.lr": list(range(5000))}, figure={})
    assert len(load_spec(at_most).expand()) == 10_000  # 5,000 x 2 seeds: the most a sweep takes


def test_spec_expands_to_named_cells_with_skips_and_a_quick_variant(tmp_path):
    spec = load_spec(
        _write_spec(
            tmp_path / "s.yaml",
            skip=[{"model.depth": 2, "optim.lr": 0.003}],
            cells=[{"model.width": 16}, {"model.width": 32}],
            quick={"grid": {"model.depth": [1]}, "seeds": [7], "overrides": ["schedule.steps=1"]},
        )
    )
    cells = spec.expand()
    assert len(cells) == 2 * (4 - 1) * 2  # widths x (grid minus the skipped point) x seeds
    assert cells[0].name == "width-16_depth-1_lr-0.001_seed-0"
    assert cells[0].overrides() == ["model.width=16", "model.depth=1", "optim.lr=0.001"]
    assert len({c.name for c in cells}) == len(cells)
    assert not any(dict(c.values) == {"model.width": 16, "model.depth": 2, "optim.lr": 0.003} for c in cells)
    assert [c.name for c in load_spec(tmp_path / "s.yaml").expand()] == [c.name for c in cells]  # deterministic
    quick = load_spec(tmp_path / "s.yaml", quick=True)
    assert {c.seed for c in quick.expand()} == {7} and quick.overrides[-1] == "schedule.steps=1"
    # two keys with the same last part are named in full; mistakes are one-line errors
    spec2 = load_spec(_write_spec(tmp_path / "t.yaml", grid={"data.img_size": [16], "model.img_size": [16]}, figure={}))
    assert spec2.expand()[0].name == "data.img_size-16_model.img_size-16_seed-0"
    with pytest.raises(UserError, match="unknown keys"):
        load_spec(_write_spec(tmp_path / "u.yaml", grids={}))
    with pytest.raises(UserError, match="figure"):
        load_spec(_write_spec(tmp_path / "v.yaml", figure={"x": "optim.wd"}))
    # each cell's threads: its config's, capped at cores // jobs (a config without a count gets cores // jobs)
    plan = plan_cell(spec2, spec2.expand()[0], tmp_path, threads=1)
    assert plan.first.run.threads == 1 and plan.first.run.name == "data.img_size-16_model.img_size-16_seed-0"
    assert plan.first.run.out_dir == str(tmp_path) and plan.first.run.seed == 0 and plan.finetune is None
    free = {**TINY_DIGITS, "run": {**TINY_DIGITS["run"], "threads": 0}}
    spec3 = load_spec(_write_spec(tmp_path / "w.yaml", config=free))
    assert plan_cell(spec3, spec3.expand()[0], tmp_path, threads=default_threads(1)).first.run.threads == (
        len(os.sched_getaffinity(0))
    )
    with pytest.raises(UserError, match="no quick section"):
        load_spec(tmp_path / "t.yaml", quick=True)


def _independent_table(out: Path) -> dict[tuple[int, float], dict[str, list[float]]]:
    """Per (depth, lr) as each run's own config.yaml says: the last eval and train records of its metrics.jsonl."""
    groups: dict[tuple[int, float], dict[str, list[float]]] = {}
    for run_dir in sorted(p for p in out.iterdir() if p.is_dir()):
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        key = (int(config["model"]["depth"]), float(config["optim"]["lr"]))
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        last_eval = [r for r in records if r["kind"] == "eval"][-1]
        last_train = [r for r in records if r["kind"] == "train"][-1]
        assert last_eval["step"] == last_train["step"] == config["schedule"]["steps"]
        found = groups.setdefault(key, {"eval_top1": [], "eval_loss": [], "train.loss": []})
        found["eval_top1"].append(last_eval["eval_top1"])
        found["eval_loss"].append(last_eval["eval_loss"])
        found["train.loss"].append(last_train["loss"])
    return groups


def _last_eval(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "eval"][-1]


def _files_of(run_dir: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir() if p.is_file()}


def test_a_killed_sweep_resumes_without_redoing_finished_cells_and_aggregates_its_runs(tmp_path):
    spec_path = _write_spec(tmp_path / "grid.yaml", grid={"model.depth": [1, 2], "optim.lr": [0.001]})
    out = tmp_path / "out"
    # in the order they run: seed by seed, the deeper model (the larger training) first within a seed
    cells = sorted(load_spec(spec_path).expand(), key=lambda c: (c.seed, -dict(c.values)["model.depth"]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "vitkit.cli", "sweep", str(spec_path), "--out", str(out)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:  # killed once the first cell has finished and the second has saved a train state (step 10 of 30)
        deadline = time.monotonic() + 120
        while run_status(out / cells[1].name) not in ("partial", "finished"):
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "the second cell saved no state"
            time.sleep(0.01)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    before = {c.name: run_status(out / c.name) for c in cells}
    assert before[cells[0].name] == "finished"
    assert before[cells[1].name] == "partial", "killed too late: the second cell had finished"
    # a run killed before its first save: a directory with its config and no state, started again from scratch
    (out / cells[2].name).mkdir()
    write_config(out / cells[2].name, plan_cell(load_spec(spec_path), cells[2], out, threads=1).first)
    (out / cells[2].name / "metrics.jsonl").write_text('{"kind": "train", "step": 5, "loss": 2.3')  # cut short
    before[cells[2].name] = run_status(out / cells[2].name)
    assert before[cells[2].name] == "started"
    finished = [name for name, status in before.items() if status == "finished"]
    stamps = {name: _files_of(out / name) for name in finished}

    result = run_sweep(spec_path, out, jobs=2, log=lambda line: None)  # the rest in two spawned processes
    assert not result.failed
    for name, status in before.items():
        expected = {"finished": "skipped", "partial": "resumed"}.get(status, "ran")
        assert result.actions[name] == [expected], name
    assert all(_files_of(out / name) == stamps[name] for name in finished)  # finished cells untouched
    assert all(run_status(out / c.name) == "finished" for c in cells)
    # the resumed cell ends as a run never interrupted would
    plan = plan_cell(load_spec(spec_path), cells[1], tmp_path / "again", threads=1)
    assert train(plan.first).metrics == {
        k: v
        for k, v in _last_eval(out / cells[1].name).items()
        if k in ("eval_loss", "eval_top1", "eval_top5", "eval_images")
    }
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == sorted(c.name for c in cells)  # no stray dirs

    # the table against an independent recomputation from the run directories
    expected = _independent_table(out)
    with open(out / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(expected) == 2
    for row in rows:
        want = expected[(int(row["model.depth"]), float(row["optim.lr"]))]
        assert int(row["n"]) == 2
        for metric, values in want.items():
            assert float(row[f"{metric}_mean"]) == pytest.approx(statistics.fmean(values), rel=1e-12)  # full precision
            assert float(row[f"{metric}_std"]) == pytest.approx(statistics.stdev(values), rel=1e-9, abs=1e-15)
    doc = json.loads((out / "sweep.json").read_text())
    assert len(doc["runs"]) == 4 and doc["axes"] == ["model.depth", "optim.lr"]
    md = (out / "sweep.md").read_text()
    assert md.count("\n| ") == 3  # header + 2 rows
    assert {p.name for p in result.files} >= {"eval_top1.png", "eval_loss.png", "train_loss.png"}

    # re-aggregation reads the runs and trains nothing
    stamps = {c.name: _files_of(out / c.name) for c in cells}
    (out / "sweep.csv").unlink()
    assert main(["sweep", str(spec_path), "--out", str(out), "--aggregate-only"]) == 0
    with open(out / "sweep.csv") as f:
        assert list(csv.DictReader(f)) == rows
    assert {c.name: _files_of(out / c.name) for c in cells} == stamps
    with pytest.raises(UserError, match="'eval_top9' is not in the last eval record"):
        run_sweep(
            _write_spec(
                tmp_path / "grid.yaml", metrics=["eval_top9"], grid={"model.depth": [1, 2], "optim.lr": [0.001]}
            ),
            out,
            aggregate_only=True,
        )


@pytest.mark.parametrize("name", sorted(shipped_sweeps()))
def test_the_quick_variant_of_each_shipped_experiment_runs(name, tmp_path):
    spec = load_spec(name, quick=True)
    full = load_spec(name)
    assert len(full.expand()) > len(spec.expand())  # the quick variant is a cut of the full experiment
    for cell in full.expand():  # every config of the full experiment builds (the runs are for later)
        plan_cell(full, cell, tmp_path / "full", threads=1)
    result = run_sweep(name, tmp_path, quick=True, log=lambda line: None)
    assert not result.failed
    assert all(r.n == len(spec.seeds) for r in result.rows)
    for r in result.rows:
        for m in spec.metrics:
            no_attention = m.startswith("attention.") and str(r.values.get("model.name")).startswith("bit")
            no_first_run = r.values.get("pretrain") is False and not m.startswith("finetune.")
            assert (r.mean[m] is None) == (no_attention or no_first_run), (r.values, m)
    assert {p.name for p in result.files} >= {"sweep.csv", "sweep.json", "sweep.md"}
    assert all(p.is_file() and p.stat().st_size > 0 for p in result.files)


def test_a_diverging_cell_fails_alone_and_the_command_says_so(tmp_path, capsys):
    spec_path = _write_spec(
        tmp_path / "d.yaml",
        grid={"optim.lr": [0.001, 1e30]},
        seeds=[0],
        overrides=["schedule.warmup_steps=0", "run.save_every=0", "optim.grad_clip=0"],
        figure={},
    )
    assert main(["sweep", str(spec_path), "--out", str(tmp_path / "out"), "schedule.steps=3"]) == 2  # every run
    err = capsys.readouterr().err
    assert "vitkit sweep: error: lr-1e+30_seed-0: non-finite" in err
    assert run_status(tmp_path / "out" / "lr-0.001_seed-0") == "finished"
    assert yaml.safe_load((tmp_path / "out" / "lr-0.001_seed-0" / "config.yaml").read_text())["schedule"]["steps"] == 3
    with open(tmp_path / "out" / "sweep.csv") as f:
        assert [row["n"] for row in csv.DictReader(f)] == ["1", "0"]
