"""The error a user can act on.

Library code raises ``UserError`` (or one of its subclasses) for a mistake in what it was given: a path, a key,
a value, a file's contents. The message names the file, key or value and says what was expected, in one line.
The command line prints exactly that line and exits with status 2; every other exception is a bug (or an
environment failure) and keeps its traceback.

``UserError`` is a ValueError, and the subclasses are also the built-in errors their names say, so code that
catches ValueError, FileNotFoundError or TypeError keeps working.
"""

from __future__ import annotations


class UserError(ValueError):
    """A bad input (path, key, value, file contents): the message says which and what was expected."""


class UserFileNotFoundError(UserError, FileNotFoundError):
    """A path the user gave does not exist."""


class ConfigError(UserError, TypeError):
    """A config field that does not exist or has a wrong value (a TypeError for keyword use, as Python's own)."""
