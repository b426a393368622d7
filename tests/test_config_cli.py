"""The newcomer's path through the training configs: listing, run lengths, error origins, a fine-tune's plan."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest
import torch
import yaml
from test_design import image_folder

from vitkit import UserError, VisionTransformer
from vitkit.checkpoint import save_pretrained
from vitkit.cli import build_parser, main
from vitkit.data import build_datasets
from vitkit.train import config_from_dict, load_config, metrics
from vitkit.train.config import REQUIRED
from vitkit.train.config_files import data_section, shipped_configs
from vitkit.train.metrics import Pace, accuracy_figure, format_duration, loss_figure
from vitkit.train.plan import describe_plan
from vitkit.train.recipe import CARRIED_RUN_KEYS, EVALUATIONS, finetune_config, run_name

SOURCE = dict(img_size=32, patch_size=8, width=32, depth=2, num_heads=4, mlp_dim=64, num_classes=7)


def _required_in(path) -> set[str]:
    """The keys a YAML file marks ``???``, read with plain yaml.safe_load."""
    doc = yaml.safe_load(path.read_text())
    return {f"{s}.{k}" for s, items in doc.items() for k, v in (items or {}).items() if v == REQUIRED}


# ---------------------------------------------------------------------------------------------- listing
@pytest.mark.parametrize("name", sorted(shipped_configs()))
def test_every_shipped_config_lists_and_marks_what_is_required(name, capsys):
    capsys.readouterr()
    assert main(["config", name]) == 0
    out = capsys.readouterr().out
    marked = {line.split()[0] for line in out.splitlines() if re.match(r"^\S+\s+.*\s<required>\s", line)}
    assert marked == _required_in(shipped_configs()[name])
    # the file's own values are listed: its first optim key, as the file writes it
    doc = yaml.safe_load(shipped_configs()[name].read_text())
    key, value = next(iter(doc["optim"].items()))
    row = next(line for line in out.splitlines() if line.startswith(f"optim.{key} "))
    assert row.split()[2].strip("'") == str(value) or float(row.split()[2]) == float(value)


def test_a_required_key_given_on_the_command_line_is_listed_with_its_value(capsys):
    assert main(["config", "vit_b16_pretrain", "data.root=/data/i21k"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^data\.root\s+\S.*'/data/i21k'", out, re.M) and "<required>" not in out


def test_train_help_lists_every_shipped_config_with_its_header_line(capsys):
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--help"])
    out = capsys.readouterr().out
    for name, path in shipped_configs().items():
        first = path.read_text().splitlines()[0].lstrip("# ").strip()
        assert re.search(rf"^\s+{name}\s+{re.escape(first)}$", out, re.M), name


# ------------------------------------------------------------------------------------------ run lengths
def test_a_length_on_the_command_line_replaces_the_files_in_the_other_unit():
    assert yaml.safe_load(shipped_configs()["digits"].read_text())["schedule"]["epochs"] == 60
    cfg = load_config("digits", ["schedule.steps=400"])
    assert (cfg.schedule.steps, cfg.schedule.epochs) == (400, None)
    assert yaml.safe_load(shipped_configs()["mpp_digits"].read_text())["schedule"]["steps"] == 1100
    cfg = load_config("mpp_digits", ["schedule.epochs=3"])
    assert (cfg.schedule.steps, cfg.schedule.epochs) == (None, 3)
    # the same unit replaces the file's value; "none" replaces nothing else
    assert load_config("digits", ["schedule.epochs=2"]).schedule.epochs == 2
    assert load_config("digits", ["schedule.steps=none"]).schedule.epochs == 60


def test_both_lengths_on_one_level_are_an_error_naming_that_level(tmp_path, capsys):
    with pytest.raises(UserError, match=r"^command line: schedule.steps=400 and schedule.epochs=3 are both set"):
        load_config("digits", ["schedule.steps=400", "schedule.epochs=3"])
    both = tmp_path / "both.yaml"
    both.write_text("schedule:\n  steps: 5\n  epochs: 2\n")
    for overrides in ([], ["schedule.steps=3"], ["schedule.epochs=none"]):
        with pytest.raises(UserError, match=rf"^{re.escape(str(both))}: schedule.steps=5 and schedule.epochs=2"):
            load_config(both, overrides)
    assert main(["train", str(both), "schedule.steps=3"]) == 2
    assert f"error: {both}: schedule.steps=5" in capsys.readouterr().err


def test_errors_name_where_the_bad_value_came_from(tmp_path):
    with pytest.raises(UserError, match=r"^command line: optim.lr='fast': expected a number"):
        load_config("digits", ["optim.lr=fast"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  lr: fast\n")
    with pytest.raises(UserError, match=rf"^{re.escape(str(bad))}: optim.lr='fast': expected a number"):
        load_config(bad, ["optim.batch_size=32"])  # a good override does not take the blame
    # values fine on each level but not together: the command line's, which changed the file's
    with pytest.raises(UserError, match=r"^command line: optim.batch_size=100 must be a positive multiple"):
        load_config("vit_b16_pretrain", ["data.root=/d", "optim.batch_size=100"])
    with pytest.raises(UserError, match=r"vit_b16_finetune.yaml: data.root, run.init_from: required"):
        load_config("vit_b16_finetune")


def test_an_override_the_files_other_values_depend_on_is_accepted(tmp_path):
    # digits.yaml sets width 64 and 4 heads; the registry's vit_ti16 has 3 heads, which do not divide 64
    fields = load_config("digits", ["model.num_heads=2"]).model.fields
    assert (fields["width"], fields["num_heads"]) == (64, 2)
    with pytest.raises(UserError, match=r"^command line: model: ViTConfig: width 64 is not divisible by num_heads 3"):
        load_config("digits", ["model.num_heads=3"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  lr: fast\n")
    assert load_config(bad, ["optim.lr=1e-3"]).optim.lr == 1e-3  # the command line replaces the file's bad value


# ------------------------------------------------------------------------------------------- fine-tunes
def _source_run(tmp_path, run: dict) -> str:
    """A vitkit run directory: its weights and the config.yaml its training wrote."""
    path = tmp_path / "src"
    save_pretrained(VisionTransformer(**SOURCE), path, metadata={"img_size": 32, "mean": [0.5] * 3, "std": [0.5] * 3})
    (path / "config.yaml").write_text(yaml.safe_dump({"run": run}))
    return str(path)


def test_a_fine_tune_keeps_the_source_runs_machine_settings_and_not_its_identity(tmp_path):
    run = {
        "threads": 1,
        "device": "cpu",
        "amp": "bf16",
        "log_every": 3,
        "plots": False,
        "tensorboard": True,
        "progress": False,
        "eval_batch_size": 64,
        "compile": False,
        "seed": 7,
        "out_dir": "/elsewhere",
        "name": "src",
        "eval_every": 1,
        "save_every": 2,
        "resume": True,
        "objective": "mpp",
    }
    assert set(CARRIED_RUN_KEYS) < set(run)
    source, data = _source_run(tmp_path, run), str(image_folder(tmp_path / "images", per_class=8, size=40))
    cfg = finetune_config(source, data, ["schedule.steps=40"])
    for key in CARRIED_RUN_KEYS:
        assert getattr(cfg.run, key) == run[key], key
    assert (cfg.run.seed, cfg.run.out_dir, cfg.run.name, cfg.run.resume, cfg.run.objective) == (
        0,
        "runs",
        "finetune-src",
        False,
        "classification",
    )
    assert (cfg.run.save_every, cfg.run.eval_every) == (0, 40 // EVALUATIONS)  # the recipe's cadence
    # the one resolution: train with run.init_from gets the same; the user's values win over the source's
    other = config_from_dict({"data": data_section(data), "run": {"init_from": source}}, ["schedule.steps=40"])
    assert other.run == cfg.run.__class__(**{**cfg.run.__dict__, "name": None})
    mine = finetune_config(source, data, ["schedule.steps=40", "run.threads=2", "run.eval_every=7"])
    assert (mine.run.threads, mine.run.eval_every, mine.run.amp) == (2, 7, "bf16")


def test_a_fine_tune_evaluates_about_ten_times_over_its_length(tmp_path):
    ckpt = tmp_path / "pre"
    save_pretrained(VisionTransformer(**SOURCE), ckpt, metadata={"img_size": 32})
    data = str(image_folder(tmp_path / "images", per_class=8, size=40))
    cfg = finetune_config(str(ckpt), data)
    n_train = len(build_datasets(cfg.data)[0])
    steps = cfg.schedule.steps
    assert steps is not None and steps > 2 * EVALUATIONS
    assert cfg.run.eval_every == steps // EVALUATIONS
    assert steps // cfg.run.eval_every in (EVALUATIONS, EVALUATIONS + 1)
    epochs = finetune_config(str(ckpt), data, ["schedule.epochs=30"])
    assert epochs.run.eval_every == max(1, 30 * max(n_train // epochs.optim.batch_size, 1) // EVALUATIONS)


@pytest.mark.parametrize(
    "source, name",
    [
        ("ViT-B_16.npz", "finetune-vit-b_16"),
        ("/models/My Model.safetensors", "finetune-my_model"),
        ("runs/digits/", "finetune-digits"),
        ("vit_b16.augreg_in21k", "finetune-vit_b16.augreg_in21k"),
        ("google/vit-base-patch16-224", "finetune-vit-base-patch16-224"),
    ],
)
def test_fine_tune_run_names_are_readable(source, name):
    assert run_name(source) == name
    assert re.fullmatch(r"[a-z0-9_.-]+", name)


def test_the_plan_says_the_source_data_and_length_and_a_cpus_hours(tmp_path, monkeypatch):
    ckpt = tmp_path / "pre"
    save_pretrained(VisionTransformer(**SOURCE), ckpt, metadata={"img_size": 32})
    data = str(image_folder(tmp_path / "images", per_class=8, size=40))
    cfg = finetune_config(str(ckpt), data, ["optim.name=sgd"])
    train_set, eval_set, info = build_datasets(cfg.data)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    plan = describe_plan(cfg)
    assert f"fine-tuning {ckpt} (" in plan
    assert f"{info.num_classes} classes, {len(train_set)} train / {len(eval_set)} eval images at 32 px" in plan
    assert "sgd lr 0.01" in plan and f"batch {cfg.optim.batch_size};" in plan
    assert f"{cfg.schedule.steps} steps (warmup {cfg.schedule.warmup_steps}, cosine)" in plan
    assert "on this CPU" in plan and "long job" not in plan
    # ViT-B/16 at 384 px, the paper's 10k steps of 512: days on a CPU, said before it starts
    big = config_from_dict(
        {
            "model": {"name": "vit_b16"},
            "data": {"source": "synthetic", "img_size": 384, "synthetic_size": 16},
            "optim": {"batch_size": 512},
            "schedule": {"steps": 10_000},
            "run": {"device": "cpu", "threads": 2},
        }
    )
    plan = describe_plan(big)
    assert re.search(r"about \d+ days by its FLOPs", plan) and "long job for a CPU" in plan


def test_durations_are_said_in_the_unit_a_person_uses():
    assert [format_duration(s) for s in (42, 600, 5 * 3600, 10 * 86400)] == ["42 s", "10 min", "5 hours", "10 days"]


def test_the_pace_is_said_once_after_the_first_steps():
    pace = Pace(step=0, total_steps=100, steps=3)
    said = [pace.tick(step) for step in range(1, 100)]
    lines = [s for s in said if s]
    assert len(lines) == 1 and said.index(lines[0]) == 3  # after step 4: steps 2-4 measured, step 1 the warm-up
    assert "for the 96 steps left" in lines[0]
    assert not any(Pace(step=0, total_steps=4, steps=3).tick(s) for s in range(1, 5))  # too short to matter
    pace = Pace(step=50, total_steps=100, steps=3)  # a resumed run: measured from its own first steps
    resumed = [pace.tick(s) for s in range(51, 100)]
    assert "(steps 52-54): about" in resumed[3] and "for the 46 steps left" in resumed[3]


def test_the_pace_is_said_again_when_the_steps_get_much_faster(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])
    pace, said = Pace(step=0, total_steps=1000, steps=5), {}
    for step in range(1, 1000):
        clock[0] += 1.0 if step <= 50 else 0.01  # the first 50 steps draw their images, the rest read them
        if line := pace.tick(step):
            said[step] = line
    assert said == {
        6: "measured 1 s a step (steps 2-6): about 17 min for the 994 steps left, evaluations aside",
        105: "measured again 0.01 s a step (steps 56-105): about 9 s for the 895 steps left, evaluations aside",
    }
    steady, clock[0] = Pace(step=0, total_steps=1000, steps=5), 0.0
    for step in range(1, 1000):
        clock[0] += 1.0 if step <= 50 else 0.6  # faster, but not twofold: the first line stands
        assert (steady.tick(step) is not None) == (step == 6)


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="busy cores are read from Linux's /proc/stat")
def test_the_pace_says_when_other_work_keeps_the_cores_busy(monkeypatch):
    """Other processes spinning on every core this run may use while its first steps are measured: the pace line
    of a run of two threads says so with the setting that helps; one of one thread, or one with the cores to
    itself, says nothing more."""
    spin = "import time\nt = time.time()\nwhile time.time() - t < 20: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in os.sched_getaffinity(0)]
    try:
        time.sleep(0.5)  # started and spinning
        two, one = Pace(step=0, total_steps=100, steps=3, threads=2), Pace(step=0, total_steps=100, steps=3, threads=1)
        said = []
        for step in range(1, 5):
            said += [two.tick(step), one.tick(step)]
            time.sleep(0.1)  # a step, of which this process takes nothing: the spinners have the cores
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    two_line, one_line = said[6], said[7]
    assert one_line is not None and "\n" not in one_line and "busy" not in one_line
    assert two_line is not None and two_line.startswith("measured") and two_line.count("\n") == 1
    assert re.fullmatch(
        r"  busy cores: other processes kept \d+\.\d of the \d+ cores this run may use busy during these steps, "
        r"where its 2 threads wait for each other: run.threads=1 is likely faster now",
        two_line.splitlines()[1],
    )
    monkeypatch.setattr(metrics, "busy_core_seconds", time.process_time)  # every busy core-second is this process's
    alone = Pace(step=0, total_steps=100, steps=3, threads=2)
    assert "busy" not in next(line for s in range(1, 5) if (line := alone.tick(s)))


# -------------------------------------------------------------------------------------------------- plots
def _records(top1: list[float]) -> list[dict]:
    train = [{"kind": "train", "step": i + 1, "loss": 2.0 - 0.1 * i} for i in range(len(top1))]
    evals = [
        {"kind": "eval", "step": i + 1, "eval_loss": 1.0, "eval_top1": t, "eval_top5": 1.0} for i, t in enumerate(top1)
    ]
    return train + evals


def test_the_accuracy_axis_is_zero_to_a_hundred_percent():
    ax = accuracy_figure(_records([0.5, 0.9, 1.0])).axes[0]
    assert ax.get_ylim() == (0.0, 1.0)  # the view: no tick past 100%, however close the curve comes
    shown = [t for t in ax.yaxis.get_majorticklocs() if 0 <= t <= 1]
    formatter = ax.yaxis.get_major_formatter()
    assert [formatter(t) for t in (shown[0], shown[-1])] == ["0%", "100%"]


def test_the_loss_legend_names_mixup_and_cutmix():
    ax = loss_figure(_records([0.5, 0.6]), label_smoothing=0.1, mixup=0.8, cutmix=1.0).axes[0]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[0] == "train loss (mixup 0.8 / cutmix 1 / label smoothing 0.1: soft targets)"
    ax = loss_figure(_records([0.5, 0.6]), mixup=0.2).axes[0]
    assert ax.get_legend().get_texts()[0].get_text() == "train loss (mixup 0.2: soft targets)"
