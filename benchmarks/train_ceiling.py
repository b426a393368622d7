"""How much of the matmul peak a ViT's training step can reach on this machine: where its time goes.

    python benchmarks/train_ceiling.py     # ViT-S/16, batch 32, fp32 and (bf16 native here) bf16 autocast: 4 min
    python benchmarks/train_ceiling.py --dtypes bf16-autocast --rounds 3
    python benchmarks/train_ceiling.py --compile default   # the step through torch.compile: 6 min

benchmarks/speed_targets.py's training rows (and bench_vit.py --mode train) print vitkit's share of the peak: the
FLOPs its step executes a second (forward, cross-entropy, backward, fused AdamW; the backward counted as twice the
forward) over the rate of one large square product in the same precision (harness.matmul_probe), timed in turn with
the step, vitkit's model through ``optimize_for_training(model)`` (harness.vitkit_step). This script times the same
step the same way, then profiles it (torch.profiler) and sorts its time into the products (every matmul,
batched matmul, fused attention kernel and the patch convolution, each with the FLOPs its shapes give) and
everything else. If nothing but the products ran, at the rates they reach inside the step, the step's share of the
peak could not exceed

    ceiling = executed FLOPs / the products' seconds / peak

and a share of 80% leaves everything else executed FLOPs / (0.8 peak) - the products' seconds. The products' FLOPs
are checked against the step's count (they differ by the patch convolution's forward: no gradient reaches the
image). ViTs only (the patch convolution's FLOPs are read with its stride equal to its kernel). Speed needs a quiet
machine: the load average is checked.

``--compile`` times and profiles the step with the model through torch.compile (as ``bench_vit.py --compile``):
inductor fuses the elementwise work around the products into kernels of its own, each profiled under its name,
while the products stay library calls, counted as above (but for the class-token block's attention, one query a
head, which inductor computes as a reduction of its own: 0.3 MFLOP an image for ViT-S/16).
"""

from __future__ import annotations

import argparse
import math
import resource
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from harness import (
    BenchConfig,
    build_model,
    command_line,
    executes_first_token,
    load_average,
    load_warnings,
    matmul_probe,
    paired_utilisation,
    recorded,
    step_seconds,
    time_alternating,
    vitkit_step,
)

from vitkit.accel.training import tune_cpu_allocator
from vitkit.device import bf16_is_fast, usable_cores
from vitkit.models import ViTConfig
from vitkit.models.flops import vit_flops
from vitkit.models.registry import model_config

Shapes = Sequence[Sequence[int]]


def _linear(shapes: Shapes) -> int:
    # (x, weight, bias, ...) or, with a binary post-op, (x, other, weight, ...): weight is (out, in), in = x's last
    x, w = shapes[0], shapes[1] if len(shapes[1]) == 2 and shapes[1][1] == shapes[0][-1] else shapes[2]
    return 2 * math.prod(x) * w[0]


def _conv(shapes: Shapes) -> int:
    (b, c, h, w), (o, _, kh, kw) = shapes[0], shapes[1]
    return 2 * b * o * (h // kh) * (w // kw) * c * kh * kw  # stride = kernel: the patch embedding


def _conv_weight_grad(shapes: Shapes) -> int:
    (b, o, h, w), _, (_, c, kh, kw) = shapes[:3]
    return 2 * b * o * h * w * c * kh * kw  # the weight's gradient; the image gets none


def _attention(shapes: Shapes, products: int) -> int:
    # (q, k, v, ...) forward, two products; (grad_out, q, k, v, ...) backward, four
    (b, h, n, d), (_, _, m, _) = shapes[products // 2 - 1], shapes[products // 2]
    return 2 * products * b * h * n * m * d


# profiler name -> (group, the FLOPs its recorded input shapes give)
PRODUCTS: dict[str, tuple[str, Callable[[Shapes], int]]] = {
    "mkldnn::_linear_pointwise": ("oneDNN linear", _linear),
    "aten::mm": ("gemm", lambda s: 2 * s[0][0] * s[0][1] * s[1][1]),
    "aten::addmm": ("gemm", lambda s: 2 * s[1][0] * s[1][1] * s[2][1]),
    "aten::bmm": ("batched gemm", lambda s: 2 * s[0][0] * s[0][1] * s[0][2] * s[1][2]),
    "aten::baddbmm": ("batched gemm", lambda s: 2 * s[1][0] * s[1][1] * s[1][2] * s[2][2]),
    "aten::_scaled_dot_product_flash_attention_for_cpu": ("SDPA kernels", lambda s: _attention(s, 2)),
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": ("SDPA kernels", lambda s: _attention(s, 4)),
    "aten::mkldnn_convolution": ("patch convolution", _conv),
    "aten::convolution_backward": ("patch convolution", _conv_weight_grad),
}


def _in_backward(event: Any) -> bool:
    """Whether a profiler event ran inside the autograd engine (a backward function)."""
    while event is not None:
        if event.name.startswith("autograd::engine::evaluate_function"):
            return True
        event = event.cpu_parent
    return False


def _other_name(name: str) -> str:
    # a compiled graph's name carries its hash: its calls are counted together
    return "compiled graphs" if name.startswith("## Call CompiledFxGraph") else name.removeprefix("aten::")


def breakdown(events: Any) -> tuple[dict[str, list[float]], dict[str, float]]:
    """From the profiler events of one step: {product group: [seconds, FLOPs]} and {other op: seconds} (self time:
    nothing counted twice). A group is a kernel and whether it ran forward or backward; its FLOPs are counted from
    the recorded input shapes, 0 where none were recorded."""
    products: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    others: dict[str, float] = defaultdict(float)
    for event in events:
        seconds = event.self_cpu_time_total / 1e6
        shapes = [s for s in event.input_shapes if s]
        if event.name in PRODUCTS:
            kernel, flops = PRODUCTS[event.name]
            count = flops(shapes) if shapes else 0
        else:
            if seconds > 0:
                others[_other_name(event.name)] += seconds
            continue
        group = products[f"{'backward' if _in_backward(event) else 'forward'} {kernel}"]
        group[0] += seconds
        group[1] += count
    return dict(products), dict(others)


def profiled(step: Callable[[], Any], shapes: bool = False) -> tuple[Any, int]:
    """The profiler events of one call of step (with their input shapes), and the minor page faults meanwhile."""
    from torch.profiler import ProfilerActivity, profile

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    with profile(activities=[ProfilerActivity.CPU], record_shapes=shapes) as prof:
        step()
    return prof.events(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def settle(step: Callable[[], Any], most: int = 8, faults: int = 1000) -> int:
    """Profile steps until one page-faults fewer than ``faults`` times (at most ``most``): how many it took.

    The profiler's own allocations land between the step's freed tensors, so the first profiled steps find no
    room for them and take fresh pages (a ViT-S/16 fp32 step at batch 32: 80,000-130,000 minor faults, 0.1-0.2 s of
    system time, where an unprofiled step has next to none once the allocator is tuned); the heap then settles.
    Recording input shapes allocates more, and kept the heap growing step after step (400,000 faults, 4 s of system
    time a step), so the timed steps record none and one step at the end gives the FLOPs.
    """
    for n in range(1, most + 1):
        if profiled(step)[1] < faults:
            return n
    return most


Round = tuple[float, dict[str, list[float]], dict[str, float], int]  # peak FLOP/s, breakdown, page faults


def profile_rounds(step: Callable[[], Any], probe: Callable[[], Any], probe_flops: float, rounds: int) -> list[Round]:
    """Rounds of the probe timed, then the step profiled: (that round's peak FLOP/s, the step's breakdown, its
    minor page faults)."""
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        probe()
        peak = probe_flops / (time.perf_counter() - start)
        events, faults = profiled(step)
        out.append((peak, *breakdown(events), faults))
    return out


def report(
    label: str,
    share: float,
    step_flops: float,
    image_flops: float,
    rounds: list[Round],
    counted: dict[str, list[float]],
) -> list[str]:
    """The lines printed for one dtype: medians over the profiled rounds, each rate against its round's peak."""
    peaks = [peak for peak, *_ in rounds]
    groups = sorted({g for _, products, *_ in rounds for g in products})
    names = {n for _, _, others, _ in rounds for n in others}

    def median(values: list[float]) -> float:
        return statistics.median(values) if values else 0.0

    products_s = [sum(s for s, _ in products.values()) for _, products, *_ in rounds]
    rest_s = [sum(others.values()) for _, _, others, _ in rounds]
    total = median([p + r for p, r in zip(products_s, rest_s, strict=True)])
    product_flops = sum(f for _, f in counted.values())
    faults = ", ".join(f"{r[3]:,}" for r in rounds)
    lines = [
        f"{label}: {share:.1%} of the peak, {step_flops / 1e9:.1f} GFLOP executed",
        f"  {len(rounds)} profiled steps (median {total:.3f} s; page faults {faults}; peak {median(peaks) / 1e9:.1f} "
        f"GFLOP/s in their rounds), their products {product_flops / 1e9:.1f} GFLOP (the step's count less the patch "
        f"convolution's forward, no gradient reaching the image: {(step_flops - image_flops) / 1e9:.1f}):",
    ]
    rows = []
    for group in groups:
        seconds = [products.get(group, [0.0, 0.0])[0] for _, products, *_ in rounds]
        flops = counted.get(group, [0.0, 0.0])[1]
        share_of_peak = [flops / s / peak for s, (peak, *_) in zip(seconds, rounds, strict=True) if s > 0]
        rows.append((median(seconds), group, flops, median(share_of_peak)))
    for group_s, group, flops, of_peak in sorted(rows, reverse=True):
        lines.append(
            f"    {group:28s} {group_s * 1e3:7.1f} ms {group_s / total:6.1%}  {flops / 1e9:6.1f} GFLOP at "
            f"{of_peak:4.0%} of the peak"
        )
    others = sorted(((median([o.get(n, 0.0) for _, _, o, _ in rounds]), n) for n in names), reverse=True)[:8]
    rest = median(rest_s)
    lines.append(
        f"    {'everything else':28s} {rest * 1e3:7.1f} ms {rest / total:6.1%}: "
        + ", ".join(f"{name} {s * 1e3:.0f}" for s, name in others)
    )
    ceilings = [step_flops / p / peak for p, peak in zip(products_s, peaks, strict=True)]
    budgets = [step_flops / (0.8 * peak) - p for p, peak in zip(products_s, peaks, strict=True)]
    lines.append(
        f"  ceiling, the products alone at these rates: {median(ceilings):.1%} of the peak; 80% of it leaves "
        f"everything else {median(budgets) * 1e3:.0f} ms a step (it took {rest * 1e3:.0f})"
    )
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vit_s16", help="a registered ViT (default vit_s16)")
    p.add_argument("--batch-size", type=int, default=32, help="(default 32, as speed_targets.py's training rows)")
    p.add_argument("--img-size", type=int, default=224, help="(default 224, as speed_targets.py's)")
    p.add_argument("--dtypes", default="fp32,bf16-autocast", help="comma-separated (default fp32,bf16-autocast)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds of step and probe (default 5)")
    p.add_argument("--profile", type=int, default=5, help="steps profiled, each after the probe (default 5)")
    p.add_argument(
        "--compile",
        default="none",
        choices=("none", "default", "max-autotune"),
        help="torch.compile mode (default none)",
    )
    p.add_argument("--results", help="also write what is printed as a result file (benchmarks/results/)")
    args = p.parse_args(argv)
    config = model_config(args.model)
    if not isinstance(config, ViTConfig):
        p.error(f"--model {args.model}: not a ViT")
    dtypes = args.dtypes.split(",")
    if unknown := [d for d in dtypes if d not in ("fp32", "bf16-autocast")]:
        p.error(f"--dtypes: {unknown} not among fp32, bf16-autocast")
    tune_cpu_allocator()  # as optimize_for_training and the other benchmarks do
    device = torch.device("cpu")
    with recorded(args.results, command_line(__file__, argv)):
        if "bf16-autocast" in dtypes and not bf16_is_fast(device):  # as speed_targets.py leaves out its bf16 rows
            print("bf16 is emulated on this CPU (no AMX / AVX512-BF16): bf16-autocast is left out")
            dtypes.remove("bf16-autocast")
        before = load_average()
        # a compiled step's own kernels, each under its name in the profile, rather than one event for the graph
        with torch._inductor.config.patch({"cpp.enable_kernel_profile": args.compile != "none"}):
            for dtype in dtypes:
                run(args, dtype, config, device)
        for line in load_warnings(before, load_average(), torch.get_num_threads(), usable_cores()):
            print(line)


def run(args: argparse.Namespace, dtype: str, config: ViTConfig, device: torch.device) -> None:
    """Time, profile and report one dtype's step."""
    size = args.img_size
    cfg = BenchConfig(
        model=args.model,
        batch_size=args.batch_size,
        img_size=size,
        dtype=dtype,
        mode="train",
        device="cpu",
        compile=args.compile,
    )
    model = build_model(cfg, device)
    torch.manual_seed(1)
    x = torch.randn(args.batch_size, config.in_chans, size, size)
    y = torch.randint(0, max(config.num_classes, 1), (args.batch_size,))
    first_token = executes_first_token(model, cfg)  # as optimize_for_training runs it (vitkit_step)
    step = vitkit_step(model, cfg, x, y, device)
    built = model.config
    assert isinstance(built, ViTConfig)
    flops = vit_flops(built, size, first_token)
    step_flops = 3 * flops["total"] * args.batch_size
    probe, probe_flops = matmul_probe(
        torch.float32 if dtype == "fp32" else torch.bfloat16, device, seconds=step_seconds(step, device)
    )
    times = time_alternating({"step": step, "probe": probe}, args.rounds, 1, device)
    share = paired_utilisation(step_flops, times["step"], probe_flops, times["probe"])
    warm = settle(step)
    rounds = profile_rounds(step, probe, probe_flops, args.profile)
    counted = breakdown(profiled(step, shapes=True)[0])[0]
    compiled = "" if args.compile == "none" else f", compiled ({args.compile})"
    label = (
        f"{args.model} training step, batch {args.batch_size}, {dtype}{compiled} ({torch.get_num_threads()} "
        f"threads, peak {probe.kernel} {probe.size}, step {statistics.median(times['step']):.3f} s; {warm} "
        "profiled steps before the heap settled)"
    )
    image = flops["patch_embed"] * args.batch_size
    print("\n".join(report(label, share, step_flops, image, rounds, counted)) + "\n", flush=True)


if __name__ == "__main__":
    main()
