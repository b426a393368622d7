"""A sweep's claims: each ordering a spec claims is tested by the aggregate, the test agrees with scipy's, and the
verdicts read the spec's claims as one family (Holm's adjustment)."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
import torch
import yaml
from scipy import stats as scipy_stats
from test_sweep import tiny_digits

from vitkit.errors import UserError
from vitkit.sweep import load_spec, run_sweep, shipped_sweeps
from vitkit.sweep.aggregate import claim_results
from vitkit.sweep.stats import compare, holm, t_critical, t_two_sided


@pytest.mark.parametrize("df", [1, 2, 3.7, 9, 30, 400])
def test_the_t_tail_and_quantile_are_scipys(df):
    for t in (0.0, 0.05, 1.0, 2.5, 7.0, 60.0):
        assert t_two_sided(t, df) == pytest.approx(2 * scipy_stats.t.sf(t, df), rel=1e-10, abs=1e-300)
    assert t_critical(df) == pytest.approx(scipy_stats.t.ppf(0.975, df), rel=1e-9)


def test_paired_when_the_seeds_match_else_welch_as_scipy_computes_them():
    rng = random.Random(3)
    high = {s: rng.gauss(0.6, 0.05) for s in range(5)}
    low = {s: rng.gauss(0.5, 0.05) for s in range(5)}
    paired = compare(high, low)
    assert paired is not None and paired.test == "paired (5 seeds)"
    want = scipy_stats.ttest_rel(list(high.values()), list(low.values()))
    assert paired.p == pytest.approx(want.pvalue, rel=1e-9)
    interval = want.confidence_interval(0.95)
    assert (paired.low, paired.high) == pytest.approx((interval.low, interval.high), rel=1e-9)
    apart = compare({s: high[s] for s in range(3)}, {s + 10: low[s] for s in range(4)})
    want = scipy_stats.ttest_ind([high[s] for s in range(3)], [low[s] for s in range(4)], equal_var=False)
    assert apart is not None and apart.test == "Welch (3, 4 seeds)" and apart.p == pytest.approx(want.pvalue, rel=1e-9)
    assert compare({0: 1.0}, {0: 0.5}) is None  # one seed: nothing to test against
    assert compare({0: 1.0, 1: 2.0}, {0: 0.0, 1: 1.0}).verdict == "shown"  # the same difference on every seed


def test_holms_adjustment_is_the_closed_test_of_bonferronis():
    """A claim's Holm p is the largest, over every subset of the family that holds it, of that subset's Bonferroni p
    (its size times its smallest p, at most 1): the closed testing that Holm's step-down method shortcuts."""
    rng = random.Random(5)
    for m in range(1, 8):
        ps = [rng.choice([rng.random(), rng.random() * 0.05, 0.01, 0.3]) for _ in range(m)]  # ties included
        subsets = [s for k in range(1, m + 1) for s in itertools.combinations(range(m), k)]
        want = [max(min(1.0, len(s) * min(ps[j] for j in s)) for s in subsets if i in s) for i in range(m)]
        assert holm(ps) == pytest.approx(want, rel=1e-12)


def test_claims_each_below_005_alone_are_not_shown_when_the_family_is_not(tmp_path):
    """Two claims, each with p < 0.05 alone (paired, 3 seeds) but not after Holm's adjustment for the pair, are not
    shown; when one of them is made strong (p < 0.025), both are."""
    lr = {"high": 0.01, "low": 1e-6}
    diffs = {"eval_top1": [0.10, 0.12, 0.05], "train.loss": [0.10, 0.13, 0.06]}
    records = [
        {"seed": s, "optim.lr": lr[side], **{m: 0.5 + (d[s] if side == "high" else 0.0) for m, d in diffs.items()}}
        for s in range(3)
        for side in lr
    ]
    claims = [{"metric": m, "higher": {"optim.lr": 0.01}, "lower": {"optim.lr": 1e-6}} for m in diffs]
    spec = load_spec(_spec(tmp_path / "s.yaml", claims))
    found = claim_results(spec, records)
    alone = [scipy_stats.ttest_1samp(d, 0.0).pvalue for d in diffs.values()]
    assert max(alone) < 0.05 and [c["p"] for c in found] == pytest.approx(alone, rel=1e-9)
    assert [c["p_holm"] for c in found] == pytest.approx([2 * min(alone)] * 2, rel=1e-9)  # 0.083: both over 0.05
    assert [c["verdict"] for c in found] == ["not shown", "not shown"]
    strong = [{**r, "train.loss": r["train.loss"] * (1 if r["optim.lr"] == 1e-6 else 1.2)} for r in records]
    diffs_strong = [1.2 * (0.5 + d) - 0.5 for d in diffs["train.loss"]]
    assert scipy_stats.ttest_1samp(diffs_strong, 0.0).pvalue < 0.025
    assert [c["verdict"] for c in claim_results(spec, strong)] == ["shown", "shown"]


TINY = tiny_digits(
    model={"width": 32, "mlp_dim": 64},
    schedule={"steps": 80, "warmup_steps": 5},
    run={"log_every": 10, "save_every": 0, "eval_batch_size": 512},
)


def _spec(path: Path, claims, overrides: tuple[str, ...] = ()) -> Path:
    doc = {
        "overrides": list(overrides),
        "config": TINY,
        "grid": {"optim.lr": [0.01, 1e-6]},
        "seeds": [0, 1, 2],
        "metrics": ["eval_top1", "train.loss"],
        "claims": claims,
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def test_a_sweeps_claims_are_tested_printed_and_written(tmp_path):
    claims = [
        {"metric": "eval_top1", "higher": {"optim.lr": 0.01}, "lower": {"optim.lr": 1e-6}},
        {"metric": "train.loss", "higher": {"optim.lr": 0.01}, "lower": {"optim.lr": 1e-6}},
    ]
    lines: list[str] = []
    # 240 steps: long enough that the ordering holds on every torch and CPU tried (at 80, a torch 2.11 run had p = 0.12)
    run_sweep(_spec(tmp_path / "s.yaml", claims, ["schedule.steps=240"]), tmp_path / "out", log=lines.append)
    doc = json.loads((tmp_path / "out" / "sweep.json").read_text())
    for claim, metric in zip(doc["claims"], ("eval_top1", "train.loss")):
        high = [r[metric] for r in sorted(doc["runs"], key=lambda r: r["seed"]) if r["optim.lr"] == 0.01]
        low = [r[metric] for r in sorted(doc["runs"], key=lambda r: r["seed"]) if r["optim.lr"] == 1e-6]
        want = scipy_stats.ttest_rel(high, low)  # recomputed from the runs' own numbers
        assert claim["p"] == pytest.approx(want.pvalue, rel=1e-9) and claim["test"] == "paired (3 seeds)"
    assert [c["p_holm"] for c in doc["claims"]] == holm([c["p"] for c in doc["claims"]])
    # a learning rate of 1e-6 learns nothing in 240 steps: its accuracy is lower, its loss higher
    assert [c["verdict"] for c in doc["claims"]] == ["shown", "reversed"]
    printed = [line for line in lines if line.startswith(("eval_top1:", "train.loss:"))]
    assert printed[0].startswith("eval_top1: optim.lr=0.01 > optim.lr=1e-06: shown (difference ")
    md = (tmp_path / "out" / "sweep.md").read_text()
    assert "## Claims" in md and "- train.loss: optim.lr=0.01 > optim.lr=1e-06: reversed" in md
    records = [{**r, "eval_top1": r["eval_top1"]} for r in doc["runs"] if r["seed"] == 0]
    one_seed = claim_results(load_spec(tmp_path / "s.yaml"), records)
    assert one_seed[0]["verdict"] == "untested: 1 and 1 seeds finished (2 or more each)"


@pytest.mark.parametrize(
    ("claim", "error"),
    [
        ({"metric": "eval_top5", "higher": {"optim.lr": 0.01}, "lower": {"optim.lr": 1e-6}}, "is not one of"),
        ({"metric": "eval_top1", "higher": {"optim.wd": 0.1}, "lower": {"optim.lr": 1e-6}}, "expected values of keys"),
        ({"metric": "eval_top1", "higher": {"optim.lr": 0.1}, "lower": {"optim.lr": 1e-6}}, "is 0 rows of the sweep"),
        ({"metric": "eval_top1", "higher": {"optim.lr": 0.01}}, "expected the keys metric, higher and lower"),
    ],
)
def test_a_claim_that_names_no_single_row_is_refused(tmp_path, claim, error):
    with pytest.raises(UserError, match=error):
        load_spec(_spec(tmp_path / "s.yaml", [claim]))


@pytest.mark.parametrize("name", sorted(shipped_sweeps()))
def test_every_shipped_experiment_states_its_claims(name):
    spec = load_spec(name)
    assert spec.claims, f"{name}: the paper's orderings it tests"


def test_a_baseline_without_the_figures_key_is_named_by_what_it_sets():
    """The mpp figure's x is run.objective; the scratch cell has none: its tick says pretrain=false, not null."""
    from vitkit.sweep.aggregate import Row
    from vitkit.sweep.figures import _category

    rows = [Row({"run.objective": "mpp"}, 1, {}, {}, [0]), Row({"pretrain": False}, 1, {}, {}, [0])]
    assert [_category("run.objective", x, rows) for x in ("mpp", None)] == ["mpp", "pretrain=false"]


def test_compute_is_three_forward_passes_an_image_counted_by_torch(tmp_path):
    """The ``compute`` metric (a figure's x for Fig. 5) against torch's own FLOP counter on the trained model."""
    from torch.utils.flop_counter import FlopCounterMode

    import vitkit

    config = {**TINY, "model": {"name": "bit_r50x1", "layers": [1, 1], "width_factor": 0.5}}
    doc = {"config": config, "grid": {"schedule.steps": [2, 4]}, "metrics": ["eval_top1", "compute"]}
    doc["overrides"] = ["schedule.warmup_steps=0"]
    doc["figure"] = {"x": "compute"}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
    result = run_sweep(tmp_path / "s.yaml", tmp_path / "out", log=lambda line: None)
    model = vitkit.load_model(tmp_path / "out" / "steps-2_seed-0").eval()
    with FlopCounterMode(display=False) as counter:
        model(torch.zeros(1, 1, 16, 16))
    assert [r.mean["compute"] for r in result.rows] == [3 * counter.get_total_flops() * 32 * s for s in (2, 4)]
    assert (tmp_path / "out" / "eval_top1.png").is_file()
