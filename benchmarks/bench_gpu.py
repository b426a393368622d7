"""vitkit against Hugging Face transformers and timm on one CUDA GPU: ViT-B/16 and ViT-L/16 at 224 px.

    python benchmarks/bench_gpu.py                                  # both models (~15 min on an H100, compiling)
    python benchmarks/bench_gpu.py --models vit_b16 --json gpu.json
    python benchmarks/bench_gpu.py --quick                          # a tiny ViT, a smoke test of the script

Every library gets the same switches, each timed in one loop that alternates between them (harness.run_bench):

- inference, bf16 weights (``model.to(torch.bfloat16)``; vitkit: ``optimize_for_inference(model, "bf16",
  compile=mode)``), batch 1 and 256: eager, and torch.compile. Batch 1 is launch-bound, so it is compiled with mode
  "reduce-overhead" (CUDA graphs); batch 256 with "default". Inference compiles with inductor freezing for all.
- training, batch 128: bf16 autocast over fp32 weights, cross-entropy, backward, fused AdamW (vitkit's model
  through ``optimize_for_training(model)``); eager and torch.compile "default".

MFU is the model's FLOPs (forward; 3x forward for a training step) per second over the GPU's dense bf16 peak
from its datasheet (harness.dense_bf16_peak: 989.4 TFLOP/s for H100 SXM and H200; printed); a large bf16
matmul is timed in the same rounds and its rate printed beside it. Before the timings the script records which
kernel SDPA ran for each library's attention (torch.profiler; vitkit's model as built). Peak memory is the CUDA
allocator's peak during one step above what was allocated before it (weights, and in training gradients and AdamW's
moments, come on top).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import torch
from harness import BenchConfig, BenchReport, best_rows, dense_bf16_peak, hf_peer, run_bench, timm_peer
from torch import nn

from vitkit.models import create_model

TARGET_RATIO = 1.1  # vitkit over the best peer, each row
TARGET_TRAIN_MFU = 0.5
ATTENTION_KERNELS = ("flash", "fmha", "attention", "attn", "cudnn_sdpa", "efficient")


def log(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


def attention_kernels(model: nn.Module, x: torch.Tensor) -> list[str]:
    """The CUDA kernels of one eager forward whose names say attention (which SDPA backend ran)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        model(x)  # warm: lazy initialisation stays out of the profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(x)
            torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    return sorted(n for n in names if any(k in n.lower() for k in ATTENTION_KERNELS))


def bench_rows(model_name: str, args: argparse.Namespace) -> list[tuple[str, BenchConfig, tuple[str, ...]]]:
    """(label, config, compile modes) of each comparison for one model."""
    common = dict(
        model=model_name,
        compare=("hf",),
        device="cuda",
        repeats=args.repeats,
        max_repeats=args.max_repeats,
        warmup=args.warmup,
        overrides=args.overrides,
    )
    rows = [
        (
            f"{model_name} inference batch {b}",
            BenchConfig(batch_size=b, dtype="bf16", mode="infer", **common),  # type: ignore[arg-type]
            ("none", "reduce-overhead" if b <= 8 else "default"),
        )
        for b in args.infer_batches
    ]
    if args.train_batch:
        rows.append(
            (
                f"{model_name} training batch {args.train_batch}",
                BenchConfig(batch_size=args.train_batch, dtype="bf16-autocast", mode="train", **common),  # type: ignore[arg-type]
                ("none", "default"),
            )
        )
    return rows


def summary(label: str, report: BenchReport, peak_tflops: float) -> tuple[list[str], list[tuple[str, str, bool]]]:
    """Lines of a row's MFU against the datasheet peak, and its target rows."""
    per_image = report.gflops_per_step / report.config["batch_size"]  # 3x forward for a training step
    lines = [f"MFU against the datasheet's dense bf16 peak ({peak_tflops:g} TFLOP/s), {per_image:.1f} GFLOP/image:"]
    for m in report.measurements:
        mfu = m.images_per_s * per_image / (peak_tflops * 1e3)
        lines.append(f"  {m.name:<24} {m.images_per_s:>9.1f} img/s  MFU {mfu:6.1%}")
    best = best_rows(report.measurements)
    targets = []
    for peer, st in report.ratio_stats.items():
        ok = st["low"] >= TARGET_RATIO
        targets.append(
            (
                f"{label}: vitkit {best['vitkit'].name} / {best[peer].name} >= {TARGET_RATIO}x",
                f"{st['median']:.3f}x [{st['low']:.3f}, {st['high']:.3f}]",
                ok,
            )
        )
    if report.config["mode"] == "train":
        mfu = best["vitkit"].images_per_s * per_image / (peak_tflops * 1e3)
        targets.append((f"{label}: vitkit MFU >= {TARGET_TRAIN_MFU:.0%}", f"{mfu:.1%}", mfu >= TARGET_TRAIN_MFU))
    return lines, targets


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="vit_b16,vit_l16")
    p.add_argument("--infer-batches", default="1,256", help="comma-separated; empty: no inference rows")
    p.add_argument("--train-batch", type=int, default=128, help="0: no training row")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--max-repeats", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds (compilation and CUDA graph capture)")
    p.add_argument(
        "--quick", action="store_true", help="a 2-block ViT-S/16 (batches 2, 16; training 8), 3 rounds: a smoke test"
    )
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu.py needs a CUDA GPU")
    args.infer_batches = [int(b) for b in args.infer_batches.split(",") if b]
    args.overrides = {}
    if args.quick:
        args.models, args.infer_batches, args.train_batch = "vit_s16", [2, 16], 8
        args.repeats, args.max_repeats, args.warmup, args.overrides = 3, 3, 3, {"depth": 2}
    device = torch.device("cuda")
    peak, gpu = dense_bf16_peak(device)
    print(f"{gpu}; torch {torch.__version__}; dense bf16 peak used for MFU: {peak:g} TFLOP/s", flush=True)
    peers = {"timm": timm_peer} if importlib.util.find_spec("timm") is not None else {}

    doc: dict[str, Any] = {"gpu": gpu, "dense_bf16_tflops": peak, "torch": torch.__version__, "reports": {}}
    targets: list[tuple[str, str, bool]] = []
    for model_name in args.models.split(","):
        torch.manual_seed(0)
        model = create_model(model_name, **args.overrides).to(device, torch.bfloat16).eval()
        x = torch.randn(8, 3, 224, 224, device=device, dtype=torch.bfloat16)
        kernels = {"vitkit": attention_kernels(model, x), "transformers": attention_kernels(hf_peer(model), x)}
        kernels.update({name: attention_kernels(build(model), x) for name, build in peers.items()})
        print(f"{model_name} bf16 attention kernels (eager, batch 8):", flush=True)
        for name, found in kernels.items():
            print(f"  {name:<13} {', '.join(found) or '(none found)'}", flush=True)
        doc["reports"][f"{model_name} attention kernels"] = kernels
        del model
        for label, cfg, modes in bench_rows(model_name, args):
            log(f"== {label}")
            report = run_bench(cfg, log=log, compile_modes=modes, extra_peers=peers)
            lines, rows = summary(label, report, peak)
            print(report.table() + "\n" + "\n".join(lines) + "\n", flush=True)
            targets += rows
            doc["reports"][label] = report.to_dict()
            torch.cuda.empty_cache()

    width = max(len(t[0]) for t in targets)
    print(f"{'target':<{width}}  {'measured':<24} met")
    for target, measured, ok in targets:
        print(f"{target:<{width}}  {measured:<24} {'yes' if ok else 'NO'}")
    if args.json:
        doc["targets"] = [dict(target=t, measured=m, met=ok) for t, m, ok in targets]
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
