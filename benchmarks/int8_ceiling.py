"""How much of the int8 matmul peak a ViT's int8 inference can reach on this machine, whatever runs around its matmuls.

    python benchmarks/int8_ceiling.py                        # ViT-B/16 at batch 1, 8 and 64: 1 min on 2 cores
    python benchmarks/int8_ceiling.py --model vit_s16 --batch-sizes 8

The int8 share of peak that benchmarks/speed_targets.py prints is the FLOPs the model executes over its time
(through ``optimize_for_inference(model, "int8")``), against the int8 peak (one large square int8 product through
the fastest kernel here, harness.matmul_probe, timed here too). Its Linear layers are int8 matmuls, which run near
that peak at ViT shapes (printed below); attention (q k^T and the probabilities times v) is not int8. So even if
nothing ran but the matmuls and attention (no quantisation or rescaling, LayerNorm, GELU or residual adds), a
forward pass would take the matmuls' time plus attention's, and its share of the peak could not exceed

    ceiling = executed FLOPs / (matmul seconds + attention seconds) / peak

with the matmuls at the peak, and, nearer the truth, at the rates vitkit's int8 matmul (oneDNN's, on weights packed
once) reaches at the block's Linear shapes. Attention is timed for one block four ways: torch's fused kernel (SDPA)
in fp32 and in bf16, vitkit's written-out attention in bf16 (two batched bf16 matmuls and a softmax, its fastest on
a bf16 CPU), and, as a bound on attention in int8, its two products alone as torch._int_mm calls, one per image and
head (the int8 kernel is 2-D; no softmax or quantisation counted). Speed needs a quiet machine: the load average is
checked.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from harness import load_average, load_warnings, measure_matmul_peak, time_alternating

from vitkit.accel.int8 import Int8Linear, int8_kernel
from vitkit.accel.training import tune_cpu_allocator
from vitkit.device import usable_cores
from vitkit.models import ViTConfig
from vitkit.models.flops import vit_flops
from vitkit.models.registry import model_config
from vitkit.models.vit import Attention


def ceiling(executed_flops: float, matmul_flops: float, attention_s: float, peak_flops: float) -> float:
    """The share of the peak a forward pass reaches when its matmuls run at the peak and attention takes
    attention_s seconds, nothing else taking any time (FLOPs and rates in the same unit)."""
    return executed_flops / (matmul_flops / peak_flops + attention_s) / peak_flops


def medians(steps: dict[str, Callable[[], Any]], rounds: int, min_s: float = 0.1) -> dict[str, float]:
    """Median seconds a call of each step, the steps taking turns in every round after one to warm up. A step is
    timed over as many calls back to back as take min_s: time_alternating idles between its timings, and a
    millisecond's work timed alone after that would mostly measure the wake-up of the threads."""
    calls = {name: max(1, math.ceil(min_s / max(timeit(step), 1e-6))) for name, step in steps.items()}
    repeated = {name: functools.partial(_repeat, step, calls[name]) for name, step in steps.items()}
    times = time_alternating(repeated, repeats=rounds, warmup=1, device=torch.device("cpu"))
    return {name: statistics.median(t) / calls[name] for name, t in times.items()}


def timeit(fn: Callable[[], Any]) -> float:
    """Seconds of one call, after one to warm up."""
    fn()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _repeat(fn: Callable[[], Any], calls: int) -> None:
    for _ in range(calls):
        fn()


def attention_seconds(cfg: ViTConfig, batch: int, tokens: int, rounds: int) -> dict[str, float]:
    """Seconds of one full block's attention, (batch, heads, tokens, head_dim) queries, keys and values: SDPA in fp32
    and bf16, vitkit's written-out attention in bf16, and the int8 products alone (q k^T and p v through
    torch._int_mm for each image and head)."""
    heads, head_dim = cfg.num_heads, cfg.width // cfg.num_heads
    qkv = [torch.randn(batch, heads, tokens, head_dim) for _ in range(3)]
    bf16 = [t.bfloat16() for t in qkv]
    written = Attention(cfg.width, heads).attend  # the explicit path's own code
    int8 = [torch.randint(-128, 128, s, dtype=torch.int8) for s in ((tokens, head_dim), (head_dim, tokens))]
    probs = torch.randint(0, 128, (tokens, tokens), dtype=torch.int8)
    steps = {
        "fp32 SDPA": functools.partial(F.scaled_dot_product_attention, *qkv),
        "bf16 SDPA": functools.partial(F.scaled_dot_product_attention, *bf16),
        "bf16 written out": functools.partial(written, *bf16, None, True),  # no logit bias, written out
        "int8 products": functools.partial(_int8_products, *int8, probs, batch * heads),
    }
    with torch.no_grad():
        return medians(steps, rounds)


def _int8_products(q: torch.Tensor, k_t: torch.Tensor, probs: torch.Tensor, heads: int) -> None:
    """The two int8 products of attention for ``heads`` (image, head) pairs of one block: (N, hd) x (hd, N), then
    (N, N) x (N, hd)."""
    for _ in range(heads):
        torch._int_mm(q, k_t)
        torch._int_mm(probs, q)


def int8_matmul_rates(cfg: ViTConfig, rows: int, rounds: int) -> tuple[list[float], float]:
    """FLOP/s of the int8 matmul vitkit's Int8Linear runs (oneDNN's, on the weight packed once) at each of a
    block's Linear shapes (qkv, proj, fc1, fc2) for rows tokens, and their rate together (the block's Linear
    FLOPs over the time they take at those rates)."""
    d, m = cfg.width, cfg.mlp_dim
    shapes = ((d, 3 * d), (d, d), (d, m), (m, d))
    steps = {}
    for k, n in shapes:
        unsigned = torch.randint(0, 256, (rows, k), dtype=torch.uint8)
        steps[f"{k}x{n}"] = functools.partial(Int8Linear(torch.nn.Linear(k, n)).products, unsigned)
    flops = [2 * rows * k * n for k, n in shapes]
    rates = [f / s for f, s in zip(flops, medians(steps, rounds).values(), strict=True)]
    return rates, sum(flops) / sum(f / r for f, r in zip(flops, rates, strict=True))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vit_b16", help="a registered ViT (default vit_b16)")
    p.add_argument("--batch-sizes", default="1,8,64", help="comma-separated (default 1,8,64)")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds, the medians printed (default 7)")
    args = p.parse_args(argv)
    cfg = model_config(args.model)
    if not isinstance(cfg, ViTConfig):
        p.error(f"--model {args.model}: not a ViT")
    if int8_kernel() != "onednn":
        p.error("this CPU has no VNNI: vitkit's int8 models run fbgemm's kernels here, not the ones this times")
    flops = vit_flops(cfg, first_token=True)  # what the int8 switch executes, per image (accel.first_token)
    full_block = vit_flops(cfg)["attention"] / cfg.depth  # one block's attention FLOPs, every token a query
    blocks = flops["attention"] / full_block  # the class-token-only last block counts for its share of them
    matmuls = flops["total"] - flops["attention"]
    tokens = cfg.grid()[0] * cfg.grid()[1] + (1 if cfg.classifier == "token" else 0)  # through each full block
    tune_cpu_allocator()  # as optimize_for_inference does: no fresh pages for each product
    before = load_average()
    peak_g, peak_kernel = measure_matmul_peak(torch.int8, torch.device("cpu"))
    peak = peak_g * 1e9
    print(
        f"{args.model}: {flops['total'] / 1e9:.2f} GFLOP an image executed, attention {flops['attention'] / 1e9:.2f} "
        f"({100 * flops['attention'] / flops['total']:.1f}%); int8 peak {peak / 1e9:.0f} GOP/s "
        f"({peak_kernel}), {torch.get_num_threads()} threads"
    )
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        rates, linear_rate = int8_matmul_rates(cfg, batch * tokens, args.rounds)
        print(
            f"  batch {batch:3d}: int8 matmuls at the Linear layers' shapes {min(rates) / peak:.0%}-"
            f"{max(rates) / peak:.0%} of the peak ({linear_rate / peak:.0%} together); a block's attention, and the "
            "ceiling with it (matmuls at the peak / at those rates):"
        )
        for name, block_s in attention_seconds(cfg, batch, tokens, args.rounds).items():
            at_peak = ceiling(batch * flops["total"], batch * matmuls, blocks * block_s, peak)
            at_rates = ceiling(batch * flops["total"], batch * matmuls * peak / linear_rate, blocks * block_s, peak)
            rate = batch * full_block / block_s / 1e9
            print(
                f"{'':15s}{name:17s} {block_s * 1e3:7.2f} ms ({rate:3.0f} GOP/s): ceiling {at_peak:4.0%} / "
                f"{at_rates:4.0%}"
            )
    for line in load_warnings(before, load_average(), torch.get_num_threads(), usable_cores()):
        print(line)


if __name__ == "__main__":
    main()
