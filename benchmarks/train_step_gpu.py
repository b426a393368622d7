"""Where a ViT training step's device time goes: vitkit against timm, compiled with and without CUDA graphs.

    python benchmarks/train_step_gpu.py                         # ViT-B/16, batch 128, on a CUDA GPU
    python benchmarks/train_step_gpu.py --models vit_b16,vit_l16 --modes default
    python benchmarks/train_step_gpu.py --device cpu --models vit_s16 --depth 2 --batch 4 --modes none   # smoke test

The step is the benchmark's own (harness.make_step; vitkit's model through ``optimize_for_training(model)``,
harness.vitkit_step): bf16 autocast over fp32 weights, cross-entropy, backward, fused AdamW. Each (library,
compile mode) is built from the same weights, warmed up, then timed in rounds that take turns, ``--steps`` steps a
round between device syncs; a row's time is the median round, and each peer's rounds over vitkit's in the same
mode give a paired ratio with its 95% interval (harness.stats). Then torch.profiler records ``--profile-steps``
steps of each row, and its kernels are summed by kind:

- gemm: cuBLAS / cuBLASLt / CUTLASS matrix products (``aten::mm``, ``addmm``, ``bmm`` on a CPU);
- attention: the SDPA kernels (flash, cuDNN, memory-efficient), forward and backward;
- fused: inductor's generated kernels (LayerNorm, GELU, residual adds, casts, fused into each other);
- optimizer: the fused AdamW's multi-tensor kernels;
- other: copies, fills, reductions and anything else.

"busy" is the sum of the kernels' times over the step's wall time: where it is well under 100%, the device waits
for the host to launch work (what CUDA graphs remove). MFU is the model's FLOPs (3x forward) per second over the
GPU's dense bf16 datasheet peak (harness.dense_bf16_peak); gemm TFLOP/s is the matrix-product FLOPs outside
attention that the row's step executes (vitkit's class-token-only last block computes less) over the gemm kernels'
time.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import replace

import torch
from harness import (
    SETTLE_S,
    BenchConfig,
    build_model,
    dense_bf16_peak,
    executes_first_token,
    make_step,
    paired_ratio_stats,
    time_alternating,
    timm_peer,
    vitkit_step,
)
from torch import nn

from vitkit.models.flops import model_flops, vit_flops

KINDS = ("gemm", "attention", "fused", "optimizer", "other")
_PATTERNS = (
    ("attention", re.compile(r"flash|fmha|sdpa|attention|efficient", re.I)),
    ("optimizer", re.compile(r"multi_tensor|adam", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|sm\d+_.*(?:tn|nt|nn)|^aten::(?:mm|addmm|bmm|linear)$", re.I)),
    ("fused", re.compile(r"^triton_|^cpp_fused", re.I)),
)


def kind_of(kernel: str) -> str:
    """The kind of one kernel (or, on a CPU, one aten op) by its name; see the module docstring."""
    for kind, pattern in _PATTERNS:
        if pattern.search(kernel):
            return kind
    return "other"


def profile_kinds(step: Callable[[], object], device: torch.device, steps: int) -> tuple[dict[str, float], list]:
    """Seconds a step of each kind of kernel, and the ten costliest kernels as (name, seconds a step)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    per_kernel: dict[str, float] = {}
    for e in prof.key_averages():
        if cuda and e.device_type == DeviceType.CUDA:
            us = e.self_device_time_total
        elif not cuda and e.device_type == DeviceType.CPU and e.key.startswith(("aten::", "cpp_fused", "triton_")):
            us = e.self_cpu_time_total
        else:
            continue
        per_kernel[e.key] = per_kernel.get(e.key, 0.0) + us * 1e-6 / steps
    kinds = dict.fromkeys(KINDS, 0.0)
    for name, s in per_kernel.items():
        kinds[kind_of(name)] += s
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:10]
    return kinds, top


def timed_rounds(
    steps: dict[str, Callable[[], object]], device: torch.device, per_round: int, rounds: int
) -> dict[str, list[float]]:
    """Seconds a step of each row in each round: harness.time_alternating's rounds, ``per_round`` steps a call."""

    def repeated(step: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(per_round):
                step()

        return run

    settle_s = SETTLE_S if device.type == "cpu" else 0.0  # no CPU thread pools to let go idle on a GPU
    calls = time_alternating({n: repeated(s) for n, s in steps.items()}, rounds, 0, device, settle_s=settle_s)
    return {name: [t / per_round for t in times] for name, times in calls.items()}


def gemm_flops(model: nn.Module, img_size: int, executed: bool) -> float:
    """A training step's matrix-product FLOPs an image outside attention's two products (3x forward): those vitkit
    executes (``executed``: its class-token-only last block, vitkit.accel.first_token, computes one token's projection
    and MLP) or the whole model's, which timm executes."""
    f = vit_flops(model.config, img_size, first_token=executed)
    return 3 * (f["total"] - f["attention"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="vit_b16")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--modes", default="default,reduce-overhead", help="torch.compile modes, comma-separated")
    p.add_argument("--libraries", default="vitkit,timm")
    p.add_argument("--device", default="cuda")
    p.add_argument("--depth", type=int, default=0, help="blocks (0: the model's own)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="steps a timed round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--profile-steps", type=int, default=3)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("train_step_gpu.py: no CUDA GPU here (--device cpu runs it on the CPU)")
    libraries = args.libraries.split(",")
    if unknown := sorted(set(libraries) - {"vitkit", "timm"}):
        raise SystemExit(f"train_step_gpu.py: --libraries {','.join(unknown)}: expected vitkit and/or timm")
    if "timm" in libraries and importlib.util.find_spec("timm") is None:
        print("timm is not importable: vitkit alone", flush=True)
        libraries.remove("timm")
    peak, gpu = dense_bf16_peak(device) if device.type == "cuda" else (float("nan"), "cpu")
    print(f"{gpu}; torch {torch.__version__}; dense bf16 peak for MFU: {peak:g} TFLOP/s", flush=True)

    for model_name in args.models.split(","):
        bench_model(model_name, args, libraries, peak, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


def bench_model(
    model_name: str, args: argparse.Namespace, libraries: list[str], peak: float, device: torch.device
) -> None:
    """One model: each (library, mode) built, warmed up, timed in rounds taking turns, profiled; printed."""
    overrides = {"depth": args.depth} if args.depth else {}
    cfg = BenchConfig(
        model=model_name,
        batch_size=args.batch,
        dtype="bf16-autocast",
        mode="train",
        device=args.device,
        overrides=overrides,
    )
    base = build_model(cfg, device)
    per_image = 3 * model_flops(base, cfg.img_size)
    first_token = executes_first_token(base, cfg)  # what optimize_for_training runs (harness.vitkit_step)
    gemm_per_image = {
        lib: gemm_flops(base, cfg.img_size, executed=lib == "vitkit" and first_token) for lib in libraries
    }
    torch.manual_seed(1)
    x = torch.randn(args.batch, 3, cfg.img_size, cfg.img_size, device=device)
    y = torch.randint(0, base.config.num_classes, (args.batch,), device=device)
    steps: dict[str, Callable[[], object]] = {}
    for lib in libraries:
        for mode in args.modes.split(","):
            if lib == "vitkit":
                step = vitkit_step(build_model(cfg, device), replace(cfg, compile=mode), x, y, device)
            else:
                step = make_step(timm_peer(build_model(cfg, device)), replace(cfg, compile=mode), x, y, device)
            for _ in range(args.warmup):  # time_alternating syncs the device before it times
                step()
            steps[f"{lib}/{mode}"] = step
            print(f"  {model_name} {lib}/{mode}: built and warmed up", file=sys.stderr, flush=True)
    rounds = timed_rounds(steps, device, args.steps, args.rounds)
    seconds = {name: statistics.median(s) for name, s in rounds.items()}
    print(f"\n{model_name}, training step at batch {args.batch} ({per_image / 1e9:.1f} GFLOP an image):")
    head = f"{'row':<26}{'ms':>8}{'img/s':>9}{'MFU':>7}{'busy':>7}" + "".join(f"{k:>10}" for k in KINDS)
    print(head + f"{'gemm TFLOP/s':>14}")
    tops = {}
    for name, step in steps.items():
        kinds, tops[name] = profile_kinds(step, device, args.profile_steps)
        s = seconds[name]
        busy = sum(kinds.values()) / s
        mfu = args.batch * per_image / s / (peak * 1e12)
        gemm = args.batch * gemm_per_image[name.split("/")[0]]
        gemm_rate = gemm / kinds["gemm"] / 1e12 if kinds["gemm"] else float("nan")
        cells = "".join(f"{kinds[k] * 1e3:>8.2f}ms" for k in KINDS)
        print(f"{name:<26}{s * 1e3:>8.2f}{args.batch / s:>9.1f}{mfu:>7.1%}{busy:>7.1%}{cells}{gemm_rate:>14.1f}")
    for name in steps:  # each peer row against vitkit's in the same mode, round by round
        lib, mode = name.split("/")
        if lib != "vitkit" and f"vitkit/{mode}" in rounds:
            print(f"vitkit/{mode} over {name}: {paired_ratio_stats(rounds[name], rounds[f'vitkit/{mode}'])}")
    for name, top in tops.items():
        print(f"\n{name}: costliest kernels, ms a step")
        for kernel, s in top:
            print(f"  {s * 1e3:8.3f}  {kind_of(kernel):<9}  {kernel[:110]}")


if __name__ == "__main__":
    sys.exit(main())
