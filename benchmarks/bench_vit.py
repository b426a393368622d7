"""images/s, FLOPs, utilisation and memory of a model, optionally side by side with peers (was `vitkit bench`).

    python benchmarks/bench_vit.py                                    # ViT-B/16 inference, fp32, batch 8
    python benchmarks/bench_vit.py --model vit_s16 --batch-size 32 --dtype bf16-autocast --mode train --compare hf
    python benchmarks/bench_vit.py --compare hf --compare timm --json out.json --results benchmarks/results/x.md
    python benchmarks/bench_vit.py --dtype int8 --compare hf --compare timm          # each library's int8 switch

vitkit runs through its documented switches: inference through ``vitkit.optimize_for_inference(model, precision,
compile=...)``, a training step through ``vitkit.optimize_for_training(model)`` (bf16-autocast inference has no
switch: the model as built). The peers (--compare: transformers, timm, onnxruntime) run their models with the same
weights, dtype and compile mode; for int8 (CPU inference) under torch's quantize_dynamic, eagerly. Outputs are
compared before anything is timed; implementations then take turns round by round with a matmul peak (the fastest
kernel here), and vitkit's speed over each peer's is the median of per-round ratios with its 95% interval. See
harness/run.py. The process keeps freed memory for reuse (vitkit.accel.training.tune_cpu_allocator), as the vitkit
command line did for this benchmark.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from harness import DTYPES, MODES, PEER_MODULES, PEERS, BenchConfig, command_line, recorded, run_bench

from vitkit.accel.training import tune_cpu_allocator
from vitkit.device import COMPILE_MODES
from vitkit.errors import UserError
from vitkit.models.config import ATTN_IMPLS
from vitkit.optional import require

PROG = "bench_vit.py"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="vit_b16", help="a registered model (default vit_b16)")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="fp32",
        help="bf16 = bf16 weights; bf16-autocast = mixed; int8 = int8 Linear layers (CPU inference)",
    )
    p.add_argument(
        "--attn", choices=ATTN_IMPLS, default="auto", help="attention path (auto: explicit in bf16 on a CPU)"
    )
    p.add_argument("--compile", choices=COMPILE_MODES, default="none", help="torch.compile mode (infer: + freezing)")
    p.add_argument("--mode", choices=MODES, default="infer", help="inference forward, or a full AdamW train step")
    p.add_argument("--compare", choices=PEERS, action="append", default=[], help="time a peer alongside; repeatable")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--force", action="store_true", help="replace an existing --json file")
    p.add_argument("--results", metavar="FILE.md", help="also write the table as a result file (benchmarks/results/)")
    p.add_argument("--max-batch", action="store_true", help="find the largest batch within --memory-budget")
    p.add_argument("--memory-budget", default="8GB")
    p.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    return p


def peers_here(compare: list[str]) -> tuple[str, ...]:
    """The peers asked for, once each. A missing transformers or onnxruntime is a user error naming its pip line;
    timm, no dependency of vitkit, is said to be missing and left out."""
    peers = []
    for peer in dict.fromkeys(compare):
        if peer == "timm" and importlib.util.find_spec("timm") is None:
            print(f"{PROG}: timm is not importable (pip install timm): timed without it", file=sys.stderr)
            continue
        for module in PEER_MODULES.get(peer, ()):
            require(module, f"--compare {peer}")
        peers.append(peer)
    return tuple(peers)


def run(args: argparse.Namespace, argv: list[str] | None) -> int:
    if args.json and Path(args.json).exists() and not args.force:  # before minutes of timing
        raise UserError(f"{args.json}: exists; pass --force to replace it")
    compare = peers_here(args.compare)  # a missing peer library is named before anything is built
    tune_cpu_allocator()  # a benchmark measures the fast setting: freed tensor memory kept for reuse
    fields = {k: getattr(args, k) for k in ("model", "img_size", "batch_size", "dtype", "attn", "compile", "mode")}
    cfg = BenchConfig(
        **fields,
        compare=compare,
        repeats=args.repeats,
        warmup=args.warmup,
        max_batch=args.max_batch,
        memory_budget=args.memory_budget,
        **({"device": args.device} if args.device else {}),
    )
    report = run_bench(cfg, log=lambda s: print(s, file=sys.stderr, flush=True))
    with recorded(args.results, command_line(__file__, argv)):
        print(report.table())
    if args.json:
        print(f"wrote {report.save_json(args.json)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; a user error (a bad value, a missing peer, an existing --json file) is one line on stderr
    and exit status 2."""
    args = parser().parse_args(argv)
    try:
        return run(args, argv)
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
