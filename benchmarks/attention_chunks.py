"""The written-out bf16 attention in chunks of (image, head) pairs (vitkit.models.attention.chunked_attention): what
the chunks buy on this CPU.

    python benchmarks/attention_chunks.py                  # about 4 min on 2 CPU cores
    python benchmarks/attention_chunks.py --parts 2 --rounds 15

1. a ViT-S/16 block's attention at batch 32 (192 pairs of 197 x 197, head_dim 64) from contiguous bf16 q, k and v,
   forward and backward: the written-out products unchunked (q scaled, q k^T, softmax, times v) against chunks of
   several sizes (``--chunks``; the size vitkit picks for this shape is marked);
2. a ViT-S/16 bf16-autocast training step at batch 32, as bench_vit.py's training rows run it (fused AdamW): the
   model as built against the same model with every block's ``attn.chunk_bytes = None`` (unchunked), and whether
   the two give the same logits and gradients, bit for bit;
3. ViT-B/16 bf16 inference, eager (``optimize_for_inference(..., "bf16", compile="none")``, the benchmark's bf16
   rows), at ``--batch``, the same two ways.

Every part takes turns round by round in this one process; a ratio is the median of the per-round ratios
(unchunked seconds over chunked) with its 95% interval. Speed needs a quiet machine: the load average is checked.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from vitkit.bench import load_average, load_warnings, make_step, paired_ratio_stats, time_alternating
from vitkit.bench.harness import BenchConfig, build_model
from vitkit.device import usable_cores
from vitkit.fast import optimize_for_inference, tune_cpu_allocator
from vitkit.models import create_model
from vitkit.models.attention import Attention, attention_chunk, chunked_attention

CPU = torch.device("cpu")


def unchunked(model: nn.Module) -> nn.Module:
    """model with every attention layer computing all its pairs at once (in place)."""
    for m in model.modules():
        if isinstance(m, Attention):
            m.chunk_bytes = None
    return model


def attention_core(chunks: list[int], rounds: int) -> list[str]:
    B, heads, n, hd = 32, 6, 197, 64
    scale = hd**-0.5
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, heads, n, hd, generator=g).bfloat16().requires_grad_() for _ in range(3))
    grad = torch.randn(B, heads, n, hd, generator=g).bfloat16()

    def run(attend: Callable[[], torch.Tensor]) -> Callable[[], Any]:
        def step() -> None:
            q.grad = k.grad = v.grad = None
            attend().backward(grad)

        return step

    steps = {"unchunked": run(lambda: torch.softmax((q * scale) @ k.transpose(-2, -1), -1) @ v)}
    for c in chunks:
        steps[str(c)] = run(lambda c=c: chunked_attention(q, k, v, scale, c))
    times = time_alternating(steps, rounds, 1, CPU)
    picked = attention_chunk(q, k)
    lines = [f"1. a ViT-S/16 block's attention, batch 32 ({B * heads} pairs of {n} x {n}), forward and backward, bf16"]
    lines.append(f"  {'unchunked':24s}{statistics.median(times['unchunked']) * 1e3:7.2f} ms")
    for c in chunks:
        mark = " (vitkit's)" if c == picked else ""
        ratio = paired_ratio_stats(times["unchunked"], times[str(c)])
        lines.append(f"  chunks of {c:3d}{mark:11s}{statistics.median(times[str(c)]) * 1e3:7.2f} ms   {ratio}")
    return lines


def training_step(rounds: int) -> list[str]:
    cfg = BenchConfig(
        model="vit_s16", batch_size=32, img_size=224, dtype="bf16-autocast", mode="train", device="cpu", compile="none"
    )
    models = {}
    for name in ("chunked", "unchunked"):
        torch.manual_seed(0)
        models[name] = build_model(cfg, CPU)
    unchunked(models["unchunked"])
    torch.manual_seed(1)
    x, y = torch.randn(32, 3, 224, 224), torch.randint(0, 1000, (32,))
    outs = {}
    for name, model in models.items():
        with torch.autocast("cpu", torch.bfloat16):
            logits = model(x)
        nn.functional.cross_entropy(logits.float(), y).backward()
        outs[name] = [logits.detach(), *(p.grad for p in model.parameters())]
        model.zero_grad(set_to_none=True)
    same = all(torch.equal(a, b) for a, b in zip(outs["chunked"], outs["unchunked"]))
    steps = {name: make_step(model, cfg, x, y, CPU) for name, model in models.items()}
    times = time_alternating(steps, rounds, 1, CPU)
    return [
        "2. a ViT-S/16 bf16-autocast training step, batch 32 (logits and every gradient the same bits: "
        f"{'yes' if same else 'NO'})",
        *(f"  {name:10s} {statistics.median(t):.3f} s" for name, t in times.items()),
        f"  chunked over unchunked: {paired_ratio_stats(times['unchunked'], times['chunked'])}",
    ]


def inference(batch: int, rounds: int) -> list[str]:
    torch.manual_seed(0)
    fast = optimize_for_inference(create_model("vit_b16", num_classes=1000), "bf16", compile="none")
    models = {"chunked": fast, "unchunked": unchunked(copy.deepcopy(fast))}
    x = torch.rand(batch, 3, 224, 224) * 2 - 1
    outs = {name: m(x) for name, m in models.items()}
    same = torch.equal(outs["chunked"], outs["unchunked"])
    steps: dict[str, Callable[[], Any]] = {name: functools.partial(m, x) for name, m in models.items()}
    times = time_alternating(steps, rounds, 1, CPU)
    return [
        f"3. ViT-B/16 bf16 inference, eager, batch {batch} (logits the same bits: {'yes' if same else 'NO'})",
        *(f"  {name:10s} {statistics.median(t) * 1e3:.1f} ms" for name, t in times.items()),
        f"  chunked over unchunked: {paired_ratio_stats(times['unchunked'], times['chunked'])}",
    ]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="1,2,3", help="which parts to run (default 1,2,3)")
    p.add_argument("--chunks", default="8,16,27,48,96", help="part 1's chunk sizes, pairs (default 8,16,27,48,96)")
    p.add_argument("--batch", type=int, default=8, help="part 3's batch size (default 8)")
    p.add_argument("--rounds", type=int, default=10, help="timed rounds of each part (default 10)")
    args = p.parse_args(argv)
    torch.set_num_threads(usable_cores())
    tune_cpu_allocator()  # as vitkit bench, train and optimize_for_inference run
    before = load_average()
    parts = {p.strip() for p in args.parts.split(",")}
    print(f"bf16 attention in chunks, {torch.get_num_threads()} threads", flush=True)
    if "1" in parts:
        print("\n".join(attention_core([int(c) for c in args.chunks.split(",")], args.rounds)), flush=True)
    if "2" in parts:
        print("\n".join(training_step(args.rounds)), flush=True)
    if "3" in parts:
        print("\n".join(inference(args.batch, args.rounds)), flush=True)
    for line in load_warnings(before, load_average(), torch.get_num_threads(), usable_cores()):
        print(line)


if __name__ == "__main__":
    main()
