"""ONNX export with a dynamic batch axis, checked against onnxruntime before it is handed over.

    path = export_onnx(model, "vit.onnx")          # input "pixel_values" (batch, C, H, W) -> "logits"
    err = check_onnx(path, model, batch_sizes=(1, 3))
    path = export_onnx(model, "vit-int8.onnx", int8=True)   # MatMul weights int8 per channel (onnxruntime)

The graph is traced by torch.export at a fixed image size; only the batch axis is symbolic.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config_of import config_of
from .errors import UserError, UserFileNotFoundError, quiet
from .io import atomic_write
from .optional import require
from .preprocessing import Preprocessing, from_onnx_metadata, read_preprocessing

INPUT_NAME = "pixel_values"
OUTPUT_NAME = "logits"


def _require(module: str) -> Any:
    return require(module, "ONNX export")


def export_onnx(
    model: nn.Module,
    path: str | Path,
    img_size: int | None = None,
    opset: int = 18,
    verbose: bool = False,
    force: bool = False,
    int8: bool = False,
    preprocessing: Preprocessing | None = None,
) -> Path:
    """Write model (fp32, eval) atomically as ONNX with a dynamic batch axis, with its preprocessing record (default:
    the model's own) at the exported size in metadata_props; an existing file is replaced only with ``force``."""
    config = config_of(model)
    size = config.img_size if img_size is None else img_size
    h, w = (size, size) if isinstance(size, int) else size
    if not (isinstance(h, int) and isinstance(w, int) and h > 0 and w > 0):
        raise UserError(f"export: img_size={img_size!r}; expected a positive number of pixels (or none: the model's)")
    _require("onnx")
    _require("onnxscript")
    path = Path(path)
    if path.exists() and not force:
        raise UserError(f"{path}: exists; pass --force (force=True) to replace it")
    prep = preprocessing or read_preprocessing({}, config.to_dict(), source="the model")
    props = replace(prep, img_size=h if h == w else (h, w)).to_onnx_metadata()  # the record at the exported size
    model = _fp32_eval(model)
    example = torch.zeros(2, config.in_chans, h, w, device=next(model.parameters()).device)
    batch = torch.export.Dim("batch", min=1, max=4096)
    silenced = contextlib.nullcontext() if verbose else _silenced()
    with silenced, torch.no_grad():
        program = torch.onnx.export(
            model,
            (example,),
            dynamo=True,
            opset_version=opset,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_shapes=({0: batch},),
            verbose=verbose,
        )
        assert program is not None  # the dynamo exporter always returns its program
        program.model.metadata_props.update(props)
        if not int8:
            atomic_write(path, lambda tmp: program.save(tmp))
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        # the fp32 graph is as large as the weights: kept beside the destination rather than in a small /tmp
        with tempfile.TemporaryDirectory(prefix=".vitkit-export-", dir=path.parent) as workdir:
            fp32 = Path(workdir) / "fp32.onnx"
            program.save(str(fp32))
            atomic_write(path, lambda tmp: quantize_int8_onnx(fp32, tmp))
    return path


def read_onnx_preprocessing(path: str | Path) -> Preprocessing:
    """The preprocessing record an ONNX file written by ``export_onnx`` carries in its metadata_props."""
    onnx = _require("onnx")
    model = onnx.load(str(path), load_external_data=False)
    return from_onnx_metadata({p.key: p.value for p in model.metadata_props}, source=f"{path}: metadata_props")


def quantize_int8_onnx(src: str | Path, dst: str | Path) -> None:
    """onnxruntime's dynamic quantisation of an fp32 graph's matmuls, as vitkit.accel.int8. Weights use 7 bits
    (``reduce_range``): a CPU without VNNI sums uint8 x int8 pairs in int16, which 8-bit weights can overflow."""
    onnx = _require("onnx")
    _require("onnxruntime")
    from onnxruntime.quantization import QuantType, quantize_dynamic

    graph = onnx.load(str(src))
    # the exporter's shape annotations go stale when the quantiser turns Gemm into MatMul: inferred afresh
    del graph.graph.value_info[:]
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # its advice to pre-process the graph is for static quantisation
    try:
        quantize_dynamic(
            graph,
            str(dst),
            op_types_to_quantize=["MatMul", "Gemm"],
            per_channel=True,
            reduce_range=True,
            weight_type=QuantType.QInt8,
        )
    finally:
        logging.disable(previous)


@contextlib.contextmanager
def _silenced() -> Iterator[None]:
    """The exporter prints progress lines and warns about optional torchvision ops; keep the CLI output clean."""
    with quiet("torch.onnx", logging.ERROR), contextlib.redirect_stdout(io.StringIO()):
        yield


def _fp32_eval(model: nn.Module) -> nn.Module:
    """The model in fp32 eval mode; a bf16 model is copied rather than converted under its owner's feet."""
    if any(p.dtype != torch.float32 for p in model.parameters()):
        model = copy.deepcopy(model).float()
    return model.eval()


def onnx_session(path: str | Path, threads: int | None = None) -> Any:
    """An onnxruntime CPU session using as many threads as torch does (a fair side-by-side)."""
    ort = _require("onnxruntime")
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or torch.get_num_threads()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # no busy-waiting between runs: spinning threads would slow whatever runs next (the bench alternates runtimes)
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not Path(path).is_file():
        raise UserFileNotFoundError(f"{path}: no such ONNX file")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def check_onnx(
    path: str | Path,
    model: nn.Module,
    batch_sizes: Sequence[int] = (1, 3),
    atol: float = 1e-4,
    seed: int = 0,
    rtol: float = 0.0,
) -> float:
    """Max |onnxruntime - torch| over random inputs at several batch sizes; raises ValueError above
    atol + rtol * max |torch| (an int8 graph is checked with rtol: a gross-error check, not its accuracy)."""
    session = onnx_session(path)
    config = config_of(model)
    h, w = (int(d) for d in session.get_inputs()[0].shape[2:])
    model = _fp32_eval(model)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    worst, scale = 0.0, 0.0
    for b in batch_sizes:
        x = torch.randn(b, config.in_chans, h, w, generator=generator)
        got = torch.from_numpy(session.run(None, {INPUT_NAME: x.numpy()})[0])
        with torch.no_grad():
            want = model(x.to(device)).float().cpu()
        if got.shape != want.shape:
            raise UserError(f"{path}: onnxruntime output shape {tuple(got.shape)} != torch {tuple(want.shape)}")
        worst = max(worst, float((got - want).abs().max()))
        scale = max(scale, float(want.abs().max()))
    if not worst <= atol + rtol * scale:
        raise UserError(f"{path}: onnxruntime differs from torch by {worst:.3e} (> {atol + rtol * scale:.1e})")
    return worst
