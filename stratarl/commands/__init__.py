"""Subcommands of the `stratarl` CLI.

Every module in this package that defines ``register(subparsers)`` adds one or
more subcommands; `stratarl.cli` discovers them, so a new command is one new file.
``register`` adds a parser and sets ``func=<callable(args) -> int>`` on it.
Keep imports of heavy modules (torch, transformers) inside the handlers so that
``stratarl --help`` stays fast.
"""

import errno
import os
import sys

from stratarl.config_errors import ConfigError


def describe_os_error(error: OSError | UnicodeDecodeError) -> str:
    """One line for an OSError or a UnicodeDecodeError: what happened, the path, and a fix."""
    if isinstance(error, UnicodeDecodeError):
        return f"a file is not UTF-8 text ({error.reason} at byte {error.start}); pass a text file"
    what = error.strerror or str(error)
    code = -1 if error.errno is None else error.errno  # -1: no errno, so no entry below
    # Where the system's words ("File exists", "Not a directory") do not say what happened, say it.
    said = {
        errno.EEXIST: "already exists and is in the way of a folder or file to be created here",
        errno.ENOTDIR: "a part of this path is a file, not a folder",
        errno.ENOENT: "no such file or folder",
    }.get(code)
    if said and error.filename and "Fix:" not in what:
        what = f"{error.filename}: {said}"
    fix = {
        errno.ENOSPC: "free disk space",
        errno.EACCES: "choose a folder you can write to",
        errno.EROFS: "choose a writable folder",
        errno.ENOTDIR: "choose another path",
        errno.EEXIST: "choose another path, or move it away",
        errno.ENOENT: "check the path",
        errno.EISDIR: "pass a file, not a folder",
    }.get(code)
    where = f": {error.filename}" if error.filename and str(error.filename) not in what else ""
    return f"{what}{where}" + (f". Fix: {fix}" if fix and "Fix:" not in what else "")


def error_line(error: BaseException) -> str:
    """What a command prints for an error it expects: an OSError described by `describe_os_error` (no raw
    ``[Errno N]``), anything else as its message."""
    return describe_os_error(error) if isinstance(error, OSError) else str(error)


class CommandFailed(Exception):
    """A command stops with its own exit code; the message is the error line (``error: <message>``)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def print_error(message: str, code: int = 2) -> int:
    """Print ``error: <message>`` on stderr; returns the exit code."""
    print(f"error: {message}", file=sys.stderr)
    return code


def guard(fn):
    """Run ``fn`` (a command's body) and turn expected user errors into one clear line on stderr and an exit code
    (STRATARL_DEBUG=1 shows the traceback)."""
    try:
        return fn()
    except ConfigError as error:
        return print_error(str(error))
    except CommandFailed as error:
        return print_error(str(error), error.code)
    except (ValueError, FileNotFoundError, RuntimeError, KeyError) as error:
        if os.environ.get("STRATARL_DEBUG"):
            raise
        if isinstance(error, OSError) and error.errno is not None:  # the system's FileNotFoundError, not ours
            return print_error(describe_os_error(error), 1)
        return print_error(f"{type(error).__name__}: {error}", 1)
    except OSError as error:  # disk full, read-only or unwritable run directory, a path under a file
        if os.environ.get("STRATARL_DEBUG"):
            raise
        return print_error(describe_os_error(error), 1)
