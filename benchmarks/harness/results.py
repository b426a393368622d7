"""Result files: a script's printed figures with the command, the machine and the date that made them.

    python benchmarks/bench_vit.py --model vit_s16 --results benchmarks/results/bench_vit_s16.md

writes benchmarks/results/bench_vit_s16.md (the format: benchmarks/results/README.md). ``write_results`` writes one
from text; ``recorded`` writes one from everything a block prints to stdout, still printing it as it goes.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import platform
import shlex
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TextIO

import torch

from vitkit.device import cpu_flags, cpu_model_name, usable_cores
from vitkit.io import atomic_write_text

REPO = Path(__file__).resolve().parents[2]
# the instruction sets the benchmarks' kernels turn on: bf16 and int8 dot products, AMX tiles, AVX-512, AVX2
FLAGS = ("amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx512f", "avx2")
PEERS = ("transformers", "timm", "onnxruntime", "torchao")


def command_line(script: str | Path, argv: Sequence[str] | None = None) -> str:
    """The command that ran a script, as typed from the repository root: ``python benchmarks/x.py --flag ...``
    (argv: the script's arguments, default sys.argv[1:])."""
    path = Path(script).resolve()
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    args = list(sys.argv[1:] if argv is None else argv)
    return shlex.join(["python", str(shown), *args])


def machine() -> str:
    """One line: the CPU model, which of FLAGS it has, its cores, the GPU if any, torch's and Python's versions."""
    flags = cpu_flags()
    present = [f for f in FLAGS if f in flags]
    absent = [f for f in FLAGS if f not in flags]
    cpu = cpu_model_name() or platform.processor() or platform.machine()
    parts = [
        f"{cpu} ({', '.join(present) or 'none of ' + ', '.join(FLAGS)}"
        + (f"; without {', '.join(absent)})" if present and absent else ")"),
        f"{os.cpu_count()} cores ({usable_cores()} usable, {torch.get_num_threads()} torch threads)",
    ]
    if torch.cuda.is_available():
        parts.append(f"GPU {torch.cuda.get_device_name()}")
    parts.append(f"torch {torch.__version__}, Python {platform.python_version()}, {platform.system()}")
    peers = [f"{name} {getattr(sys.modules[name], '__version__', '?')}" for name in PEERS if name in sys.modules]
    if peers:  # the peers this run compared, as imported
        parts.append(", ".join(peers))
    return "; ".join(parts)


def results_text(text: str, command: str, title: str | None = None, when: datetime.datetime | None = None) -> str:
    """The file's Markdown: a title, the header block (command, machine, date), then text as printed."""
    when = when or datetime.datetime.now(datetime.timezone.utc)
    words = shlex.split(command)
    name = title or (Path(words[1]).name if len(words) > 1 else command)
    return (
        f"# {name}\n\n"
        f"- command: `{command}`\n"
        f"- machine: {machine()}\n"
        f"- date: {when.strftime('%Y-%m-%d %H:%M UTC')}\n\n"
        f"```text\n{text.rstrip()}\n```\n"
    )


def write_results(path: str | Path, text: str, command: str, title: str | None = None) -> Path:
    """Write text (what the script printed) as a result file at path, replacing an earlier one (the history of a
    result is git's); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, results_text(text, command, title))
    return path


class _Tee(io.TextIOBase):
    """A text stream that writes to another and keeps a copy."""

    def __init__(self, out: TextIO) -> None:
        self.out, self.kept = out, io.StringIO()

    def write(self, s: str) -> int:
        self.kept.write(s)
        return self.out.write(s)

    def flush(self) -> None:
        self.out.flush()


@contextlib.contextmanager
def recorded(path: str | Path | None, command: str) -> Iterator[None]:
    """Within the block, stdout is printed as usual and also kept; at its end (not after an error) the result file
    is written at path (nothing is kept or written where path is None)."""
    if path is None:
        yield
        return
    tee = _Tee(sys.stdout)
    with contextlib.redirect_stdout(tee):
        yield
    print(f"wrote {write_results(path, tee.kept.getvalue(), command)}")
