"""vitkit against Hugging Face transformers (and timm, where installed) on this machine: the speed targets.

    python benchmarks/bench_vit.py                      # all comparisons (~8 min on 2 AVX2 cores, ~12 with timm)
    python benchmarks/bench_vit.py --only fp32 --repeats 3 --json out.json

1. ViT-B/16 inference, fp32: best vitkit path vs best transformers path (eager and torch.compile + freezing,
   all four alternating in one loop, with onnxruntime as a fifth row where installed); target >= 1.05x and
   >= 85% of the fp32 matmul peak measured in the run.
2. ViT-B/16 inference, bf16 weights: target >= 1.3x and >= 70% of the bf16 matmul peak. Skipped where bf16 is
   emulated (no AMX / AVX512-BF16 / CUDA) unless --force-bf16: it would take minutes per step and mean nothing.
3. ViT-S/16 training step (forward + backward + AdamW), batch 32, bf16 autocast: >= 1.2x transformers with no
   higher peak step memory. Where bf16 is emulated it runs in fp32 instead, and says so.

4. ViT-B/16 inference by precision ("int8"): what a user gets by default (eager create_model, fp32) and with
   each switch (optimize_for_inference int8, bf16 where native, fp32 compiled), beside transformers, timm and
   onnxruntime (fp32 and int8), all alternating in one loop; target int8 >= 1.8x the best fp32 peer row. Beside
   the speed, int8's accuracy cost: top-1 agreement with fp32 and logit error on held-out images of (a) a digits
   run (--digits-run, else one trained here in ~10 s) and (b) an official-format ViT-S/16 checkpoint (--official,
   else a randomly initialised one written by vitkit_to_official, which the output says).

Every ratio is the median of per-round paired ratios with its 95% bootstrap interval; rounds go on until every
interval is within +-2% (--target) or --max-repeats, and a ratio whose interval is wider than its distance from
1 is flagged. The load average is checked before and after each comparison.
Every number comes from vitkit.bench (synthetic inputs for speed, outputs checked for parity before timing).
Where timm is importable it is timed in the same loop and held to the same targets.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from vitkit.bench import (
    BenchConfig,
    BenchReport,
    Measurement,
    best_rows,
    hf_peer,
    load_average,
    load_warnings,
    paired_ratio_stats,
    run_bench,
    settled,
    time_alternating,
)
from vitkit.checkpoint.timm import timm_kwargs, vitkit_to_timm
from vitkit.device import bf16_is_fast
from vitkit.fast import can_compile, optimize_for_inference, tune_cpu_allocator


def log(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


def best(report: BenchReport, impl: str) -> Measurement:
    """The fastest row of one implementation (over compile modes)."""
    return best_rows(report.measurements)[impl]


def timm_peer(model: nn.Module) -> nn.Module:
    """timm's VisionTransformer with vitkit's weights, dtype and device. timm is only a peer here: it needs
    torchvision, which vitkit does not."""
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    ref = next(model.parameters())
    peer = TimmViT(**timm_kwargs(model))
    peer.load_state_dict(vitkit_to_timm(model))
    return peer.to(device=ref.device, dtype=ref.dtype)


PEER_NAMES = {"hf": "transformers", "timm": "timm"}


def inference_target(report: BenchReport, min_ratio: float, min_util: float) -> list[tuple[str, str, bool]]:
    v = best(report, "vitkit")
    rows = []
    for peer, label in PEER_NAMES.items():
        if peer in report.ratios:
            ratio, p = report.ratios[peer], best(report, peer)
            target = f"vitkit ({v.name}) / {label} ({p.name}) >= {min_ratio}x"
            rows.append((target, f"{ratio:.3f}x", ratio >= min_ratio))
    return [
        *rows,
        (
            f"vitkit utilisation >= {min_util:.0%} of matmul peak (executed FLOPs; model FLOPs {v.utilisation:.1%})",
            f"{v.hardware_utilisation:.1%}",
            v.hardware_utilisation >= min_util,
        ),
    ]


def train_target(report: BenchReport, min_ratio: float) -> list[tuple[str, str, bool]]:
    v = best(report, "vitkit")
    rows = []
    for peer, label in PEER_NAMES.items():
        if peer not in report.ratios:
            continue
        ratio, p = report.ratios[peer], best(report, peer)
        mem_ok = v.step_memory_bytes is not None and p.step_memory_bytes is not None
        mem_ok = mem_ok and v.step_memory_bytes <= p.step_memory_bytes
        mem = f"{(v.step_memory_bytes or 0) / 2**20:.0f} vs {(p.step_memory_bytes or 0) / 2**20:.0f} MiB"
        rows.append((f"train step vitkit / {label} >= {min_ratio}x", f"{ratio:.3f}x", ratio >= min_ratio))
        rows.append((f"train step memory vitkit <= {label}", mem, mem_ok))
    return rows


# ------------------------------------------------------------------------------------ precision comparison
def _infer(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> Callable[[], Any]:
    def step() -> Any:
        with torch.no_grad():
            return fn(x)

    return step


def logit_agreement(want: torch.Tensor, got: Any) -> dict[str, float]:
    """Top-1 agreement of got with want (fp32), and the max / mean |logit error| relative to max |want|."""
    got = torch.as_tensor(got).float()
    err = (got - want).abs()
    scale = float(want.abs().max())
    return {
        "n": len(want),
        "top1_agreement": float((got.argmax(-1) == want.argmax(-1)).float().mean()),
        "max_err": float(err.max()),
        "mean_err": float(err.mean()),
        "max_abs_logit": scale,
    }


def int8_accuracy(model: nn.Module, images: torch.Tensor, workdir: Path, with_onnx: bool) -> dict[str, dict]:
    """torch int8 (and onnxruntime int8) against the fp32 model on the same images, in batches of 64."""
    from vitkit.export import export_onnx, onnx_session

    def batched(fn: Callable[[torch.Tensor], Any]) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([torch.as_tensor(fn(b)).float() for b in images.split(64)])

    model = model.eval()
    want = batched(model)
    out = {"torch int8": logit_agreement(want, batched(optimize_for_inference(model, "int8", compile="none")))}
    if with_onnx:
        path = export_onnx(model, workdir / f"{id(model)}-int8.onnx", int8=True)
        session = onnx_session(path)
        got = batched(lambda b: session.run(None, {"pixel_values": b.numpy()})[0])
        out["onnxruntime int8"] = logit_agreement(want, got)
    return out


def digits_model(run_dir: Path | None, workdir: Path) -> tuple[nn.Module, torch.Tensor, str]:
    """A trained digits model and its 360 held-out images: the given run, or a short run of the shipped config."""
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


def precision_comparison(
    args: argparse.Namespace, modes: list[str], extra: dict, has_onnxruntime: bool
) -> tuple[str, list[tuple[str, str, bool | None]], dict]:
    """ViT-B/16 inference: vitkit's default and each switch against the peers, paired round by round."""
    from vitkit.export import export_onnx, onnx_session
    from vitkit.models import create_model

    lines: list[str] = []
    workdir_obj = tempfile.TemporaryDirectory(prefix="vitkit-bench-int8-")
    workdir = Path(workdir_obj.name)

    # accuracy first: training the digits model changes the thread count, restored before timing
    log("int8 accuracy: digits run")
    digits, held_out, digits_label = digits_model(args.digits_run, workdir)
    accuracy = {digits_label: int8_accuracy(digits, held_out, workdir, has_onnxruntime)}
    log("int8 accuracy: official-format ViT-S/16")
    official, images, official_label = official_model(args.official, workdir, held_out)
    accuracy[official_label] = int8_accuracy(official, images, workdir, has_onnxruntime)
    del digits, official

    torch.manual_seed(0)
    model = create_model("vit_b16").eval()  # what a user gets: eager, fp32, the model's own attention default
    nn.init.normal_(model.head.weight, std=0.02)
    torch.manual_seed(1)
    x = torch.randn(args.batch_size, 3, 224, 224)
    steps: dict[str, Callable[[], Any]] = {"vitkit default (eager fp32)": _infer(model, x)}
    steps["vitkit int8"] = _infer(optimize_for_inference(model, "int8", compile="none"), x)
    bf16_note = None
    if bf16_is_fast(torch.device("cpu")):
        steps["vitkit bf16"] = _infer(optimize_for_inference(copy.deepcopy(model), "bf16", compile="none"), x)
    else:
        bf16_note = "vitkit bf16: skipped, this CPU has no AMX / AVX512-BF16 (emulated bf16 is slower than fp32)"
    if "default" in modes:
        steps["vitkit fp32 compiled"] = _infer(optimize_for_inference(copy.deepcopy(model), "fp32", "default"), x)
    peers = {"transformers": hf_peer(model), **{PEER_NAMES.get(k, k): build(model) for k, build in extra.items()}}
    for name, peer in peers.items():
        peer.eval()
        steps[f"{name} eager fp32"] = _infer(peer, x)
        if "default" in modes:
            from vitkit.fast import compile_for_inference

            steps[f"{name} fp32 compiled"] = _infer(compile_for_inference(peer, "default"), x)
    if has_onnxruntime:
        fp32_path = export_onnx(model, workdir / "vit_b16.onnx")
        int8_path = export_onnx(model, workdir / "vit_b16-int8.onnx", int8=True)
        for name, path in (("onnxruntime fp32", fp32_path), ("onnxruntime int8", int8_path)):
            session = onnx_session(path)
            steps[name] = lambda s=session: s.run(None, {"pixel_values": x.numpy()})[0]

    # parity of the fp32 rows before timing (int8 and bf16 rows: their error is what the accuracy table shows)
    ref = steps["vitkit default (eager fp32)"]()
    for name, step in steps.items():
        err = float((torch.as_tensor(step()).float() - ref).abs().max()) / max(1.0, float(ref.abs().max()))
        log(f"{name}: max |diff| vs vitkit fp32 {err:.2e}")
        if "fp32" in name and err > 1e-4:
            raise SystemExit(f"{name} differs from vitkit fp32 by {err:.2e}: not timing it")

    fp32_peers = [n for n in steps if not n.startswith("vitkit") and "int8" not in n]
    ours = [n for n in steps if n.startswith("vitkit") or n == "onnxruntime int8"]

    def ratios_settled(times: dict[str, list[float]]) -> bool:
        return settled([paired_ratio_stats(times[p], times[v]) for p in fp32_peers for v in ours], args.target)

    log(f"timing {len(steps)} rows alternating: {args.repeats} to {max(args.max_repeats, args.repeats)} rounds")
    load_before = load_average()
    times = time_alternating(
        steps,
        args.repeats,
        args.warmup,
        torch.device("cpu"),
        until=ratios_settled,
        max_repeats=max(args.max_repeats, args.repeats),
    )
    notes = load_warnings(load_before, load_average(), torch.get_num_threads())
    rates = {n: sorted(args.batch_size / t for t in ts) for n, ts in times.items()}
    median = {n: float(np.median(r)) for n, r in rates.items()}
    best_peer = max(fp32_peers, key=median.get)
    rounds = len(times[best_peer])

    lines.append(
        f"ViT-B/16 inference, batch {args.batch_size}, 224px, {torch.get_num_threads()} threads, {rounds} rounds "
        f"alternating; speed-up = median of per-round (best fp32 peer s / row s) with its 95% bootstrap interval"
    )
    w = max(len(n) for n in steps)
    lines.append(f"{'row':<{w}} {'img/s':>7} {'min-max':>13}   speed-up over {best_peer}")
    for name in steps:
        r = rates[name]
        st = paired_ratio_stats(times[best_peer], times[name])
        lines.append(f"{name:<{w}} {median[name]:>7.2f} {r[0]:>6.2f}-{r[-1]:<6.2f}   {st}")
        if name != best_peer and st.inconclusive:
            notes.append(f"{name} vs {best_peer}: interval {st.low:.3f}-{st.high:.3f} is wider than the effect")
    if bf16_note:
        lines.append(bf16_note)
    int8_vs = {p: paired_ratio_stats(times[p], times["vitkit int8"]) for p in fp32_peers}
    default = "vitkit default (eager fp32)"
    int8_vs[default] = paired_ratio_stats(times[default], times["vitkit int8"])
    for p, st in int8_vs.items():
        lines.append(f"vitkit int8 / {p}: {st}")
    lines.append("int8 accuracy against fp32 (logit errors relative to the largest |fp32 logit|):")
    for label, per_impl in accuracy.items():
        lines.append(f"  {label}")
        for impl, a in per_impl.items():
            lines.append(
                f"    {impl:<17} top-1 agreement {a['top1_agreement']:.2%} of {a['n']} images, "
                f"logit error max {a['max_err']:.3g} mean {a['mean_err']:.3g} (|logit| up to {a['max_abs_logit']:.3g})"
            )
    lines += [f"WARNING: {n}" for n in notes]

    st = int8_vs[best_peer]
    digits_agree = next(iter(accuracy.values()))["torch int8"]["top1_agreement"]
    target_rows = [
        (
            f"ViT-B/16 int8: vitkit int8 / {best_peer} >= {INT8_TARGET}x (95% interval above it)",
            f"{st.median:.3f}x [{st.low:.3f}, {st.high:.3f}]",
            st.low >= INT8_TARGET,
        ),
        ("int8 top-1 disagreement <= 0.5% (digits held-out)", f"{1 - digits_agree:.2%}", 1 - digits_agree <= 0.005),
    ]
    doc = {
        "times_s": times,
        "images_per_s": median,
        "accuracy": accuracy,
        "int8_ratios": {p: s.to_dict() for p, s in int8_vs.items()},
        "warnings": notes,
    }
    workdir_obj.cleanup()
    return "\n".join(lines), target_rows, doc


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=RUNS, action="append", help="run only these comparisons")
    p.add_argument("--batch-size", type=int, default=8, help="ViT-B/16 inference batch (default 8)")
    p.add_argument("--train-batch-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5, help="timed rounds at least (default 5)")
    p.add_argument("--max-repeats", type=int, default=15, help="rounds at most, while intervals are wide (15)")
    p.add_argument("--target", type=float, default=0.02, help="stop when every 95%% interval is within +-this")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--digits-run", type=Path, help="int8 accuracy on this digits run (default: train one here)")
    p.add_argument("--official", type=Path, help="int8 accuracy on this official .npz (default: random ViT-S/16)")
    p.add_argument("--compile", default="none,default", help="compile modes tried for both sides (comma-separated)")
    p.add_argument("--force-bf16", action="store_true", help="run bf16 even where it is emulated")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", type=Path, help="write every report and the target table here")
    args = p.parse_args(argv)
    tune_cpu_allocator()  # as the vitkit command line does; process-wide, so every implementation gets it
    device = torch.device(args.device)
    modes = [m for m in args.compile.split(",") if m != "default" or can_compile(device)]
    native_bf16 = bf16_is_fast(device) or args.force_bf16
    extra = {"timm": timm_peer} if importlib.util.find_spec("timm") is not None else {}
    common = dict(
        repeats=args.repeats,
        warmup=args.warmup,
        device=args.device,
        max_repeats=max(args.max_repeats, args.repeats),
        target_half_width=args.target,
    )
    runs = args.only or list(RUNS)
    has_onnxruntime = importlib.util.find_spec("onnxruntime") is not None  # its row is shown, not a target

    rows: list[tuple[str, str, bool | None]] = []
    reports: dict[str, dict] = {}
    for run in runs:
        if run == "bf16" and not native_bf16:
            rows.append(("ViT-B/16 bf16 inference", "skipped: bf16 emulated here (--force-bf16)", None))
            continue
        print(f"== {run}", file=sys.stderr, flush=True)
        if run == "int8":
            if device.type != "cpu":
                rows.append(("ViT-B/16 int8 inference", "skipped: dynamic int8 runs on the CPU", None))
                continue
            text, target_rows, doc = precision_comparison(args, modes, extra, has_onnxruntime)
            rows += target_rows
            print(text + "\n", flush=True)
            reports[run] = doc
            continue
        if run in ("fp32", "bf16"):
            with_onnx = run == "fp32" and has_onnxruntime and device.type == "cpu"
            peers = ("hf", "onnx") if with_onnx else ("hf",)
            cfg = BenchConfig(model="vit_b16", batch_size=args.batch_size, dtype=run, compare=peers, **common)
            report = run_bench(cfg, log=log, compile_modes=modes, extra_peers=extra)
            rows += [(f"ViT-B/16 {run}: {t}", m, ok) for t, m, ok in inference_target(report, *TARGETS[run])]
        else:
            dtype = "bf16-autocast" if native_bf16 else "fp32"
            cfg = BenchConfig(
                model="vit_s16", batch_size=args.train_batch_size, dtype=dtype, mode="train", compare=("hf",), **common
            )
            report = run_bench(cfg, log=log, extra_peers=extra)
            rows += [(f"ViT-S/16 {dtype}: {t}", m, ok) for t, m, ok in train_target(report, 1.2)]
        print(report.table() + "\n", flush=True)
        reports[run] = report.to_dict()

    width = max(len(r[0]) for r in rows)
    print(f"{'target':<{width}}  {'measured':<24} met")
    for target, measured, ok in rows:
        print(f"{target:<{width}}  {measured:<24} {'n/a' if ok is None else 'yes' if ok else 'NO'}")
    if args.json:
        doc = {"reports": reports, "targets": [dict(target=t, measured=m, met=ok) for t, m, ok in rows]}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


TARGETS = {"fp32": (1.05, 0.85), "bf16": (1.3, 0.70)}  # (speed-up over transformers, utilisation of peak)
RUNS = ("fp32", "bf16", "int8", "train")
INT8_TARGET = 1.8  # int8 over the best fp32 peer row


if __name__ == "__main__":
    sys.exit(main())
