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

Every number comes from vitkit.bench.run_bench (synthetic inputs, outputs checked for parity before timing).
Where timm is importable it is timed in the same loop and held to the same targets.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch
from torch import nn

from vitkit.bench import BenchConfig, BenchReport, Measurement, best_rows, run_bench
from vitkit.checkpoint.timm import timm_kwargs, vitkit_to_timm
from vitkit.fast import bf16_is_fast, can_compile, tune_cpu_allocator


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=("fp32", "bf16", "train"), action="append", help="run only these comparisons")
    p.add_argument("--batch-size", type=int, default=8, help="ViT-B/16 inference batch (default 8)")
    p.add_argument("--train-batch-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
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
    common = dict(repeats=args.repeats, warmup=args.warmup, device=args.device)
    runs = args.only or ["fp32", "bf16", "train"]
    has_onnxruntime = importlib.util.find_spec("onnxruntime") is not None  # its row is shown, not a target

    rows: list[tuple[str, str, bool | None]] = []
    reports: dict[str, dict] = {}
    for run in runs:
        if run == "bf16" and not native_bf16:
            rows.append(("ViT-B/16 bf16 inference", "skipped: bf16 emulated here (--force-bf16)", None))
            continue
        print(f"== {run}", file=sys.stderr, flush=True)
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

if __name__ == "__main__":
    sys.exit(main())
