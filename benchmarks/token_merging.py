"""Token merging (ToMe, vitkit.accel.tome; ``create_model``/``load_model``'s ``token_merge``): the speed it buys
and the accuracy it costs.

    python benchmarks/token_merging.py                      # about 3 min on 2 CPU cores
    python benchmarks/token_merging.py --run runs/p2/digits # a trained run of many tokens instead of training one

1. accuracy: a ViT trained on the embedded digits with 2x2-pixel patches, 64 patch tokens and the class token
   (the main job's 4x4 patches give 16 tokens, too few for merging to matter), or the run given. For each r
   (tokens merged in each block): held-out top-1, agreement with r = 0, and that model's img/s on the held-out
   set, every r taking turns in each round.
2. speed: ViT-B/16 (197 tokens, random weights) inference at one batch size, fp32 (or --precision bf16), every r
   taking turns, each through ``optimize_for_inference(model, precision, compile="none")``: img/s, GFLOP
   executed per image, and the speed-up over r = 0 (median of per-round paired ratios, 95% interval). r = 0 runs
   the class-token-only last block (vitkit.accel.first_token), which a merging model does not.

Merging is off by default (token_merge=0); it changes the function, so its speed is no lead at equal
accuracy: the table is the trade to choose from. Speed needs a quiet machine: the load average is checked.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from harness import command_line, load_average, load_warnings, paired_ratio_stats, recorded, time_alternating
from torch import nn

from vitkit.accel.first_token import applies as first_token_applies
from vitkit.accel.inference import optimize_for_inference
from vitkit.accel.tome import merged_away
from vitkit.device import usable_cores
from vitkit.hub import create_model
from vitkit.models import ViTConfig
from vitkit.models.flops import vit_flops


def infer(model: nn.Module, x: torch.Tensor) -> Callable[[], Any]:
    def step() -> Any:
        with torch.no_grad():
            return model(x)

    return step


def timed_rows(models: dict[int, nn.Module], x: torch.Tensor, rounds: int) -> dict[int, list[float]]:
    """Seconds per call of each model on x, all taking turns in every round."""
    times = time_alternating({str(r): infer(m, x) for r, m in models.items()}, rounds, 1, torch.device("cpu"))
    return {int(r): t for r, t in times.items()}


def speed_lines(models: dict[int, nn.Module], times: dict[int, list[float]], batch: int) -> list[str]:
    lines = [f"{'r':>3} {'tokens':>22} {'GFLOP/img':>9} {'img/s':>8}   speed-up over r=0 (95% interval)"]
    for r, model in models.items():
        cfg = model.config
        merge = getattr(model, "token_merge", 0)
        flops = vit_flops(cfg, first_token=first_token_applies(model), token_merge=merge)["total"] / 1e9
        tokens = token_counts(cfg, merge)
        speed = "" if r == 0 else str(paired_ratio_stats(times[0], times[r]))
        lines.append(f"{r:>3} {tokens:>22} {flops:9.2f} {batch / statistics.median(times[r]):8.1f}   {speed}")
    return lines


def token_counts(cfg: ViTConfig, r: int) -> str:
    """The tokens the first and the last block receive with r merged in each block, as 'first -> last'."""
    first = last = cfg.grid()[0] * cfg.grid()[1] + (cfg.classifier == "token")
    for _ in range(cfg.depth - 1):
        last -= merged_away(last, r)
    return f"{first} -> {last}"


def trained_run(run: Path | None, workdir: Path, epochs: int) -> tuple[Path, str]:
    """A digits run with 2x2 patches: the given one, or one trained here."""
    from vitkit.train import load_config, train

    if run is not None:
        return run, f"run {run}"
    threads = torch.get_num_threads()
    overrides = ["model.patch_size=2", f"schedule.epochs={epochs}", "run.progress=false", "run.plots=false"]
    cfg = load_config("digits", [*overrides, "run.eval_every=0", f"run.out_dir={workdir}"])
    print(f"training: vitkit train {' '.join(overrides)}", flush=True)
    result = train(cfg)
    torch.set_num_threads(threads)
    return result.run_dir, f"digits, 2x2 patches, trained here ({epochs} epochs, {result.wall_s:.0f} s)"


def accuracy(run: Path, rs: list[int], rounds: int) -> list[str]:
    from vitkit.data import build_datasets
    from vitkit.hub import load_model
    from vitkit.train import load_config

    models = {r: load_model(run, token_merge=r).eval() for r in rs}
    _, held_out, _ = build_datasets(load_config("digits").data)
    x, y = held_out.images, held_out.labels
    with torch.no_grad():
        preds = {r: m(x).argmax(-1) for r, m in models.items()}
    times = timed_rows(models, x, rounds)
    lines = [f"{'r':>3} {'tokens':>12} {'top-1':>7} {'agrees with r=0':>16} {'img/s':>8}   speed-up over r=0"]
    for r in rs:
        top1 = float((preds[r] == y).float().mean())
        agree = float((preds[r] == preds[0]).float().mean())
        speed = "" if r == 0 else str(paired_ratio_stats(times[0], times[r]))
        tokens = token_counts(models[r].config, r)
        ips = len(x) / statistics.median(times[r])
        lines.append(f"{r:>3} {tokens:>12} {top1:7.2%} {agree:16.2%} {ips:8.0f}   {speed}")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", type=Path, help="a trained run of many tokens (default: train digits with 2x2 patches)")
    p.add_argument("--epochs", type=int, default=30, help="epochs of the run trained here (default 30)")
    p.add_argument("--digits-r", default="0,4,8,16,32", help="r values on the digits run (default 0,4,8,16,32)")
    p.add_argument("--vit-r", default="0,4,8,13,16", help="r values on ViT-B/16 (default 0,4,8,13,16)")
    p.add_argument("--batch", type=int, default=8, help="ViT-B/16 batch size (default 8)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="ViT-B/16 precision (default fp32)")
    p.add_argument("--rounds", type=int, default=8, help="timed rounds (default 8)")
    p.add_argument("--results", help="also write what is printed as a result file (benchmarks/results/)")
    args = p.parse_args(argv)
    torch.set_num_threads(usable_cores())
    with recorded(args.results, command_line(__file__, argv)):
        run(args)


def run(args: argparse.Namespace) -> None:
    """Both parts of the module docstring, printed as they finish."""
    before = load_average()
    with tempfile.TemporaryDirectory() as workdir:
        run_dir, label = trained_run(args.run, Path(workdir), args.epochs)
        print(f"\n1. accuracy and speed by r on {label} (360 held-out images a call)")
        print("\n".join(accuracy(run_dir, [int(v) for v in args.digits_r.split(",")], args.rounds)), flush=True)

    torch.manual_seed(0)
    base = create_model("vit_b16", num_classes=1000)
    nn.init.normal_(base.head.weight, std=0.02)
    models = {}
    for r in (int(v) for v in args.vit_r.split(",")):
        model = create_model("vit_b16", num_classes=1000, token_merge=r)
        model.load_state_dict(base.state_dict())
        models[r] = optimize_for_inference(model, args.precision, compile="none")
    x = torch.rand(args.batch, 3, 224, 224) * 2 - 1
    times = timed_rows(models, x, args.rounds)
    print(f"\n2. ViT-B/16 inference by r, batch {args.batch}, {args.precision}, {torch.get_num_threads()} threads")
    print("\n".join(speed_lines({r: m.model for r, m in models.items()}, times, args.batch)))
    for line in load_warnings(before, load_average(), torch.get_num_threads(), usable_cores()):
        print(line)


if __name__ == "__main__":
    main()
