"""Does masked patch prediction help where labels are scarce? The embedded digits, 10% of the training labels.

For each seed: pretrain the digits ViT with MPP on all 1,437 training images without labels (the mpp_digits
config), then fine-tune it on a stratified 10% of the training images with their labels (143 images, the same
subset for every seed: data.train_fraction=0.1, data.split_seed=0) exactly as
``vitkit finetune RUN --data digits data.train_fraction=0.1`` does (vitkit.train.recipe: for this small source,
AdamW at the digits config's settings, 115 steps of 128 images, a 5% warmup, cosine decay); train the same
model from scratch on the same 143 images with the same resolved recipe and steps. Both are scored on the 360
held-out images. The frozen features are also compared by few-shot linear accuracy (ridge regression on the
pooled representation, paper sec 4.1): MPP-pretrained against randomly initialised.

    python benchmarks/mpp_digits.py                 # 3 seeds, about 3 minutes on 2 CPU cores
    python benchmarks/mpp_digits.py --seeds 1 --pretrain-steps 200   # a quick look

Prints a table of mean +- std over seeds and the wall time of each part; --json writes the numbers too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vitkit import load_model
from vitkit.data import build_datasets
from vitkit.evaluate import fewshot
from vitkit.train import build_model, config_from_dict, load_config, train
from vitkit.train.recipe import finetune_config

COMMON = ["run.progress=false", "run.plots=false", "run.threads=1", "run.eval_every=0", "run.log_every=0"]


def mean_std(values: list[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.mean(values):.2f} +- {100 * std:.2f}"


def run(args: argparse.Namespace, out: Path) -> tuple[dict[str, list[float]], str]:
    results: dict[str, list[float]] = {
        k: [] for k in ("mpp_acc", "mpp_s", "ft", "ft_s", "scratch", "scratch_s", "fs_mpp", "fs_random")
    }
    steps = ""
    for seed in range(args.seeds):
        names = [f"run.seed={seed}", f"run.out_dir={out}", f"run.name=mpp-{seed}"]
        pre = train(load_config("mpp_digits", [*names, f"schedule.steps={args.pretrain_steps}", *COMMON]))
        results["mpp_acc"].append(pre.metrics["eval_mpp_acc"])
        results["mpp_s"].append(pre.wall_s)
        # the road of `vitkit finetune RUN --data digits data.train_fraction=0.1 run.seed=SEED`
        overrides = ["data.train_fraction=0.1", f"run.seed={seed}", f"run.out_dir={out}", *COMMON]
        ft_cfg = finetune_config(str(pre.run_dir), "digits", overrides)
        ft = train(ft_cfg)
        results["ft"].append(ft.metrics["eval_top1"])
        results["ft_s"].append(ft.wall_s)
        # from scratch: the same resolved recipe, data and steps; the digits config's model, randomly initialised
        doc = ft_cfg.to_dict()
        doc["model"] = load_config("digits").model.to_dict()
        doc["run"].update(init_from=None, name=f"scratch-{seed}")
        scratch = train(config_from_dict(doc))
        results["scratch"].append(scratch.metrics["eval_top1"])
        results["scratch_s"].append(scratch.wall_s)
        steps = f"{ft.step} steps of {ft_cfg.optim.batch_size}"
        # frozen features: few-shot linear accuracy of the MPP-pretrained ViT and of the same ViT at initialisation
        cfg = load_config("digits", [f"run.seed={seed}"])
        train_set, test_set, info = build_datasets(cfg.data)
        torch.manual_seed(seed)
        models = {"fs_mpp": load_model(pre.run_dir), "fs_random": build_model(cfg, info)}
        for key, model in models.items():
            shots = fewshot(model.eval(), train_set, test_set, [args.shots], seeds=3, num_classes=info.num_classes)
            results[key].append(shots.mean(args.shots))
        pct = {k: f"{100 * v[-1]:.2f}%" for k, v in results.items()}
        print(
            f"seed {seed}: MPP colour acc {pct['mpp_acc']} | fine-tuned {pct['ft']} vs scratch {pct['scratch']} | "
            f"{args.shots}-shot MPP {pct['fs_mpp']} vs random {pct['fs_random']}",
            flush=True,
        )
    return results, steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--pretrain-steps", type=int, default=1100, help="MPP steps of 64 images (mpp_digits: 1100)")
    p.add_argument("--shots", type=int, default=10, help="examples per class for the few-shot comparison")
    p.add_argument("--json", help="also write the numbers here")
    args = p.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        r, steps = run(args, Path(tmp))
    total = time.perf_counter() - t0
    seeds = args.seeds
    print()
    print(f"digits, 143 of 1,437 training labels (10%), 360 held-out images, {seeds} seeds (mean +- std)")
    print("| model | held-out top-1 (%) | wall time per run (s) |")
    print("|---|---|---|")
    pre_s, ft_s, sc_s = (statistics.mean(r[k]) for k in ("mpp_s", "ft_s", "scratch_s"))
    print(
        f"| MPP pretrained ({args.pretrain_steps} steps, no labels), fine-tuned {steps} "
        f"| {mean_std(r['ft'])} | {pre_s:.1f} + {ft_s:.1f} |"
    )
    print(f"| from scratch, {steps} | {mean_std(r['scratch'])} | {sc_s:.1f} |")
    print(f"| {args.shots}-shot linear, frozen MPP features | {mean_std(r['fs_mpp'])} | |")
    print(f"| {args.shots}-shot linear, frozen random-init features | {mean_std(r['fs_random'])} | |")
    for key, what in (("ft", "fine-tuned"), ("scratch", "from scratch")):
        print(f"{what} per seed: {', '.join(f'{100 * v:.2f}' for v in r[key])}")
    print(f"MPP held-out colour accuracy (3-bit grey, 8 classes): {mean_std(r['mpp_acc'])}%")
    print(f"total wall time {total:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": r, "total_s": total}, indent=2) + "\n")


if __name__ == "__main__":
    main()
