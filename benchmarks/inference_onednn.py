"""Eager CPU inference through ``optimize_for_inference`` (fp32, or bf16 where native): what its packed oneDNN Dense
layers gain (vitkit.accel.cpu.PackedLinear: the weight packed once, the MLP's GELU applied inside the first one).

    python benchmarks/inference_onednn.py                     # 3 min on 2 cores
    python benchmarks/inference_onednn.py --batch-sizes 1,8,64 --rounds 10 --results benchmarks/results/onednn.md

1. layers: each ViT-B/16 Dense shape at 197, 1,576 and 12,608 rows (batch 1, 8 and 64), fp32 and bf16, as
   ``F.linear`` (what an nn.Linear calls) against ``PackedLinear``; and the MLP's first layer with its tanh GELU,
   ``F.gelu(F.linear(...))`` against ``PackedLinear(fc1, gelu)``, with each one's largest error against float64.
2. model: ViT-B/16 (random weights, a random head) through ``optimize_for_inference(model, precision,
   compile="none")``, against the same switch on a copy whose Dense layers and GELUs each carry a forward hook that
   does nothing: the switch leaves a layer with hooks of its own as it is (nn.Linear's F.linear, nn.GELU's
   kernel), so that copy differs in its Dense layers alone. The logits of both against the float64 model's.

Every ratio is the median of per-round ratios (the two taking turns in each round, one process) with its 95%
bootstrap interval. bf16 is left out where oneDNN multiplies none or it is not native (optimize_for_inference keeps
fp32 there). Speed needs a quiet machine: the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from harness import command_line, load_average, paired_ratio_stats, recorded, time_alternating
from torch import nn

from vitkit.accel.cpu import PackedLinear, can_pack_linears
from vitkit.accel.inference import optimize_for_inference, resolve_precision
from vitkit.accel.training import tune_cpu_allocator
from vitkit.models import create_model

SHAPES = ((768, 2304), (768, 768), (768, 3072), (3072, 768))  # qkv, proj, fc1, fc2: (in, out)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def taking_turns(fns: dict[str, Callable[[], Any]], rounds: int, calls: int) -> dict[str, list[float]]:
    """Seconds per call of each function, the functions taking turns within every round after one warm-up round
    (harness.time_alternating), each timed over ``calls`` calls in a row."""

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
    """One layer shape's line: nn.Linear's call (and nn.GELU's, after the MLP's first layer) against PackedLinear."""
    torch.manual_seed(0)
    x = torch.randn(rows, d_in).to(dt)
    fc1 = nn.Linear(d_in, d_out).to(dt).requires_grad_(False)
    with torch.no_grad():
        fc1.weight.copy_(torch.randn(d_out, d_in) / d_in**0.5), fc1.bias.copy_(torch.randn(d_out) * 0.1)
    w, b, act = fc1.weight, fc1.bias, nn.GELU(approximate="tanh")
    want = F.linear(x.double(), w.double(), b.double())
    if d_out == 3072:  # the MLP's first layer: its GELU after it
        packed = PackedLinear(fc1, act)
        fns = {"F.gelu(F.linear)": lambda: act(F.linear(x, w, b)), "vitkit": lambda: packed(x)}
        want, with_gelu = F.gelu(want, approximate="tanh"), "with its GELU, "
    else:
        packed = PackedLinear(fc1)
        fns, with_gelu = {"F.linear": lambda: F.linear(x, w, b), "vitkit": lambda: packed(x)}, ""
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
    """One batch size's line: the switch with the layers called as nn.Linear and nn.GELU against its packed ones."""
    dtype = torch.float32  # the switch's models take fp32 inputs, cast to their precision inside
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
    plain = optimize_for_inference(hooked(model), dtype, compile="none")
    model = optimize_for_inference(model, dtype, compile="none")
    for batch in batch_sizes:
        print(model_row(model, plain, reference, batch, rounds), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="1,8", help="of ViT-B/16, whole model (default 1,8)")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--rounds", type=int, default=9, help="rounds taking turns (default 9)")
    p.add_argument("--no-layers", action="store_true", help="the whole model only")
    p.add_argument("--results", help="also write what is printed as a result file (benchmarks/results/)")
    args = p.parse_args(argv)
    if unknown := sorted(set(args.dtypes.split(",")) - set(DTYPES)):
        p.error(f"--dtypes: {unknown} not among {', '.join(DTYPES)}")
    tune_cpu_allocator()  # as optimize_for_inference does: freed memory kept for reuse
    cpu = torch.device("cpu")
    with recorded(args.results, command_line(__file__, argv)):
        before = load_average()
        for dtype in args.dtypes.split(","):
            if not can_pack_linears(cpu, DTYPES[dtype]) or resolve_precision(dtype, cpu, warn=False) != dtype:
                print(
                    f"{dtype}: left out, not native here or no oneDNN matmul for it (optimize_for_inference keeps fp32)"
                )
                continue
            print(f"{dtype}, {torch.get_num_threads()} threads, {args.rounds} rounds taking turns")
            if not args.no_layers:
                print(" ViT-B/16's Dense layers, nn.Linear's call against PackedLinear's")
                for rows in (197, 1576, 12608):
                    for d_in, d_out in SHAPES:
                        print(layer_row(DTYPES[dtype], rows, d_in, d_out, args.rounds), flush=True)
            print(" ViT-B/16 through optimize_for_inference, eager, the layers as nn.Linear and nn.GELU against packed")
            whole_model(dtype, [int(b) for b in args.batch_sizes.split(",")], args.rounds)
        print(f"load average {before} before, {load_average()} after, on {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
