"""Which optimizer should ``vitkit finetune`` use for a small source? The embedded digits, 10% of the labels.

Two sources, each the shipped config at seed 0 (trained here, one thread): the digits run (supervised, all
1,437 training labels) and the mpp_digits run (masked patch prediction, no labels). Each is fine-tuned as
``vitkit finetune SOURCE --data digits data.train_fraction=0.1 optim.name=NAME run.seed=S`` would: the recipe
of vitkit.train.recipe (its batch, length, warmup and preprocessing for 143 training images and a small
source: 458 steps of 32, 4 an epoch, a warmup of 23, cosine decay) with the paper's
SGD (momentum 0.9, lr 0.01, no weight decay, clip 1) or the digits config's AdamW (lr 1.5e-3, weight decay
0.05, label smoothing 0.1, clip 1); seeds 0, 1, 2; scored on the 360 held-out images.

    python benchmarks/finetune_digits.py            # about 2 minutes on 2 CPU cores (4 on shared ones)
    python benchmarks/finetune_digits.py --seeds 1  # a quick look

Prints held-out top-1 (mean +- std over seeds, and each seed) per source and optimizer, and the optimizer
the recipe picks for these sources; --json writes the numbers too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from vitkit.checkpoint import read_native
from vitkit.train import load_config, train
from vitkit.train.recipe import OPTIMIZER_RECIPES, finetune_config

COMMON = ["run.progress=false", "run.plots=false", "run.threads=1", "run.eval_every=0", "run.log_every=0"]
SOURCES = ("digits", "mpp_digits")


def mean_std(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.mean(values):.2f} +- {100 * std:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--json", help="also write the numbers here")
    args = p.parse_args()
    results: dict[str, dict[str, list[float]]] = {}
    picked, resolved = {}, ""
    with tempfile.TemporaryDirectory() as tmp:
        for source in SOURCES:
            run = train(load_config(source, [f"run.out_dir={tmp}", "run.seed=0", *COMMON]))
            _, state, _ = read_native(run.run_dir)
            params = sum(t.numel() for k, t in state.items() if not k.startswith("mpp."))
            auto = finetune_config(str(run.run_dir), "digits", ["data.train_fraction=0.1"])
            picked[source] = f"{auto.optim.name} ({params:,} params)"
            s, o = auto.schedule, auto.optim
            resolved = f"{s.steps} steps of {o.batch_size}, warmup {s.warmup_steps}, {s.decay}"
            for name in OPTIMIZER_RECIPES:
                row = results.setdefault(f"{source} / {name}", [])
                for seed in range(args.seeds):
                    overrides = ["data.train_fraction=0.1", f"optim.name={name}", f"run.seed={seed}"]
                    cfg = finetune_config(str(run.run_dir), "digits", [*overrides, f"run.out_dir={tmp}", *COMMON])
                    row.append(train(cfg).metrics["eval_top1"])
                    print(f"{source} {name} seed {seed}: {100 * row[-1]:.2f}%", flush=True)
    print()
    print(f"digits, 143 of 1,437 training labels (10%), 360 held-out images, {resolved}, {args.seeds} seeds")
    print("| source / optimizer | held-out top-1 % (mean +- std) | per seed |")
    print("|---|---|---|")
    for key, row in results.items():
        print(f"| {key} | {mean_std(row)} | {', '.join(f'{100 * v:.2f}' for v in row)} |")
    print("the recipe picks: " + "; ".join(f"{k}: {v}" for k, v in picked.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "picked": picked}, indent=2) + "\n")


if __name__ == "__main__":
    main()
