"""One end-to-end fine-tune on a GPU: ViT-B/16 from an official-format checkpoint, on an image folder of JPEGs.

    python benchmarks/finetune_gpu.py --out /tmp/ft                 # ~4,000 images, 300 steps of 128, bf16, compiled
    python benchmarks/finetune_gpu.py --out /tmp/ft --steps 20 --images 800 --workers 4    # a quick look
    python benchmarks/finetune_gpu.py --out /tmp/ft --sample-stacks     # and where the main thread's time goes

1. The data: ``--images`` JPEGs (quality 90, 320 px) of vitkit's procedural shapes (10 classes, see
   vitkit.data.procedural) written as ``root/<class>/<n>.jpg``, so that the run decodes, crops and flips JPEGs as
   an ImageNet run does.
2. The checkpoint: a ViT-B/16 written in the official .npz layout by vitkit_to_official. No released file can be
   downloaded where this runs, so its weights are random (``--checkpoint`` takes a real one).
3. The input pipeline alone: the run's own training set through a DataLoader with ``--workers`` processes
   (decode, inception crop, flip, normalise; pinned memory), images/s with no model.
4. The run: ``vitkit finetune CKPT --data ROOT`` with run.amp=bf16 and run.compile=true, the rest the recipe's
   (SGD, momentum 0.9, lr 0.01, clip 1, warmup and cosine decay), evaluated on the held-out fifth.

Prints the loader's images/s, the run's training images/s (median of its log records after the first, which
holds the compilation), the MFU against the GPU's dense bf16 datasheet peak (harness.dense_bf16_peak), and
the loss curve; the run directory (metrics.jsonl, loss.png, the checkpoint) stays under --out.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch
from harness import dense_bf16_peak
from PIL import Image
from torch.utils.data import DataLoader

from vitkit.checkpoint.official import vitkit_to_official
from vitkit.data import build_datasets
from vitkit.data.procedural import CLASS_NAMES, render_shape_image
from vitkit.hub import load_model
from vitkit.models import create_model
from vitkit.models.flops import model_flops
from vitkit.train import train
from vitkit.train.metrics import MetricsLog
from vitkit.train.recipe import finetune_config

SIZE = 320


def _write_jpeg(args: tuple[Path, int]) -> None:
    root, index = args
    pixels, label = render_shape_image(0, 0, index, size=SIZE)
    Image.fromarray(pixels).save(root / CLASS_NAMES[label] / f"{index:06d}.jpg", quality=90)


def write_folder(root: Path, images: int, workers: int) -> Path:
    for name in CLASS_NAMES:
        (root / name).mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(_write_jpeg, [(root, i) for i in range(images)], chunksize=64))
    return root


def write_checkpoint(path: Path) -> Path:
    """A ViT-B/16 with 1,000 classes in the official .npz layout (random weights, the head too)."""
    torch.manual_seed(0)
    model = create_model("vit_b16", num_classes=1000)
    torch.nn.init.normal_(model.head.weight, std=0.02)
    np.savez(path, **vitkit_to_official(model))
    return path


def loader_rate(dataset: torch.utils.data.Dataset, batch: int, workers: int, batches: int) -> float:
    """Images/s of the training set through a DataLoader alone: up to ``batches`` after two warm-up batches."""
    loader = DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers, pin_memory=True, drop_last=True)
    batches = min(batches, len(loader) - 2)
    it = iter(loader)
    for _ in range(2):
        next(it)
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * batch / (time.perf_counter() - start)


def outside_steps(records: list[dict], batch: int) -> float:
    """Seconds between consecutive train records not spent in training steps: a record's images/s counts its steps
    alone, its time the run's wall clock, so the difference is the evaluations and saves between the two."""
    return sum(
        (b["time"] - a["time"]) - (b["step"] - a["step"]) * batch / b["images_per_s"]
        for a, b in zip(records, records[1:])
    )


class StackSampler:
    """Where the main thread's wall time goes during training: a second thread reads the main thread's stack every
    ``interval`` seconds and counts it by its innermost vitkit line and its innermost frame, once the run is at step
    ``from_step`` or later (past compilation); the GPU's utilisation (NVML, the share of time a kernel ran) is read
    every 20th sample."""

    def __init__(self, interval: float = 0.002, from_step: int = 20) -> None:
        self.interval, self.from_step = interval, from_step
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.utilisation: list[int] = []
        self.read_utilisation = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        main, n = threading.main_thread().ident or 0, 0
        while not self._stop.wait(self.interval):
            sample = self._sample(main)  # its frame objects die with its call, before the wait
            if sample is not None:
                self.counts[sample] += 1
                n += 1
                if n % 20 == 0 and self.read_utilisation:
                    try:
                        self.utilisation.append(torch.cuda.utilization())
                    except (ModuleNotFoundError, RuntimeError):  # NVML (nvidia-ml-py) missing or refused
                        self.read_utilisation = False

    def _sample(self, main: int) -> tuple[str, str] | None:
        """(innermost vitkit line, innermost frame) of the main thread, or None before ``from_step``. A frame object
        held keeps every local of its function alive after it returns: none may outlive this call, or a tensor
        freed in one training step and not in another breaks CUDA graphs (run.compile=reduce-overhead), whose
        replays rely on each step's tensors dying where they died when the graph was recorded."""
        f = sys._current_frames().get(main)  # noqa: SLF001 - the sampler's whole purpose
        where, inner, step = "", "", -1
        if f is not None:
            inner = f"{Path(f.f_code.co_filename).name}:{f.f_code.co_name}"
        while f is not None:
            name = f.f_code.co_filename
            if not where and "/vitkit/" in name and "benchmarks" not in name:
                where = f"{name.split('/vitkit/')[-1]}:{f.f_lineno} {f.f_code.co_name}"
            if f.f_code.co_name == "train_one_epoch" and step < 0:
                step = getattr(f.f_locals.get("self"), "step", -1)
            f = f.f_back
        return (where, inner) if step >= self.from_step else None

    def report(self, top: int = 15) -> str:
        total = sum(self.counts.values())
        if not total:
            return "stack samples: none (the run ended before the sampled steps)"
        gpu = f"{statistics.mean(self.utilisation):.0f}%" if self.utilisation else "n/a"
        lines = [f"main thread, {total} samples from step {self.from_step}; GPU busy (NVML) {gpu} of that time"]
        for (where, inner), count in self.counts.most_common(top):
            lines.append(f"{count / total:6.1%}  {where or '(outside vitkit)'}  <- {inner}")
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--images", type=int, default=4000)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--workers", type=int, default=14, help="DataLoader processes (default 14 of 16 cores)")
    p.add_argument("--checkpoint", type=Path, help="an official .npz (default: a random ViT-B/16 written here)")
    p.add_argument("--compile", default="true", help='run.compile: true, or a mode ("reduce-overhead": CUDA graphs)')
    p.add_argument("--sample-stacks", action="store_true", help="print where the training loop's time goes")
    p.add_argument("--peak-tflops", type=float, help="dense bf16 peak for MFU (default: the GPU's datasheet figure)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("finetune_gpu.py needs a CUDA GPU")
    args.peak_tflops = args.peak_tflops or dense_bf16_peak(torch.device("cuda"))[0]
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    root = write_folder(args.out / "shapes", args.images, args.workers)
    ckpt = args.checkpoint or write_checkpoint(args.out / "vit_b16_official_random.npz")
    print(f"{args.images} JPEGs and the checkpoint written in {time.perf_counter() - start:.1f} s", flush=True)

    overrides = [
        f"optim.batch_size={args.batch}",
        f"schedule.steps={args.steps}",
        "run.amp=bf16",
        f"run.compile={args.compile}",
        "run.device=cuda",
        f"data.num_workers={args.workers}",
        "run.log_every=10",
        f"run.eval_every={max(args.steps // 3, 1)}",
        "run.progress=false",
        f"run.out_dir={args.out}",
    ]
    cfg = finetune_config(str(ckpt), str(root), overrides)
    train_set, _, _ = build_datasets(cfg.data)
    rate = loader_rate(train_set, args.batch, args.workers, batches=20)
    print(f"input pipeline alone: {rate:,.0f} img/s with {args.workers} workers (batch {args.batch})", flush=True)

    sampler = StackSampler() if args.sample_stacks else contextlib.nullcontext()
    with sampler:
        result = train(cfg)
    records = MetricsLog(result.run_dir).records()
    steps = [r for r in records if r["kind"] == "train"]
    trained = statistics.median(r["images_per_s"] for r in steps[1:]) if len(steps) > 1 else float("nan")
    trained_model = load_model(result.run_dir)  # the architecture trained, whichever checkpoint it came from
    gflops = 3 * model_flops(trained_model, trained_model.config.img_size[0]) / 1e9
    print(f"run: {result.run_dir}; {result.steps_run} steps in {result.steps_s:.1f} s (compilation included)")
    outside = outside_steps(steps, args.batch)
    print(f"between its log records the run spent {outside:.1f} s outside its training steps (evaluations, saves)")
    print(
        f"training: {trained:,.0f} img/s (median of {len(steps) - 1} log records after the first), "
        f"MFU {trained * gflops / (args.peak_tflops * 1e3):.1%} of {args.peak_tflops:g} TFLOP/s "
        f"({gflops:.1f} GFLOP per image per step); the loader alone gave {rate / trained:.1f}x that"
    )
    print("step  loss    img/s   | evaluations")
    for r in records:
        if r["kind"] == "train":
            print(f"{r['step']:>4}  {r['loss']:.4f}  {r['images_per_s']:>7,.0f}")
        elif r["kind"] == "eval":
            evals = ", ".join(f"{k} {v:.4g}" for k, v in r.items() if k.startswith("eval_"))
            print(f"{r['step']:>4}  {'':<23}| {evals}")
    print("final: " + ", ".join(f"{k} {v:.4g}" for k, v in result.metrics.items()))
    if isinstance(sampler, StackSampler):
        print(sampler.report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
