"""The error a user can act on: ``UserError`` names the path, key, value or file contents and what was expected,
in one line, which the command line prints before exiting with status 2; every other exception keeps its
traceback. It is a ValueError, and its subclasses are also the built-in errors their names say.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import warnings
from collections.abc import Callable, Iterator, Sequence


class UserError(ValueError):
    """A bad input (path, key, value, file contents): the message says which and what was expected."""


class UserFileNotFoundError(UserError, FileNotFoundError):
    """A path the user gave does not exist."""


class ConfigError(UserError, TypeError):
    """A config field that does not exist or has a wrong value (a TypeError for keyword use, as Python's own)."""


def _normalised(name: str) -> str:
    """A name as the eye compares it: lower case, '-' and '/' as '_', a Hub organisation dropped."""
    name = name.lower().removeprefix("google/").removeprefix("timm/")
    return name.replace("-", "_").replace("/", "_")


def _similarity(a: str, b: str, loose: bool) -> float:
    """difflib's ratio of two names; ``loose``: of the names normalised, the better of with and without separators."""
    if not loose:
        return difflib.SequenceMatcher(None, a, b).ratio()
    a, b = _normalised(a), _normalised(b)
    spelt = difflib.SequenceMatcher(None, a, b).ratio()
    bare = difflib.SequenceMatcher(None, a.replace("_", ""), b.replace("_", "")).ratio()
    return max(spelt, bare)


def did_you_mean(
    name: str,
    candidates: Sequence[str],
    otherwise: str,
    show: Callable[[str], str] = str,
    cutoff: float = 0.6,
    loose: bool = True,
) -> str:
    """The one hint for an unknown name: "did you mean a, b, c?" with the three candidates most like it (difflib
    ratio >= ``cutoff``; ties to the closer literal spelling), each as ``show`` spells it; else ``otherwise``."""

    def spelt(candidate: str) -> float:
        return difflib.SequenceMatcher(None, name.lower(), candidate.lower()).ratio()

    scored = sorted((-_similarity(name, c, loose), -spelt(c), i, c) for i, c in enumerate(candidates))
    close = [c for score, _, _, c in scored[:3] if -score >= cutoff]
    return f"did you mean {', '.join(map(show, close))}?" if close else otherwise


@contextlib.contextmanager
def quiet(logger: str, level: int = logging.CRITICAL + 1) -> Iterator[None]:
    """A library's log lines below ``level`` and its warnings held back for one call (vitkit says what failed)."""
    log = logging.getLogger(logger)
    previous = log.level
    log.setLevel(level)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(previous)
