"""Eager CPU inference of a model as built (fp32) or after ``model.to(torch.bfloat16)``: what vitkit's Dense layers
gain by running as oneDNN matmuls (vitkit.models.linear.infers_onednn), the MLP's GELU inside the first one.

    python benchmarks/inference_onednn.py                     # 3 min on 2 cores
    python benchmarks/inference_onednn.py --batch-sizes 1,8,64 --rounds 10

1. layers: each ViT-B/16 Dense shape at 197, 1,576 and 12,608 rows (batch 1, 8 and 64), fp32 and bf16, as
   ``F.linear`` (what an nn.Linear calls) against ``vitkit.models.linear.linear``; and the MLP's first layer with
   its tanh GELU, ``F.gelu(F.linear(...))`` against ``dense_gelu``, with each one's largest error against float64.
2. model: ViT-B/16 (random weights, a random head), eagerly under torch.no_grad, against the same model whose
   Dense layers and GELUs each carry a forward hook that does nothing: a module with hooks of its own is called
   as itself (nn.Linear's F.linear, nn.GELU's ATen kernel), so that copy runs what the layers ran before. The
   logits of both against the float64 model's.

Every ratio is the median of per-round ratios (the two taking turns in each round, one process) with its 95%
bootstrap interval. Speed needs a quiet machine: the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vitkit.bench import load_average, paired_ratio_stats, time_alternating
from vitkit.fast import tune_cpu_allocator
from vitkit.models import create_model
from vitkit.models.linear import dense_gelu, linear

SHAPES = ((768, 2304), (768, 768), (768, 3072), (3072, 768))  # qkv, proj, fc1, fc2: (in, out)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def taking_turns(fns: dict[str, Callable[[], Any]], rounds: int, calls: int) -> dict[str, list[float]]:
    """Seconds per call of each function, the functions taking turns within every round after one warm-up round
    (vitkit.bench.time_alternating), each timed over ``calls`` calls in a row."""

    def repeated(fn: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(calls):
                fn()

        return run

    steps = {name: repeated(fn) for name, fn in fns.items()}
    times = time_alternating(steps, rounds, 1, torch.device("cpu"), settle_s=0)  # no idling: calls of milliseconds
    return {name: [t / calls for t in seconds] for name, seconds in times.items()}


def ratio(times: dict[str, list[float]], slow: str, fast: str) -> str:
    st = paired_ratio_stats(times[slow], times[fast])
    return f"{st.median:.3f}x (95% CI {st.low:.3f}-{st.high:.3f})"


def ms(seconds: list[float]) -> str:
    return f"{sorted(seconds)[len(seconds) // 2] * 1e3:.3f} ms"


def layer_row(dt: torch.dtype, rows: int, d_in: int, d_out: int, rounds: int) -> str:
    """One layer shape's line: nn.Linear's call (and nn.GELU's, after the MLP's first layer) against vitkit's."""
    torch.manual_seed(0)
    x = torch.randn(rows, d_in).to(dt)
    fc1 = nn.Linear(d_in, d_out).to(dt).requires_grad_(False)
    with torch.no_grad():
        fc1.weight.copy_(torch.randn(d_out, d_in) / d_in**0.5), fc1.bias.copy_(torch.randn(d_out) * 0.1)
    w, b, act = fc1.weight, fc1.bias, nn.GELU(approximate="tanh")
    want = F.linear(x.double(), w.double(), b.double())
    if d_out == 3072:  # the MLP's first layer: its GELU after it
        fns = {"F.gelu(F.linear)": lambda: act(F.linear(x, w, b)), "vitkit": lambda: dense_gelu(fc1, act, x)}
        want, with_gelu = F.gelu(want, approximate="tanh"), "with its GELU, "
    else:
        fns, with_gelu = {"F.linear": lambda: F.linear(x, w, b), "vitkit": lambda: linear(x, w, b)}, ""
    err = {name: float((fn().double() - want).abs().max()) for name, fn in fns.items()}
    with torch.no_grad():
        times = taking_turns(fns, rounds, max(2, int(3e8 / (rows * d_in * d_out))))
    slow = next(iter(fns))
    return (
        f"  {rows:6d} rows {d_in:4d} -> {d_out:4d}: {with_gelu}{slow} {ms(times[slow])}, vitkit "
        f"{ms(times['vitkit'])}: {ratio(times, slow, 'vitkit')}; largest error against float64 {err[slow]:.2g} "
        f"and {err['vitkit']:.2g}"
    )


def hooked(model: nn.Module) -> nn.Module:
    """A copy whose Dense layers and GELUs have a forward hook doing nothing: each is called as itself."""
    copied = copy.deepcopy(model)
    for module in copied.modules():
        if isinstance(module, (nn.Linear, nn.GELU)):
            module.register_forward_hook(lambda *args: None)
    return copied


def model_row(model: nn.Module, plain: nn.Module, reference: nn.Module, batch: int, rounds: int) -> str:
    """One batch size's line: the model with its layers called as nn.Linear and nn.GELU against vitkit's."""
    dtype = next(model.parameters()).dtype
    torch.manual_seed(1)
    x = torch.randn(batch, 3, 224, 224)
    xd = x.to(dtype)
    with torch.no_grad():
        want = reference(x.double())
        err = {name: float((m(xd).double() - want).abs().mean()) for name, m in (("v", model), ("p", plain))}
        times = taking_turns({"nn.Linear": lambda: plain(xd), "vitkit": lambda: model(xd)}, rounds, 1)
    return (
        f"  batch {batch:3d}: nn.Linear's calls {ms(times['nn.Linear'])}, vitkit {ms(times['vitkit'])}: "
        f"{ratio(times, 'nn.Linear', 'vitkit')}; mean logit error against float64 {err['p']:.3g} and "
        f"{err['v']:.3g} (|logit| up to {float(want.abs().max()):.3g})"
    )


def whole_model(dtype: str, batch_sizes: list[int], rounds: int) -> None:
    torch.manual_seed(0)
    model = create_model("vit_b16", num_classes=1000).eval()
    nn.init.normal_(model.head.weight, std=0.02)  # the zero head would make every logit the bias
    reference = copy.deepcopy(model).double()
    model = model.to(DTYPES[dtype])
    plain = hooked(model)
    for batch in batch_sizes:
        print(model_row(model, plain, reference, batch, rounds), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="1,8", help="of ViT-B/16, whole model (default 1,8)")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--rounds", type=int, default=9, help="rounds taking turns (default 9)")
    p.add_argument("--no-layers", action="store_true", help="the whole model only")
    args = p.parse_args(argv)
    tune_cpu_allocator()  # as vitkit bench and optimize_for_inference run: freed memory kept for reuse
    before = load_average()
    for dtype in args.dtypes.split(","):
        print(f"{dtype}, {torch.get_num_threads()} threads, {args.rounds} rounds taking turns")
        if not args.no_layers:
            print(" ViT-B/16's Dense layers, nn.Linear's call against vitkit's")
            for rows in (197, 1576, 12608):
                for d_in, d_out in SHAPES:
                    print(layer_row(DTYPES[dtype], rows, d_in, d_out, args.rounds), flush=True)
        print(" ViT-B/16 inference, eager, the layers called as nn.Linear and nn.GELU against vitkit's")
        whole_model(dtype, [int(b) for b in args.batch_sizes.split(",")], args.rounds)
    print(f"load average {before} before, {load_average()} after, on {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
