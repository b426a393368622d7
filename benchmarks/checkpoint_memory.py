"""Peak memory of one ViT-B/16 training step with and without per-block activation checkpointing.

A step is forward, cross-entropy, backward and an AdamW update (fp32, 224 px, batch 32 by default). Each
configuration runs in a fresh subprocess, so one's peak cannot hide in the other's. One step is run first and
not measured: AdamW allocates its moments on the first update, and that is the same in both configurations.

    python benchmarks/checkpoint_memory.py [--batch 32] [--device cpu]

CPU: the rise of the process's peak resident set during the measured step; CUDA: the allocator's peak over what
was allocated before it (see harness/memory.py). The model runs as built (vitkit.models, no vitkit.accel).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from harness import format_bytes, measure_step_memory, memory_method

from vitkit.models.vit import VisionTransformer


def measure(checkpointing: bool, batch: int, device: str) -> dict:
    dev = torch.device(device)
    torch.manual_seed(0)
    # ViT-B/16 (the ViTConfig defaults), 1000 classes
    model = VisionTransformer(grad_checkpointing=checkpointing).to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    x = torch.randn(batch, 3, 224, 224, device=dev)
    y = torch.randint(0, 1000, (batch,), device=dev)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    step()  # creates AdamW's moments; not measured
    start = time.perf_counter()
    peak = measure_step_memory(step, dev, reset_cpu_peak=True)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return {"peak": peak, "seconds": time.perf_counter() - start, "method": memory_method(dev)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child == "on", args.batch, args.device)))
        return

    results = {}
    for mode in ("off", "on"):
        cmd = [sys.executable, __file__, "--child", mode, "--batch", str(args.batch), "--device", args.device]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
    off, on = results["off"], results["on"]
    print(f"ViT-B/16 training step (AdamW, fp32, 224 px, batch {args.batch}) on {args.device}")
    print(f"method: {off['method']}")
    print(f"without checkpointing: peak {format_bytes(off['peak'])}, step {off['seconds']:.1f} s")
    print(f"with checkpointing:    peak {format_bytes(on['peak'])}, step {on['seconds']:.1f} s")
    if off["peak"] and on["peak"]:
        print(f"ratio with/without: memory {on['peak'] / off['peak']:.2f}, time {on['seconds'] / off['seconds']:.2f}")


if __name__ == "__main__":
    main()
