"""The error a user can act on.

Library code raises ``UserError`` (or one of its subclasses) for a mistake in what it was given: a path, a key,
a value, a file's contents. The message names the file, key or value and says what was expected, in one line.
The command line prints exactly that line and exits with status 2; every other exception is a bug (or an
environment failure) and keeps its traceback.

``UserError`` is a ValueError, and the subclasses are also the built-in errors their names say, so code that
catches ValueError, FileNotFoundError or TypeError keeps working.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence


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
    """difflib's ratio of two names; ``loose``: of the names normalised, the better of with and without their
    separators (so that ``vit_b_16`` is as close to ``vit_b16`` as ``vitb16`` is)."""
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
    """The one hint for a name vitkit does not know: "did you mean a, b, c?" with the three candidates most like
    ``name`` (difflib similarity at least ``cutoff``, of the names normalised where ``loose``, as model names are
    spelt many ways; ties go to the closer literal spelling, then to the candidates' order), each as ``show`` spells
    it; ``otherwise`` where none is close."""

    def spelt(candidate: str) -> float:
        return difflib.SequenceMatcher(None, name.lower(), candidate.lower()).ratio()

    scored = sorted((-_similarity(name, c, loose), -spelt(c), i, c) for i, c in enumerate(candidates))
    close = [c for score, _, _, c in scored[:3] if -score >= cutoff]
    return f"did you mean {', '.join(map(show, close))}?" if close else otherwise
