"""vitkit against Hugging Face transformers (and timm, where installed) at equal precision: the speed targets.

    python benchmarks/bench_vit.py                         # everything (~25 min on 2 cores)
    python benchmarks/bench_vit.py --only precision --batch-sizes 8 --json out.json

1. precision: ViT-B/16 inference at batch 1, 8 and 64, in fp32, bf16 and int8, every library given the same
   switch, the one its documentation gives: fp32 as built; bf16 by ``model.to(torch.bfloat16)`` (vitkit:
   ``optimize_for_inference(model, "bf16")``); int8 by ``torch.ao.quantization.quantize_dynamic`` of every
   nn.Linear (vitkit: ``optimize_for_inference(model, "int8")``: int8 x int8 matmuls with per-token activation
   scales, compiled by default since its layers are plain tensor ops; the peers' quantised layers are opaque to
   torch.compile and run eagerly). ``--compile`` adds torch.compile with inductor freezing to every fp32 and
   bf16 row alike. The matmul peak of each precision (a large fp32, bf16 or int8 x int8 -> int32 product through
   the fastest of torch's kernel and the kernel of vitkit's packed-weight layers, vitkit.bench.matmul_probe),
   repeated to last as long as vitkit's row of that precision, is timed in the same rounds, and a row's share of
   it is the median over rounds of its rate over that round's peak. Targets: vitkit >= 1.15x the best peer of
   the same precision (95% interval above it) and >= 80% of that precision's peak (FLOPs executed). Beside the
   speed, each switch's accuracy cost: top-1 agreement with fp32 and logit error on held-out images of (a) a
   digits run (--digits-run, else one trained here) and (b) an official-format ViT-S/16 (--official, else a
   randomly initialised one, which the output says). In fp32 and bf16 a row "vitkit, peers' switch" gives
   vitkit's model the peers' switch instead (as built; ``model.to(torch.bfloat16)``): what its model code
   alone gains (vitkit.models.linear's oneDNN matmuls in inference, the class-token block, the written-out bf16
   attention), beside the peers.
2. train: ViT-S/16 training step (forward, cross-entropy, backward, fused AdamW for every library), batch 32,
   in fp32 and with bf16 autocast (where bf16 is native), against the same targets; step memory beside it.

Every ratio is the median of per-round paired ratios with its 95% bootstrap interval; rounds go on until every
interval is within +-2% (--target) or --max-repeats, and a ratio whose interval is wider than its distance from
1 is flagged. The load average is checked before and after each comparison. Outputs are checked for parity
before anything is timed. Nothing here is a test: it prints what it measures.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import statistics
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peers import timm_peer  # beside this script (timm is no dependency of vitkit)
from torch import nn

from vitkit.bench import (
    BenchConfig,
    BenchReport,
    batched_logits,
    best_rows,
    hf_peer,
    load_average,
    load_warnings,
    logit_agreement,
    matmul_probe,
    model_flops,
    paired_ratio_stats,
    paired_utilisation,
    run_bench,
    settled,
    step_seconds,
    time_alternating,
)
from vitkit.bench.harness import PARITY_TOL
from vitkit.device import bf16_is_fast
from vitkit.fast import (
    auto_compile_mode,
    can_compile,
    compile_for_inference,
    optimize_for_inference,
    tune_cpu_allocator,
)


def log(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


PEER_NAMES = {"hf": "transformers", "timm": "timm"}
PRECISIONS = ("fp32", "bf16", "int8")
PEAK_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}
TARGET_RATIO = 1.15  # vitkit over the best peer of the same precision
TARGET_UTILISATION = 0.80  # of the matmul peak of that precision, FLOPs executed
PEERS_SWITCH = "vitkit, peers' switch"  # the row of vitkit's model under the peers' switch


# ------------------------------------------------------------------------------------------- the switches
def peer_switch(peer: nn.Module, precision: str, compile_mode: str) -> Callable[[torch.Tensor], Any]:
    """A peer under the switch its documentation gives for a precision (on a copy; the peer is left as it was).

    bf16: ``model.to(torch.bfloat16)`` with bf16 inputs. int8: ``quantize_dynamic`` of every nn.Linear to qint8
    (torch's documented dynamic quantisation, as transformers' and timm's guides show it). compile_mode other than
    "none": torch.compile with inductor freezing, as vitkit's fast path uses (not for int8, which it cannot trace).
    """
    model = copy.deepcopy(peer).eval().requires_grad_(False)
    if precision == "int8":
        from torch.ao.quantization import quantize_dynamic

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
            quantized = quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
        return quantized
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = model.to(dtype)
    run = model if compile_mode == "none" else compile_for_inference(model, compile_mode)
    return lambda x: run(x.to(dtype))


def vitkit_switch(model: nn.Module, precision: str, compile_mode: str) -> Callable[[torch.Tensor], Any]:
    """vitkit's own switch: optimize_for_inference(model, precision) on a copy. int8 keeps its default, compiled
    wherever inductor builds CPU kernels, whatever compile_mode says (the peers' int8 cannot be compiled)."""
    mode = "auto" if precision == "int8" else compile_mode
    return optimize_for_inference(copy.deepcopy(model), precision, compile=mode)


def int8_compile_note() -> str:
    """How the int8 rows run: vitkit's int8 compiles where the CPU has VNNI and inductor builds kernels."""
    compiled = auto_compile_mode("int8", torch.device("cpu")) != "none"
    return f" (int8: vitkit {'compiled' if compiled else 'eager'}, peers eager)"


def _infer(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> Callable[[], Any]:
    def step() -> Any:
        with torch.no_grad():
            return fn(x)

    return step


# --------------------------------------------------------------------------------------------- accuracy
def switch_accuracy(model: nn.Module, images: torch.Tensor, precisions: list[str]) -> dict[str, dict]:
    """Each switch (vitkit's, and the peers' documented int8 applied to the same model) against fp32 on the same
    images, in batches of 64."""
    model = model.eval()
    want = batched_logits(model, images)

    def against_fp32(fn: Callable[[torch.Tensor], Any]) -> dict[str, float]:
        return logit_agreement(want, batched_logits(fn, images))

    out = {f"vitkit {p}": against_fp32(vitkit_switch(model, p, "none")) for p in precisions}
    if "int8" in precisions:  # the peers' switch: per-tensor weights, activations over half the 8-bit range
        out["peers' int8 (quantize_dynamic)"] = against_fp32(peer_switch(model, "int8", "none"))
    return out


def digits_model(run_dir: Path | None, workdir: Path) -> tuple[nn.Module, torch.Tensor, str]:
    """A trained digits model and its 360 held-out images: the given run, or a short run of the shipped config."""
    from dataclasses import replace

    from vitkit.data import build_datasets
    from vitkit.hub import load_model
    from vitkit.train import load_config, train

    cfg = load_config("digits", ["schedule.epochs=15", "run.progress=false", "run.plots=false", "run.eval_every=0"])
    threads = torch.get_num_threads()  # the digits config trains on one thread: restored for the timings
    if run_dir is None:
        cfg = replace(cfg, run=replace(cfg.run, out_dir=str(workdir), name="digits"))
        result = train(cfg)
        torch.set_num_threads(threads)
        run_dir = result.run_dir
        top1 = next((v for k, v in result.metrics.items() if "top1" in k or "top-1" in k), float("nan"))
        label = f"digits run trained here ({cfg.schedule.epochs:g} epochs, held-out top-1 {top1:.2%})"
    else:
        label = f"digits run {run_dir}"
    _, held_out, _ = build_datasets(cfg.data)
    return load_model(run_dir), held_out.images, label


def official_model(npz: Path | None, workdir: Path, held_out: torch.Tensor) -> tuple[nn.Module, torch.Tensor, str]:
    """An official-format ViT-S/16 read back through the .npz reader, and 128 held-out digits as 224px RGB."""
    from vitkit.checkpoint.official import vitkit_to_official
    from vitkit.hub import load_model
    from vitkit.models import create_model

    if npz is None:
        torch.manual_seed(0)
        source = create_model("vit_s16", num_classes=1000)
        nn.init.normal_(source.head.weight, std=0.02)  # the released heads are not zero
        npz = workdir / "vit_s16_random.npz"
        np.savez(npz, **vitkit_to_official(source))
        label = "official-format ViT-S/16, RANDOMLY INITIALISED (no released file here), written by vitkit_to_official"
    else:
        label = f"official checkpoint {npz}"
    model = load_model(npz)
    size = model.config.img_size
    size = size if isinstance(size, int) else size[0]
    x = held_out[:128]
    x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    x = x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x
    return model, (x * 2 - 1).contiguous() if x.min() >= 0 else x.contiguous(), label


def accuracy_lines(accuracy: dict[str, dict[str, dict]]) -> list[str]:
    lines = ["accuracy cost of each switch against fp32 (logit errors relative to the largest |fp32 logit|):"]
    for label, per_switch in accuracy.items():
        lines.append(f"  {label}")
        for name, a in per_switch.items():
            lines.append(
                f"    {name:<31} top-1 agreement {a['top1_agreement']:.2%} of {a['n']} images, "
                f"logit error max {a['max_err']:.3g} mean {a['mean_err']:.3g} (|logit| up to {a['max_abs_logit']:.3g})"
            )
    return lines


# ------------------------------------------------------------------------------------ equal precision
def precision_rows(
    model: nn.Module, peers: dict[str, nn.Module], precisions: list[str], compile_mode: str, x: torch.Tensor
) -> dict[str, Callable[[], Any]]:
    """One timed step per (precision, implementation), named "<precision> <implementation>"."""
    steps = {}
    for p in precisions:
        steps[f"{p} vitkit"] = _infer(vitkit_switch(model, p, compile_mode), x)
        if p != "int8":  # vitkit's model as the peers are given it
            steps[f"{p} {PEERS_SWITCH}"] = _infer(peer_switch(model, p, compile_mode), x)
        for name, peer in peers.items():
            steps[f"{p} {name}"] = _infer(peer_switch(peer, p, compile_mode), x)
    return steps


def check_rows(steps: dict[str, Callable[[], Any]], ref: torch.Tensor) -> None:
    """Rows of one precision compute the same thing: within the precision's tolerance of that precision's vitkit
    row (fp32: of ref, the fp32 model's output; int8: each library quantises in its own way, so only ref bounds
    it, loosely)."""
    scale = max(1.0, float(ref.abs().max()))
    tol = {"fp32": PARITY_TOL["fp32"], "bf16": PARITY_TOL["bf16"], "int8": 0.25}
    for name, step in steps.items():
        p = name.split()[0]
        base = ref if p in ("fp32", "int8") else torch.as_tensor(steps[f"{p} vitkit"]()).float()
        err = float((torch.as_tensor(step()).float() - base).abs().max()) / scale
        log(f"{name}: max |diff| vs vitkit {'fp32' if p == 'int8' else p} {err:.2e} (tolerance {tol[p]:g})")
        if err > tol[p]:
            raise SystemExit(f"{name} differs by {err:.2e}: not timing implementations that compute different things")


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
    same rounds."""
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
    check_rows(steps, ref)
    probes = {}
    for p in precisions:  # each lasting as long as vitkit's row in its precision
        seconds = step_seconds(steps[f"{p} vitkit"], torch.device("cpu"))
        probe, probe_flops = matmul_probe(PEAK_DTYPES[p], torch.device("cpu"), seconds=seconds)
        probes[f"{p} matmul peak"] = (probe, probe_flops)
    flops = {"vitkit": model_flops(model, size, logits_path=True), "peer": model_flops(model, size)}

    pairs = [(f"{p} {peer}", f"{p} vitkit") for p in precisions for peer in peers]

    def ratios_settled(times: dict[str, list[float]]) -> bool:
        return settled([paired_ratio_stats(times[a], times[b]) for a, b in pairs], args.target)

    rows = {**steps, **{name: probe for name, (probe, _) in probes.items()}}
    log(f"batch {batch_size}: timing {len(rows)} rows alternating, {args.repeats} to {args.max_repeats} rounds")
    load_before = load_average()
    times = time_alternating(
        rows, args.repeats, args.warmup, torch.device("cpu"), until=ratios_settled, max_repeats=args.max_repeats
    )
    notes = load_warnings(load_before, load_average(), torch.get_num_threads())
    peaks = {p: probes[f"{p} matmul peak"][1] / statistics.median(times[f"{p} matmul peak"]) / 1e9 for p in precisions}
    rounds = len(times[f"{precisions[0]} vitkit"])
    peak_lines = []
    for p in precisions:
        probe = probes[f"{p} matmul peak"][0]
        peak_lines.append(f"{p} {peaks[p]:.0f} G{'OP' if p == 'int8' else 'FLOP'}/s ({probe.kernel}, {probe.size})")

    lines = [
        f"{'ViT-B/16' if model_name == 'vit_b16' and not overrides else model_name} inference, batch {batch_size}, "
        f"{size} px, {torch.get_num_threads()} threads, "
        f"compile {args.compile}{int8_compile_note() if 'int8' in precisions else ''}, "
        f"{rounds} rounds alternating",
        "matmul peaks timed in the same rounds: " + ", ".join(peak_lines),
        "share of the peak = median of per-round (row rate / peak rate), the peak timed in the same round",
        "speed-up = median of per-round (row s / vitkit s) in the same precision, with its 95% bootstrap interval",
    ]
    w = max(len(n) for n in steps)
    lines.append(f"{'row':<{w}} {'img/s':>7} {'min-max':>13} {'G/s':>6} {'of peak':>7}   vitkit / row")
    target_rows: list[tuple[str, str, bool | None]] = []
    doc: dict[str, Any] = {"batch_size": batch_size, "peaks_g_per_s": peaks, "times_s": times, "rows": {}}
    for name in steps:
        p, impl = name.split(" ", 1)
        rates = sorted(batch_size / t for t in times[name])
        median = float(np.median(rates))
        executed = flops["vitkit" if impl.startswith("vitkit") else "peer"]
        probe_flops = probes[f"{p} matmul peak"][1]
        util = paired_utilisation(batch_size * executed, times[name], probe_flops, times[f"{p} matmul peak"])
        st = None if impl == "vitkit" else paired_ratio_stats(times[name], times[f"{p} vitkit"])
        lines.append(
            f"{name:<{w}} {median:>7.2f} {rates[0]:>6.2f}-{rates[-1]:<6.2f} {median * executed / 1e9:>6.0f} "
            f"{util:>7.1%}   {'-' if st is None else st}"
        )
        doc["rows"][name] = {"images_per_s": median, "utilisation": util, "ratio": None if st is None else st.to_dict()}
        if st is not None and st.inconclusive:
            notes.append(f"{name}: interval {st.low:.3f}-{st.high:.3f} is wider than the effect")
    for p in precisions:
        best_peer = max(peers, key=lambda n: float(np.median([batch_size / t for t in times[f"{p} {n}"]])))
        st = paired_ratio_stats(times[f"{p} {best_peer}"], times[f"{p} vitkit"])
        util = doc["rows"][f"{p} vitkit"]["utilisation"]
        target_rows += [
            (
                f"batch {batch_size} {p}: vitkit / {best_peer} >= {TARGET_RATIO}x (interval above it)",
                f"{st.median:.3f}x [{st.low:.3f}, {st.high:.3f}]",
                st.low >= TARGET_RATIO,
            ),
            (
                f"batch {batch_size} {p}: vitkit >= {TARGET_UTILISATION:.0%} of the {p} matmul peak",
                f"{util:.1%}",
                util >= TARGET_UTILISATION,
            ),
        ]
        if f"{p} {PEERS_SWITCH}" in steps:  # information, no target: the model code's own lead
            st = paired_ratio_stats(times[f"{p} {best_peer}"], times[f"{p} {PEERS_SWITCH}"])
            label = f"batch {batch_size} {p}: vitkit under the peers' switch / {best_peer}"
            target_rows.append((label, f"{st.median:.3f}x [{st.low:.3f}, {st.high:.3f}]", None))
    lines += [f"WARNING: {n}" for n in notes]
    doc["warnings"] = notes
    return "\n".join(lines), target_rows, doc


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


def main(argv: list[str] | None = None) -> int:
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
    args = p.parse_args(argv)
    args.max_repeats = max(args.max_repeats, args.repeats)
    tune_cpu_allocator()  # as the vitkit command line does; process-wide, so every implementation gets it
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
    runs = args.only or list(RUNS)

    rows: list[tuple[str, str, bool | None]] = []
    reports: dict[str, Any] = {}
    if "precision" in runs:
        workdir = tempfile.TemporaryDirectory(prefix="vitkit-bench-precision-")
        # accuracy first: training the digits model changes the thread count, restored before timing
        log("accuracy: digits run")
        digits, held_out, digits_label = digits_model(args.digits_run, Path(workdir.name))
        accuracy = {digits_label: switch_accuracy(digits, held_out, [q for q in precisions if q != "fp32"])}
        log("accuracy: official-format ViT-S/16")
        official, images, official_label = official_model(args.official, Path(workdir.name), held_out)
        accuracy[official_label] = switch_accuracy(official, images, [q for q in precisions if q != "fp32"])
        workdir.cleanup()
        print("\n".join(accuracy_lines(accuracy)) + "\n", flush=True)
        reports["accuracy"] = accuracy
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            print(f"== precision, batch {batch_size}", file=sys.stderr, flush=True)
            text, target_rows, doc = precision_comparison(args, batch_size, precisions, extra)
            print(text + "\n", flush=True)
            rows += target_rows
            reports[f"precision batch {batch_size}"] = doc
    if "train" in runs:
        for dtype in ("fp32", "bf16-autocast") if "bf16" in precisions else ("fp32",):
            print(f"== train {dtype}", file=sys.stderr, flush=True)
            cfg = BenchConfig(
                model="vit_s16",
                batch_size=args.train_batch_size,
                dtype=dtype,
                mode="train",
                compare=("hf",),
                repeats=args.repeats,
                warmup=args.warmup,
                device="cpu",
                max_repeats=args.max_repeats,
                target_half_width=args.target,
            )
            report = run_bench(cfg, log=log, extra_peers=extra)
            print(report.table() + "\n", flush=True)
            rows += train_targets(report, f"ViT-S/16 train step {dtype}, batch {args.train_batch_size}")
            reports[f"train {dtype}"] = report.to_dict()

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
