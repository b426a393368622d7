"""CIFAR-10 / CIFAR-100 from the standard "python version" pickle batches, read without running pickle code.

Expected files, in ``root`` or the archive's own subfolder (``cifar-10-batches-py`` / ``cifar-100-python``):

    CIFAR-10:  data_batch_1 .. data_batch_5, test_batch   {b"data": uint8 (N, 3072), b"labels": [int]}
               batches.meta                              {b"label_names": [bytes]}
    CIFAR-100: train, test                               {b"data": ..., b"fine_labels": [int]}
               meta                                      {b"fine_label_names": [bytes]}

Each row of ``data`` is a 32x32 image's red, green, then blue plane in raster order. The files hold plain dicts,
lists, bytes and numpy arrays, so ``RestrictedUnpickler`` refuses every global but numpy's array reconstruction:
a crafted file cannot make unpickling call anything else. The meta file is optional (names fall back to "0", ...).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import UserError, UserFileNotFoundError

SIDE = 32
SUBFOLDERS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}
FILES = {
    "cifar10": (["data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4", "data_batch_5"], ["test_batch"]),
    "cifar100": (["train"], ["test"]),
}
META = {"cifar10": ("batches.meta", b"label_names"), "cifar100": ("meta", b"fine_label_names")}
LABEL_KEY = {"cifar10": b"labels", "cifar100": b"fine_labels"}
NUM_CLASSES = {"cifar10": 10, "cifar100": 100}

# (module, name) pairs an ndarray pickle refers to; numpy 2 names its core "numpy._core", numpy 1 "numpy.core".
_ARRAY_GLOBALS = (
    {(core + ".multiarray", "_reconstruct") for core in ("numpy.core", "numpy._core")}
    | {(core + ".multiarray", "scalar") for core in ("numpy.core", "numpy._core")}
    | {(core + ".numeric", "_frombuffer") for core in ("numpy.core", "numpy._core")}
    | {("numpy", "ndarray"), ("numpy", "dtype")}
)


class UnsafePickleError(ValueError):
    """A pickle asked for a global outside the allowed list."""


def _latin1_bytes(text: str, encoding: str) -> bytes:
    """Stand-in for ``_codecs.encode``, which protocol-2 pickles written by Python 3 use to store bytes."""
    if encoding not in ("latin1", "latin-1"):
        raise UnsafePickleError(f"refusing _codecs.encode with encoding {encoding!r} (only latin1 stores bytes)")
    return text.encode("latin1")


class RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that can rebuild plain containers and numpy arrays, and refuses every other global."""

    def __init__(self, file, path: Path):
        super().__init__(file, encoding="bytes")  # the files were written by Python 2: keep str as bytes
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("_codecs", "encode"):
            return _latin1_bytes
        if (module, name) not in _ARRAY_GLOBALS:
            raise UnsafePickleError(
                f"{self.path}: refusing to unpickle the global {module}.{name}; a CIFAR batch "
                "holds only dicts, lists, bytes and numpy arrays"
            )
        if module.startswith("numpy.core") and hasattr(np, "_core"):  # numpy 1 name; numpy 2 keeps it in _core
            module = module.replace("numpy.core", "numpy._core", 1)
        return super().find_class(module, name)


def load_pickle(path: str | Path) -> Any:
    """Safely unpickle one CIFAR file (see ``RestrictedUnpickler``)."""
    path = Path(path)
    with open(path, "rb") as f:
        try:
            return RestrictedUnpickler(f, path).load()
        except UnsafePickleError as e:
            raise UnsafePickleError(f"{path}: {e}" if str(path) not in str(e) else str(e)) from None
        except Exception as e:  # truncated or not a pickle at all
            raise UserError(f"{path}: not a readable CIFAR pickle batch ({type(e).__name__}: {e})") from None


def _get(doc: Any, key: bytes, path: Path) -> Any:
    if not isinstance(doc, dict):
        raise UserError(f"{path}: expected a dict, got {type(doc).__name__}")
    for k in (key, key.decode()):  # files re-pickled by Python 3 may use str keys
        if k in doc:
            return doc[k]
    raise UserError(f"{path}: missing key {key!r}; found {sorted(map(repr, doc))}")


def read_batch(path: Path, label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    """One batch file -> (uint8 images (N, 32, 32, 3), int64 labels (N,))."""
    doc = load_pickle(path)
    data = np.asarray(_get(doc, b"data", path))
    labels = np.asarray(_get(doc, label_key, path))
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * SIDE * SIDE:
        raise UserError(f"{path}: b'data' should be uint8 (N, {3 * SIDE * SIDE}), got {data.dtype} {data.shape}")
    if labels.shape != (len(data),) or labels.dtype.kind not in "iu":
        raise UserError(f"{path}: expected {len(data)} integer labels under {label_key!r}, got {labels.shape}")
    images = data.reshape(-1, 3, SIDE, SIDE).transpose(0, 2, 3, 1)  # (N, 3, 32, 32) -> (N, 32, 32, 3)
    return np.ascontiguousarray(images), labels.astype(np.int64)


def find_cifar_dir(root: str | Path, source: str) -> Path:
    """The directory holding the batch files: ``root`` itself or its standard subfolder."""
    root = Path(root)
    if not root.is_dir():
        raise UserFileNotFoundError(f"{root}: {source} directory does not exist")
    train_files, test_files = FILES[source]
    for candidate in (root, root / SUBFOLDERS[source]):
        if all((candidate / name).is_file() for name in train_files + test_files):
            return candidate
    missing = [name for name in train_files + test_files if not (root / name).is_file()]
    raise UserFileNotFoundError(
        f"{root}: not a {source} directory; missing batch files {missing} (also looked in "
        f"{root / SUBFOLDERS[source]}). Expected the python-version archive, extracted."
    )


def load_cifar(root: str | Path, source: str) -> dict[str, Any]:
    """{"train": (images, labels), "test": (images, labels), "class_names": [str]} for cifar10 / cifar100."""
    if source not in FILES:
        raise UserError(f"source: expected one of {sorted(FILES)}, got {source!r}")
    directory = find_cifar_dir(root, source)
    train_files, test_files = FILES[source]
    splits = {}
    for split, names in (("train", train_files), ("test", test_files)):
        parts = [read_batch(directory / name, LABEL_KEY[source]) for name in names]
        splits[split] = (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    num_classes = NUM_CLASSES[source]
    for split, (_, labels) in splits.items():
        if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
            raise UserError(f"{directory}: {split} labels outside 0..{num_classes - 1}")
    meta_name, names_key = META[source]
    class_names = [str(i) for i in range(num_classes)]
    if (directory / meta_name).is_file():
        names = _get(load_pickle(directory / meta_name), names_key, directory / meta_name)
        class_names = [n.decode() if isinstance(n, bytes) else str(n) for n in names]
        if len(class_names) != num_classes:
            raise UserError(f"{directory / meta_name}: expected {num_classes} class names, got {len(class_names)}")
    return {"train": splits["train"], "test": splits["test"], "class_names": class_names}
