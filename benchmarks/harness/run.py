"""run_bench: build, check parity, time alternating with the matmul peak, measure memory (and the largest batch).

    report = run_bench(BenchConfig(model="vit_b16", batch_size=8, dtype="bf16", compare=("hf",)))
    print(report.table()); report.save_json("bench.json")

vitkit's rows run its documented switch (steps.vitkit_step), the peers' rows their models as built in the same
dtype and compile mode. Runs alternate between implementations repeat by repeat, so a change of machine load hits
all of them alike; the ratios, paired repeat by repeat, are the figures to trust. Utilisation is achieved FLOP/s
over the matmul peak timed in the same rounds: "mfu" counts the model's FLOPs, "hw" the FLOPs each implementation
executes (less for vitkit where its last block computes the class token alone).
"""

from __future__ import annotations

import math
import statistics
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vitkit.accel.inference import resolve_precision
from vitkit.errors import UserError
from vitkit.models.flops import model_flops

from .config import BenchConfig
from .memory import find_max_batch, format_bytes, measure_step_memory, memory_method, parse_bytes, resident_bytes
from .parity import check_one, check_parity, model_output, relative_max_diff
from .peak import MatmulProbe, matmul_probe, paired_utilisation
from .peers import hf_peer, timm_peer
from .report import BenchReport, Measurement, environment, paired_ratio_intervals
from .stats import load_average, load_warnings, paired_ratio_stats, settled
from .steps import build_model, executes_first_token, inputs_and_classes, onnx_step, peer_step, vitkit_step
from .timing import SETTLE_S, step_seconds, time_alternating

PROBE = "matmul peak"
Log = Callable[[str], None]


@dataclass
class Bench:
    """What run_bench times: vitkit's model, the steps by row name, whose model each row runs, parity and notes."""

    model: nn.Module
    steps: dict[str, Callable[[], Any]] = field(default_factory=dict)
    owners: dict[str, nn.Module] = field(default_factory=dict)
    parity: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def run_bench(
    cfg: BenchConfig,
    log: Log = lambda s: None,
    compile_modes: Sequence[str] | None = None,
    extra_peers: Mapping[str, Callable[[nn.Module], nn.Module]] | None = None,
) -> BenchReport:
    """Build, check parity, time alternating, measure memory (and the largest batch); see the module docstring.

    ``compile_modes`` (default: just cfg.compile) times every implementation under each mode, all alternating in
    one loop, rows named "vitkit/none", "hf/default", ...; the ratios then compare each side's best row.
    ``extra_peers``: name -> a function building that implementation from vitkit's model (same weights, dtype
    and device), timed and parity-checked like transformers.
    """
    device = torch.device(cfg.device)
    modes = tuple(compile_modes or (cfg.compile,))
    with tempfile.TemporaryDirectory(prefix="vitkit-bench-") as workdir:  # the ONNX export's, while it is timed
        bench = prepare(cfg, device, modes, extra_peers or {}, Path(workdir), log)
        times, probe, probe_flops = time_rows(cfg, device, bench, log)
        model = bench.model
        flops = model_flops(model, cfg.img_size)
        executed = model_flops(model, cfg.img_size, executes_first_token(model, cfg), getattr(model, "token_merge", 0))
        step_flops = flops * cfg.batch_size * (3 if cfg.mode == "train" else 1)
        probe_s = times.pop(PROBE)
        measurements = []
        for name, step_s in times.items():
            share = paired_utilisation(step_flops, step_s, probe_flops, probe_s)
            executed_share = share * executed / flops if name.split("/")[0] == "vitkit" else share
            measurements.append(measure(cfg, device, bench, name, step_s, share, executed_share))
    stats = paired_ratio_intervals(measurements)
    for peer, st in stats.items():
        if st.inconclusive:
            bench.notes.append(f"vitkit / {peer}: the interval ({st.low:.3f}-{st.high:.3f}) is wider than the effect")
    return BenchReport(
        config={**asdict(cfg), "compare": list(cfg.compare), "compile_modes": list(modes)},
        environment=environment(device),
        gflops_per_image=flops / 1e9,
        executed_gflops_per_image=executed / 1e9,
        gflops_per_step=step_flops / 1e9,
        matmul_peak_gflops=probe_flops / statistics.median(probe_s) / 1e9,  # under the same load as the models
        matmul_peak_kernel=probe.kernel,
        matmul_peak_size=probe.size,
        matmul_peak_s=probe_s,
        memory_method=memory_method(device),
        measurements=measurements,
        ratios={peer: st.median for peer, st in stats.items()},
        max_batch=estimate_max_batch(model, cfg, device, measurements[0], log) if cfg.max_batch else None,
        ratio_stats={peer: st.to_dict() for peer, st in stats.items()},
        warnings=bench.notes,
    )


def prepare(
    cfg: BenchConfig,
    device: torch.device,
    modes: Sequence[str],
    extra_peers: Mapping[str, Callable[[nn.Module], nn.Module]],
    workdir: Path,
    log: Log,
) -> Bench:
    """The model, its peers (parity-checked before anything is timed) and one step per implementation and mode."""
    model = build_model(cfg, device)
    torch.manual_seed(1)
    in_chans, classes = inputs_and_classes(model)
    x = torch.randn(cfg.batch_size, in_chans, cfg.img_size, cfg.img_size, device=device).to(cfg.param_dtype)
    y = torch.randint(0, classes, (cfg.batch_size,), device=device)
    builders = {name: build for name, build in (("hf", hf_peer), ("timm", timm_peer)) if name in cfg.compare}
    peers = {name: build(model) for name, build in {**builders, **extra_peers}.items()}
    bench = Bench(model, parity=check_parity(model, peers, x, cfg, log))
    ref = model_output(model, x, cfg)
    if cfg.mode == "infer" and cfg.dtype == "bf16" and resolve_precision("bf16", device, warn=False) != "bf16":
        bench.notes.append("bf16 is emulated here: vitkit's switch (optimize_for_inference) runs fp32, the peers bf16")
    for impl, module in {"vitkit": model, **peers}.items():
        for mode in modes:
            name = impl if len(modes) == 1 else f"{impl}/{mode}"
            build = vitkit_step if impl == "vitkit" else peer_step
            bench.steps[name] = build(module, replace(cfg, compile=mode), x, y, device)
            bench.owners[name] = module
            if (impl == "vitkit" or cfg.dtype == "int8") and cfg.mode == "infer":  # a switch computes the model
                err = relative_max_diff(bench.steps[name](), ref)
                bench.parity[impl] = max(bench.parity.get(impl, 0.0), check_one(f"{name} (its switch)", err, cfg, log))
    if "onnx" in cfg.compare:
        if cfg.mode != "infer" or cfg.dtype != "fp32" or device.type != "cpu":
            raise UserError("bench --compare onnx: onnxruntime is measured for fp32 inference on the CPU only")
        bench.steps["onnx"] = onnx_step(model, cfg, x, workdir)
        bench.parity["onnx"] = check_one("onnx", relative_max_diff(bench.steps["onnx"](), ref), cfg, log)
    return bench


def time_rows(
    cfg: BenchConfig, device: torch.device, bench: Bench, log: Log
) -> tuple[dict[str, list[float]], MatmulProbe, int]:
    """Every row's seconds round by round, the matmul peak (lasting as long as vitkit's step) taking its turn in
    each round: (times by row name, the probe among them under PROBE; the probe; its FLOPs)."""
    ours = next(name for name in bench.steps if name.startswith("vitkit"))
    probe, probe_flops = matmul_probe(
        {"fp32": torch.float32, "int8": torch.int8}.get(cfg.dtype, torch.bfloat16),
        device,
        seconds=step_seconds(bench.steps[ours], device),
    )
    rounds = f"{cfg.repeats}" + (f" to {cfg.max_repeats}" if cfg.max_repeats > cfg.repeats else "")
    log(f"timing {', '.join(bench.steps)}: {cfg.warmup} warm-up and {rounds} timed calls each, alternating")

    def ratios_settled(times: dict[str, list[float]]) -> bool:
        ours = [t for name, t in times.items() if name.startswith("vitkit")]
        peers = [t for name, t in times.items() if not name.startswith(("vitkit", PROBE))]
        return settled([paired_ratio_stats(p, v) for p in peers for v in ours], cfg.target_half_width)

    load_before = load_average()
    times = time_alternating(
        {**bench.steps, PROBE: probe},
        cfg.repeats,
        cfg.warmup,
        device,
        settle_s=SETTLE_S if device.type == "cpu" else 0.0,  # no CPU thread pools to let go idle on a GPU
        until=ratios_settled,
        max_repeats=cfg.max_repeats,
    )
    bench.notes[:0] = load_warnings(load_before, load_average(), torch.get_num_threads())
    return times, probe, probe_flops


def measure(
    cfg: BenchConfig,
    device: torch.device,
    bench: Bench,
    name: str,
    step_s: list[float],
    share: float,
    executed_share: float,
) -> Measurement:
    """One row's Measurement from its seconds and its shares of the peak (the model's FLOPs, the executed ones);
    its step memory is measured here."""
    rates = [cfg.batch_size / t for t in step_s]
    owner = bench.owners.get(name)
    memory = None if owner is None else measure_step_memory(bench.steps[name], device, reset_cpu_peak=True)
    return Measurement(
        name=name,
        images_per_s=statistics.median(rates),
        images_per_s_min=min(rates),
        images_per_s_max=max(rates),
        step_s=step_s,
        utilisation=share,
        hardware_utilisation=executed_share,
        step_memory_bytes=memory,
        # int8 weights live in packed buffers that parameters() does not list: not counted rather than miscounted
        resident_bytes=resident_bytes(owner, cfg.mode) if owner is not None and cfg.dtype != "int8" else None,
        parity_max_abs=bench.parity.get(name.split("/")[0]),
    )


def estimate_max_batch(
    model: nn.Module, cfg: BenchConfig, device: torch.device, measured: Measurement, log: Log
) -> dict[str, Any]:
    """The largest batch whose step fits the memory budget (paper Fig 12).

    CUDA: doubling then bisection, each candidate run for real (an out-of-memory error means it does not fit).
    CPU: there is no allocator limit to hit, so an estimate: resident + fixed + per-image x batch, with the
    per-image step memory from measurements at this batch size and half of it.
    """
    budget = parse_bytes(cfg.memory_budget)
    resident = resident_bytes(model, cfg.mode)
    out = {"budget": cfg.memory_budget, "budget_bytes": budget, "resident_bytes": resident}
    in_chans, classes = inputs_and_classes(model)

    def step_memory(batch: int) -> int | None:
        xb = torch.randn(batch, in_chans, cfg.img_size, cfg.img_size, device=device)
        yb = torch.randint(0, classes, (batch,), device=device)
        step = vitkit_step(model, cfg, xb.to(cfg.param_dtype), yb, device)
        step()  # warm-up: optimizer state, compiled kernels
        return measure_step_memory(step, device, reset_cpu_peak=True)

    if device.type == "cuda":

        def fits(batch: int) -> bool:
            try:
                mem = step_memory(batch)
            except torch.OutOfMemoryError:
                return False
            finally:
                torch.cuda.empty_cache()
            log(f"max batch: {batch} needs {format_bytes(mem)} + resident")
            return mem is not None and resident + mem <= budget

        return {**out, "batch_size": find_max_batch(fits), "method": "measured: doubling + bisection on CUDA"}
    b1, b2 = max(cfg.batch_size // 2, 1), max(cfg.batch_size, 2)
    m1, m2 = step_memory(b1), measured.step_memory_bytes if b2 == cfg.batch_size else step_memory(b2)
    if m1 is None or m2 is None:
        return {**out, "batch_size": None, "method": "unavailable: step memory is not measurable here"}
    per_image = max((m2 - m1) / (b2 - b1), 1.0)
    fixed = max(m1 - per_image * b1, 0.0)
    batch = max(int(math.floor((budget - resident - fixed) / per_image)), 0)
    return {
        **out,
        "batch_size": batch,
        "per_image_bytes": int(per_image),
        "fixed_bytes": int(fixed),
        "method": f"estimate on CPU: resident + fixed + per-image step memory (measured at batch {b1} and {b2})",
    }
