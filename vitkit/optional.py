"""Optional dependencies: one road from "this feature needs a package you do not have" to the install line.

    onnx = require("onnx", "ONNX export")   # the module, or MissingDependencyError:
    # "ONNX export needs the onnx package: pip install 'vitkit[onnx]'"

A missing package is the user's to install, so the error is a UserError; it is also an ImportError.
"""

from __future__ import annotations

import sys
from types import ModuleType

from .errors import UserError

# module -> the extra that installs it (pyproject.toml [project.optional-dependencies])
EXTRAS = {
    "onnx": "onnx",
    "onnxruntime": "onnx",
    "onnxscript": "onnx",
    "transformers": "bench",
    "kornia": "augment",
    "tensorboard": "tensorboard",
    "datasets": "hf",
    "webdataset": "wds",
    "sklearn": "dev",
    "scipy": "dev",
}

# the package name pip knows, where it is not the module's
PACKAGES = {"sklearn": "scikit-learn"}


class MissingDependencyError(UserError, ImportError):
    """An optional package a feature needs is not installed; the message names the pip line that installs it."""


def install_hint(module: str) -> str:
    """The pip line that provides a module: "pip install 'vitkit[onnx]'"."""
    top = module.split(".")[0]
    if top not in EXTRAS:
        raise KeyError(f"{module!r} is not an optional dependency of vitkit (known: {', '.join(EXTRAS)})")
    return f"pip install 'vitkit[{EXTRAS[top]}]'"


def require(module: str, purpose: str) -> ModuleType:
    """Import an optional module, or raise MissingDependencyError naming ``purpose`` and the pip line."""
    hint = install_hint(module)  # an unknown module is a bug here, found before any import is tried
    try:
        __import__(module)  # the import statement's own road (what a test that hides a package replaces)
    except ImportError as e:
        top = module.split(".")[0]
        missing = e.name.split(".")[0] if e.name else top
        if missing != top:  # the package is there but one of its own imports fails: a broken install, shown as is
            raise
        package = PACKAGES.get(top, top)
        raise MissingDependencyError(f"{purpose} needs the {package} package: {hint}") from None
    return sys.modules[module]
