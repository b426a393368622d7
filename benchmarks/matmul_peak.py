"""The matmul peak of each precision on this machine, kernel by kernel: what the benchmarks' shares are against.

    python benchmarks/matmul_peak.py                 # fp32, bf16 and int8 (where the CPU has them natively): 1 min
    python benchmarks/matmul_peak.py --dtypes fp32

For each dtype, one square product at the size the benchmarks' probe uses (harness.probe_size: doubled from 256
while torch's product takes under 0.1 s) through each kernel the probe chooses from (harness.probe_kernels),
timed in turn for a few rounds: the best rate of each, the kernel the probe would take, and how much faster it is
than torch's own. Speed needs a quiet machine: the load average is checked.
"""

from __future__ import annotations

import argparse

import torch
from harness import fastest_calls, load_average, load_warnings, probe_kernels, probe_size

from vitkit.accel.training import tune_cpu_allocator
from vitkit.device import bf16_is_fast, cpu_has_vnni, usable_cores

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}


def best_rates(dtype: torch.dtype, n: int, rounds: int) -> dict[str, float]:
    """GFLOP/s (int8: GOP/s) of each kernel at n, the best of ``rounds`` calls, the kernels taking turns."""
    kernels = probe_kernels(dtype, torch.device("cpu"), n)
    seconds = fastest_calls(kernels, torch.device("cpu"), rounds)
    return {k.kernel: 2 * n**3 / s / 1e9 for k, s in zip(kernels, seconds, strict=True)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    native = ["fp32"] + (["bf16"] if bf16_is_fast(torch.device("cpu")) else []) + (["int8"] if cpu_has_vnni() else [])
    p.add_argument("--dtypes", default=",".join(native), help=f"of fp32,bf16,int8 (default here: {','.join(native)})")
    p.add_argument("--rounds", type=int, default=5, help="timed calls of each kernel (default 5)")
    args = p.parse_args(argv)
    dtypes = args.dtypes.split(",")
    if unknown := [d for d in dtypes if d not in DTYPES]:
        p.error(f"--dtypes: unknown {', '.join(unknown)}; expected some of {', '.join(DTYPES)}")
    tune_cpu_allocator()  # as the benchmarks do
    before = load_average()
    print(f"matmul peak by kernel, {torch.get_num_threads()} threads")
    for name in dtypes:
        dtype = DTYPES[name]
        n = probe_size(dtype, torch.device("cpu"))
        rates = best_rates(dtype, n, args.rounds)
        unit = "GOP/s" if dtype == torch.int8 else "GFLOP/s"
        fastest = max(rates, key=rates.__getitem__)
        torch_rate = next(iter(rates.values()))  # probe_kernels lists torch's own kernel first
        print(
            f"  {name} {n}x{n}: "
            + ", ".join(f"{kernel} {rate:.0f} {unit}" for kernel, rate in rates.items())
            + f"; the peak: {fastest}, {rates[fastest] / torch_rate:.2f}x torch's"
        )
    for line in load_warnings(before, load_average(), torch.get_num_threads(), usable_cores()):
        print(line)


if __name__ == "__main__":
    main()
