"""vitkit against Hugging Face transformers (and timm, where installed) at equal precision: the speed targets.

    python benchmarks/speed_targets.py                     # everything (about half an hour on 2 cores)
    python benchmarks/speed_targets.py --only precision --batch-sizes 8 --json out.json --results out.md

1. precision: ViT-B/16 inference at batch 1, 8 and 64, in fp32, bf16 and int8, every library given the same
   switch, the one its documentation gives: fp32 as built; bf16 by ``model.to(torch.bfloat16)`` (vitkit:
   ``optimize_for_inference(model, "bf16")``); int8 by ``torch.ao.quantization.quantize_dynamic`` of every
   nn.Linear (vitkit: ``optimize_for_inference(model, "int8")``: int8 x int8 matmuls with per-token activation
   scales, compiled by default since its layers are plain tensor ops; the peers' quantised layers are opaque to
   torch.compile and run eagerly). ``--compile`` adds torch.compile with inductor freezing to every fp32 and
   bf16 row alike. The matmul peak of each precision (a large fp32, bf16 or int8 x int8 -> int32 product through
   the fastest of torch's kernel and the kernel of vitkit's packed-weight layers, harness.matmul_probe),
   repeated to last as long as vitkit's row of that precision, is timed in the same rounds, and a row's share of
   it is the median over rounds of its rate over that round's peak. Targets: vitkit >= 1.15x the best peer of
   the same precision (95% interval above it) and >= 80% of that precision's peak (FLOPs executed). Beside the
   speed, each switch's accuracy cost: top-1 agreement with fp32 and logit error on held-out images of (a) a
   digits run (--digits-run, else one trained here) and (b) an official-format ViT-S/16 (--official, else a
   randomly initialised one, which the output says). In fp32 and bf16 a row "vitkit, peers' switch" gives
   vitkit's plain model (vitkit.models, no vitkit.accel) the peers' switch instead (as built;
   ``model.to(torch.bfloat16)``): the model code alone beside the peers, without what optimize_for_inference adds.
2. train: ViT-S/16 training step (forward, cross-entropy, backward, fused AdamW for every library), batch 32,
   in fp32 and with bf16 autocast (where bf16 is native), vitkit's model through ``optimize_for_training(model)``
   (harness.vitkit_step), against the same targets; step memory beside it.

Every ratio is the median of per-round paired ratios with its 95% bootstrap interval; rounds go on until every
interval is within +-2% (--target) or --max-repeats, and a ratio whose interval is wider than its distance from
1 is flagged. The load average is checked before and after each comparison. Outputs are checked for parity
before anything is timed. Nothing here is a test: it prints what it measures. One setting of one model, with any
peer: benchmarks/bench_vit.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from harness import (
    PEERS_SWITCH,
    BenchConfig,
    BenchReport,
    MatmulProbe,
    accuracy_lines,
    best_rows,
    check_rows,
    command_line,
    digits_model,
    hf_peer,
    int8_compile_note,
    load_average,
    load_warnings,
    matmul_probe,
    official_model,
    paired_ratio_stats,
    paired_utilisation,
    precision_rows,
    recorded,
    run_bench,
    settled,
    step_seconds,
    switch_accuracy,
    time_alternating,
    timm_peer,
)
from torch import nn

from vitkit.accel.first_token import applies as first_token_applies
from vitkit.accel.inference import can_compile
from vitkit.accel.training import tune_cpu_allocator
from vitkit.device import bf16_is_fast
from vitkit.models.flops import model_flops


def log(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


PEER_NAMES = {"hf": "transformers", "timm": "timm"}
PRECISIONS = ("fp32", "bf16", "int8")
PEAK_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}
TARGET_RATIO = 1.15  # vitkit over the best peer of the same precision
TARGET_UTILISATION = 0.80  # of the matmul peak of that precision, FLOPs executed


class Comparison(NamedTuple):
    """One batch size's rows, built and parity-checked: the timed steps, each precision's matmul probe and its
    FLOPs, and the FLOPs a forward executes (vitkit's switch: its class-token-only last block; a peer: the model's)."""

    batch_size: int
    precisions: list[str]
    peers: list[str]
    steps: dict[str, Callable[[], Any]]
    probes: dict[str, tuple[MatmulProbe, int]]  # by precision
    flops: dict[str, int]  # "vitkit", "peer"
    label: str


def precision_comparison(
    args: argparse.Namespace,
    batch_size: int,
    precisions: list[str],
    extra: dict,
    model_name: str = "vit_b16",
    **overrides: Any,
) -> tuple[str, list[tuple[str, str, bool | None]], dict]:
    """ViT-B/16 (or another registered ViT, with config overrides) inference at one batch size: every precision,
    vitkit and each peer under the same switch, and the matmul peak of each precision, all taking turns in the
    same rounds: (the printed text, the target rows, the report)."""
    c = build_comparison(args, batch_size, precisions, extra, model_name, **overrides)
    pairs = [(f"{p} {peer}", f"{p} vitkit") for p in precisions for peer in c.peers]

    def ratios_settled(times: dict[str, list[float]]) -> bool:
        return settled([paired_ratio_stats(times[a], times[b]) for a, b in pairs], args.target)

    rows = {**c.steps, **{f"{p} matmul peak": probe for p, (probe, _) in c.probes.items()}}
    log(f"batch {batch_size}: timing {len(rows)} rows alternating, {args.repeats} to {args.max_repeats} rounds")
    load_before = load_average()
    times = time_alternating(
        rows, args.repeats, args.warmup, torch.device("cpu"), until=ratios_settled, max_repeats=args.max_repeats
    )
    notes = load_warnings(load_before, load_average(), torch.get_num_threads())
    lines, doc = comparison_table(c, times, args.compile, notes)
    return "\n".join(lines), comparison_targets(c, times, doc), doc


def build_comparison(
    args: argparse.Namespace, batch_size: int, precisions: list[str], extra: dict, model_name: str, **overrides: Any
) -> Comparison:
    """The model (random weights, a random head), its peers, every row's step checked against the fp32 outputs,
    and each precision's matmul probe, lasting as long as vitkit's row of that precision."""
    from vitkit.models import create_model

    torch.manual_seed(0)
    model = create_model(model_name, **overrides).eval()
    nn.init.normal_(model.head.weight, std=0.02)  # informative logits for the parity checks
    size = model.config.img_size[0]
    torch.manual_seed(1)
    x = torch.randn(batch_size, model.config.in_chans, *model.config.img_size)
    peers = {"transformers": hf_peer(model), **{PEER_NAMES.get(k, k): build(model) for k, build in extra.items()}}
    with torch.no_grad():
        ref = model(x).float()
    steps = precision_rows(model, peers, precisions, args.compile, x)
    check_rows(steps, ref, log)
    probes = {}
    for p in precisions:
        seconds = step_seconds(steps[f"{p} vitkit"], torch.device("cpu"))
        probes[p] = matmul_probe(PEAK_DTYPES[p], torch.device("cpu"), seconds=seconds)
    # what each row executes: vitkit's switch runs the last block for the class token alone (vitkit.accel.first_token)
    flops = {"vitkit": model_flops(model, size, first_token_applies(model)), "peer": model_flops(model, size)}
    name = "ViT-B/16" if model_name == "vit_b16" and not overrides else model_name
    label = f"{name} inference, batch {batch_size}, {size} px, {torch.get_num_threads()} threads"
    return Comparison(batch_size, precisions, list(peers), steps, probes, flops, label)


def comparison_table(
    c: Comparison, times: dict[str, list[float]], compile_mode: str, notes: list[str]
) -> tuple[list[str], dict[str, Any]]:
    """The printed lines and the report of one batch size's timings (notes: warnings, added to)."""
    peaks = {p: c.probes[p][1] / statistics.median(times[f"{p} matmul peak"]) / 1e9 for p in c.precisions}
    rounds = len(times[f"{c.precisions[0]} vitkit"])
    peak_lines = [
        f"{p} {peaks[p]:.0f} G{'OP' if p == 'int8' else 'FLOP'}/s ({c.probes[p][0].kernel}, {c.probes[p][0].size})"
        for p in c.precisions
    ]
    lines = [
        f"{c.label}, compile {compile_mode}{int8_compile_note() if 'int8' in c.precisions else ''}, "
        f"{rounds} rounds alternating",
        "matmul peaks timed in the same rounds: " + ", ".join(peak_lines),
        "share of the peak = median of per-round (row rate / peak rate), the peak timed in the same round",
        "speed-up = median of per-round (row s / vitkit s) in the same precision, with its 95% bootstrap interval",
    ]
    w = max(len(n) for n in c.steps)
    lines.append(f"{'row':<{w}} {'img/s':>7} {'min-max':>13} {'G/s':>6} {'of peak':>7}   vitkit / row")
    doc: dict[str, Any] = {"batch_size": c.batch_size, "peaks_g_per_s": peaks, "times_s": times, "rows": {}}
    for name in c.steps:
        p, impl = name.split(" ", 1)
        rates = sorted(c.batch_size / t for t in times[name])
        median = float(np.median(rates))
        executed = c.flops["vitkit" if impl == "vitkit" else "peer"]
        util = paired_utilisation(c.batch_size * executed, times[name], c.probes[p][1], times[f"{p} matmul peak"])
        st = None if impl == "vitkit" else paired_ratio_stats(times[name], times[f"{p} vitkit"])
        lines.append(
            f"{name:<{w}} {median:>7.2f} {rates[0]:>6.2f}-{rates[-1]:<6.2f} {median * executed / 1e9:>6.0f} "
            f"{util:>7.1%}   {'-' if st is None else st}"
        )
        doc["rows"][name] = {"images_per_s": median, "utilisation": util, "ratio": None if st is None else st.to_dict()}
        if st is not None and st.inconclusive:
            notes.append(f"{name}: interval {st.low:.3f}-{st.high:.3f} is wider than the effect")
    lines += [f"WARNING: {n}" for n in notes]
    doc["warnings"] = notes
    return lines, doc


def comparison_targets(
    c: Comparison, times: dict[str, list[float]], doc: dict[str, Any]
) -> list[tuple[str, str, bool | None]]:
    """Per precision: vitkit over the best peer and vitkit's share of the peak against their targets, and (no target)
    vitkit's plain model under the peers' switch over the best peer."""
    target_rows: list[tuple[str, str, bool | None]] = []
    b = c.batch_size
    for p in c.precisions:
        best_peer = max(c.peers, key=lambda n: float(np.median([b / t for t in times[f"{p} {n}"]])))
        st = paired_ratio_stats(times[f"{p} {best_peer}"], times[f"{p} vitkit"])
        util = doc["rows"][f"{p} vitkit"]["utilisation"]
        target_rows += [
            (
                f"batch {b} {p}: vitkit / {best_peer} >= {TARGET_RATIO}x (interval above it)",
                f"{st.median:.3f}x [{st.low:.3f}, {st.high:.3f}]",
                st.low >= TARGET_RATIO,
            ),
            (
                f"batch {b} {p}: vitkit >= {TARGET_UTILISATION:.0%} of the {p} matmul peak",
                f"{util:.1%}",
                util >= TARGET_UTILISATION,
            ),
        ]
        if f"{p} {PEERS_SWITCH}" in c.steps:  # information, no target: the model code's own lead
            st = paired_ratio_stats(times[f"{p} {best_peer}"], times[f"{p} {PEERS_SWITCH}"])
            label = f"batch {b} {p}: vitkit under the peers' switch / {best_peer}"
            target_rows.append((label, f"{st.median:.3f}x [{st.low:.3f}, {st.high:.3f}]", None))
    return target_rows


# --------------------------------------------------------------------------------------------- training
def train_targets(report: BenchReport, label: str) -> list[tuple[str, str, bool | None]]:
    v = best_rows(report.measurements)["vitkit"]
    rows: list[tuple[str, str, bool | None]] = []
    for peer, name in PEER_NAMES.items():
        if peer not in report.ratio_stats:
            continue
        st, p = report.ratio_stats[peer], best_rows(report.measurements)[peer]
        rows.append(
            (
                f"{label}: vitkit / {name} >= {TARGET_RATIO}x (interval above it)",
                f"{st['median']:.3f}x [{st['low']:.3f}, {st['high']:.3f}]",
                st["low"] >= TARGET_RATIO,
            )
        )
        mem_ok = None
        if v.step_memory_bytes is not None and p.step_memory_bytes is not None:
            mem_ok = v.step_memory_bytes <= p.step_memory_bytes
        mem = f"{(v.step_memory_bytes or 0) / 2**20:.0f} vs {(p.step_memory_bytes or 0) / 2**20:.0f} MiB"
        rows.append((f"{label}: step memory vitkit <= {name}", mem, mem_ok))
    util = v.hardware_utilisation
    rows.append(
        (f"{label}: vitkit >= {TARGET_UTILISATION:.0%} of the matmul peak", f"{util:.1%}", util >= TARGET_UTILISATION)
    )
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=RUNS, action="append", help="run only these comparisons")
    p.add_argument("--batch-sizes", default="1,8,64", help="ViT-B/16 inference batches (default 1,8,64)")
    p.add_argument("--precisions", default=",".join(PRECISIONS), help="of fp32,bf16,int8 (default all)")
    p.add_argument("--train-batch-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed rounds at least (default 3)")
    p.add_argument("--max-repeats", type=int, default=8, help="rounds at most, while intervals are wide (8)")
    p.add_argument("--target", type=float, default=0.02, help="stop when every 95%% interval is within +-this")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--digits-run", type=Path, help="accuracy on this digits run (default: train one here)")
    p.add_argument("--official", type=Path, help="accuracy on this official .npz (default: random ViT-S/16)")
    p.add_argument("--compile", default="none", choices=("none", "default"), help="for every fp32/bf16 row alike")
    p.add_argument("--json", type=Path, help="write every report and the target table here")
    p.add_argument("--results", type=Path, help="also write what is printed as a result file (benchmarks/results/)")
    args = p.parse_args(argv)
    args.max_repeats = max(args.max_repeats, args.repeats)
    return args


def precision_runs(
    args: argparse.Namespace, precisions: list[str], extra: dict
) -> tuple[list[tuple[str, str, bool | None]], dict[str, Any]]:
    """Each switch's accuracy, then the equal-precision comparison at each batch size: (target rows, reports)."""
    rows: list[tuple[str, str, bool | None]] = []
    reports: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="vitkit-bench-precision-") as workdir:
        # accuracy first: training the digits model changes the thread count, restored before timing
        log("accuracy: digits run")
        digits, held_out, digits_label = digits_model(args.digits_run, Path(workdir))
        accuracy = {digits_label: switch_accuracy(digits, held_out, [q for q in precisions if q != "fp32"])}
        log("accuracy: official-format ViT-S/16")
        official, images, official_label = official_model(args.official, Path(workdir), held_out)
        accuracy[official_label] = switch_accuracy(official, images, [q for q in precisions if q != "fp32"])
    print("\n".join(accuracy_lines(accuracy)) + "\n", flush=True)
    reports["accuracy"] = accuracy
    for batch_size in (int(b) for b in args.batch_sizes.split(",")):
        print(f"== precision, batch {batch_size}", file=sys.stderr, flush=True)
        text, target_rows, doc = precision_comparison(args, batch_size, precisions, extra)
        print(text + "\n", flush=True)
        rows += target_rows
        reports[f"precision batch {batch_size}"] = doc
    return rows, reports


def train_runs(
    args: argparse.Namespace, precisions: list[str], extra: dict
) -> tuple[list[tuple[str, str, bool | None]], dict[str, Any]]:
    """ViT-S/16 training steps in fp32 (and bf16 autocast where native): (target rows, reports)."""
    rows: list[tuple[str, str, bool | None]] = []
    reports: dict[str, Any] = {}
    for dtype in ("fp32", "bf16-autocast") if "bf16" in precisions else ("fp32",):
        print(f"== train {dtype}", file=sys.stderr, flush=True)
        cfg = BenchConfig(
            model="vit_s16",
            batch_size=args.train_batch_size,
            dtype=dtype,
            mode="train",
            compare=("hf", *extra),
            repeats=args.repeats,
            warmup=args.warmup,
            device="cpu",
            max_repeats=args.max_repeats,
            target_half_width=args.target,
        )
        report = run_bench(cfg, log=log)
        print(report.table() + "\n", flush=True)
        rows += train_targets(report, f"ViT-S/16 train step {dtype}, batch {args.train_batch_size}")
        reports[f"train {dtype}"] = report.to_dict()
    return rows, reports


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tune_cpu_allocator()  # as vitkit train and optimize_for_inference do; process-wide, so every implementation gets it
    cpu = torch.device("cpu")
    if args.compile != "none" and not can_compile(cpu):
        raise SystemExit("--compile: torch.compile cannot build CPU kernels here (no C++ compiler)")
    precisions = [q for q in args.precisions.split(",") if q]
    if unknown := sorted(set(precisions) - set(PRECISIONS)):
        raise SystemExit(f"--precisions: {unknown} not among {PRECISIONS}")
    if "bf16" in precisions and not bf16_is_fast(cpu):
        log("bf16 is emulated on this CPU (no AMX / AVX512-BF16): the bf16 rows are left out")
        precisions.remove("bf16")
    extra = {"timm": timm_peer} if importlib.util.find_spec("timm") is not None else {}
    if not extra:
        log("timm is not importable (pip install timm): its rows are left out")
    runs = args.only or list(RUNS)
    rows: list[tuple[str, str, bool | None]] = []
    reports: dict[str, Any] = {}
    with recorded(args.results, command_line(__file__, argv)):
        for run, fn in (("precision", precision_runs), ("train", train_runs)):
            if run in runs:
                more_rows, more_reports = fn(args, precisions, extra)
                rows += more_rows
                reports.update(more_reports)
        width = max(len(r[0]) for r in rows)
        print(f"{'target':<{width}}  {'measured':<24} met")
        for target, measured, ok in rows:
            print(f"{target:<{width}}  {measured:<24} {'n/a' if ok is None else 'yes' if ok else 'NO'}")
    if args.json:
        doc = {"reports": reports, "targets": [dict(target=t, measured=m, met=ok) for t, m, ok in rows]}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


RUNS = ("precision", "train")


if __name__ == "__main__":
    sys.exit(main())
