"""vitkit's int8 against torchao's on the same model: the int8 switch alone, everything else alike.

    python benchmarks/int8_torchao.py --digits-run runs/digits   # ViT-B/16 at batch 1, 8 and 64: 6 min (8 with timm)
    PYTHONPATH=<timm> python benchmarks/int8_torchao.py --batch-sizes 8 --rounds 5   # with timm's row

torchao (``pip install torchao``, in the dev extra; no dependency of vitkit itself) is PyTorch's own
quantisation library. Its dynamic int8 recipe, ``quantize_(model, Int8DynamicActivationInt8WeightConfig())``,
quantises what ``optimize_for_inference(model, "int8")`` quantises: every Linear's weight to int8 per output channel
and its input to int8 per token at each call, the products summed in int32. Each switch is applied to a copy of the
same fp32 model (random weights, a random head) and both are compiled alike, with accel.inference.compile_for_inference
(torch.compile with inductor freezing, what vitkit's int8 runs by default; ``--compile none`` runs both eagerly).
What each switch does beyond the Linear layers is its own: vitkit's int8 model computes attention written out in
bf16 where bf16 matmuls are native, torchao's keeps the model's fp32 attention. Where timm is importable (as
for speed_targets.py), a third row is torchao's int8 on timm's ViT holding the same weights, compiled alike: what a
timm user gets from torchao. They are timed taking turns in one process; printed for each batch size: each one's median
milliseconds a forward pass, vitkit's speed-up over each other row (the median of per-round paired ratios, with its
95% bootstrap interval), and each one's logit error against the fp32 model on the timed inputs. With
``--digits-run``, vitkit's and torchao's on a trained model: a ``vitkit train`` run of the digits config and its 360
held-out images. Speed needs a quiet machine: the load average is checked.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import importlib.util
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from harness import (
    BenchConfig,
    batched_logits,
    build_model,
    load_average,
    load_warnings,
    logit_agreement,
    paired_ratio_stats,
    time_alternating,
    timm_peer,
)
from torch import nn

from vitkit.accel.inference import compile_for_inference, optimize_for_inference
from vitkit.accel.int8 import int8_kernel
from vitkit.accel.training import tune_cpu_allocator
from vitkit.device import usable_cores

SWITCHES = ("vitkit", "torchao")
TIMM = "timm+torchao"  # torchao's int8 on timm's ViT, where timm is importable


def torchao_int8(model: nn.Module) -> nn.Module:
    """A frozen copy of model whose Linear layers are torchao's dynamic int8 (int8 weights per output channel, int8
    activations per token); the model is untouched."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    quantised = copy.deepcopy(model).eval().requires_grad_(False)
    quantize_(quantised, Int8DynamicActivationInt8WeightConfig())
    return quantised


def torchao_switch(model: nn.Module, compile_mode: str) -> nn.Module | Callable[[torch.Tensor], torch.Tensor]:
    """torchao's int8 copy of model, compiled as vitkit's int8 compiles (or eager with compile_mode "none")."""
    quantised = torchao_int8(model)
    return quantised if compile_mode == "none" else compile_for_inference(quantised, compile_mode)


def switches(model: nn.Module, compile_mode: str) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The model through each int8 switch, compiled alike (or both eager with compile_mode "none")."""
    return {
        "vitkit": optimize_for_inference(model, "int8", compile=compile_mode),
        "torchao": torchao_switch(model, compile_mode),
    }


def timm_model(model: nn.Module) -> nn.Module | None:
    """timm's ViT holding model's weights (harness.timm_peer); None where timm is not importable."""
    if importlib.util.find_spec("timm") is None:
        return None
    return timm_peer(model).eval()


def error_line(name: str, agreement: dict[str, float]) -> str:
    a = agreement
    return (
        f"{name:<12} top-1 agreement {a['top1_agreement']:.2%} of {a['n']}, logit error mean {a['mean_err']:.3g} "
        f"max {a['max_err']:.3g} (|fp32 logit| up to {a['max_abs_logit']:.3g})"
    )


def accuracy(model: nn.Module, images: torch.Tensor, compile_mode: str) -> list[str]:
    """Each switch's logits against the fp32 model's on images."""
    want = batched_logits(model.eval(), images)
    runs = switches(model, compile_mode)
    return [error_line(name, logit_agreement(want, batched_logits(fn, images))) for name, fn in runs.items()]


def digits(run_dir: Path) -> tuple[nn.Module, torch.Tensor]:
    """A digits run's model and the digits config's 360 held-out images."""
    from vitkit.data import build_datasets
    from vitkit.hub import load_model
    from vitkit.train import load_config

    _, held_out, _ = build_datasets(load_config("digits").data)
    return load_model(run_dir), held_out.images


def compare(model: nn.Module, batch: int, rounds: int, compile_mode: str) -> list[str]:
    """One batch size: the switches (and timm's model under torchao's, where timm is importable) timed taking turns,
    then their logit errors on the timed inputs."""
    size = model.config.img_size
    size = size if isinstance(size, int) else size[0]
    torch.manual_seed(1)
    x = torch.randn(batch, model.config.in_chans, size, size)
    runs = switches(model, compile_mode)
    peer = timm_model(model)
    if peer is not None:
        runs[TIMM] = torchao_switch(peer, compile_mode)

    def step(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], Any]:
        def call() -> Any:
            with torch.no_grad():
                return fn(x)

        return call

    times = time_alternating({k: step(fn) for k, fn in runs.items()}, rounds, warmup=1, device=torch.device("cpu"))
    want = batched_logits(model.eval(), x, batch)
    ms = ", ".join(f"{k} {statistics.median(t) * 1e3:.1f} ms" for k, t in times.items())
    ratios = [f"vitkit / {k} {paired_ratio_stats(t, times['vitkit'])}" for k, t in times.items() if k != "vitkit"]
    errors = {k: logit_agreement(want, batched_logits(fn, x, batch)) for k, fn in runs.items()}  # the shape timed
    return [
        f"  batch {batch:3d}: {ms}",
        *(f"             {line}" for line in ratios),
        *(f"             {error_line(k, e)}" for k, e in errors.items()),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="vit_b16")
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--compile", default="default", choices=("none", "default"))
    parser.add_argument("--digits-run", type=Path, help="a vitkit train run of the digits config, for the accuracy")
    args = parser.parse_args(argv)
    if not args.model.startswith("vit_"):
        parser.exit(2, f"--model {args.model}: expected a ViT (vit_...)\n")
    try:
        version = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        parser.exit(2, "torchao is not installed: pip install torchao (make test installs it too)\n")
    if int8_kernel() != "onednn":
        parser.exit(2, "this CPU has no VNNI: vitkit's int8 runs fbgemm's kernels here, not timed by this script\n")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    threads = usable_cores()
    torch.set_num_threads(threads)
    tune_cpu_allocator()  # as optimize_for_inference does, before anything is timed: it is process-wide
    model = build_model(BenchConfig(model=args.model, device="cpu"), torch.device("cpu")).eval()
    print(
        f"int8 on {args.model}, vitkit against torchao {version} (Int8DynamicActivationInt8WeightConfig), "
        f"{threads} threads, compile {args.compile}, {args.rounds} rounds taking turns"
    )
    before = load_average()
    for batch in batches:
        print("\n".join(compare(model, batch, args.rounds, args.compile)), flush=True)
    after = load_average()
    if args.digits_run is not None:
        trained, images = digits(args.digits_run)
        print(f"accuracy against fp32 on {len(images)} held-out digits, run {args.digits_run}:")
        print("\n".join(f"  {line}" for line in accuracy(trained, images, args.compile)))
    for warning in load_warnings(before, after, threads):
        print(f"WARNING: {warning}", file=sys.stderr)


if __name__ == "__main__":
    main()
