"""The one error hierarchy of gpusnap: every module's own exception derives from GpusnapError.

An error carries the exit code the command line turns it into, and a message that is one line a user
can act on. The CLI catches GpusnapError (and OSError) once; nothing registers error types at import
time. Exit codes: 1 the operation failed, 2 usage, 3 damage found (a snapshot or the store is not
what it claims to be), 4 the environment lacks something the command needs (no GPU, no CRIU, ...),
5 an interrupted operation must be finished first with `gpusnap recover`.
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_DAMAGED = 3
EXIT_UNAVAILABLE = 4
EXIT_RECOVER = 5


class GpusnapError(Exception):
    """Base of every gpusnap error; `exit_code` is what the CLI exits with."""

    exit_code: int = EXIT_FAILED


class DamageError(GpusnapError):
    """Stored data that is not what it claims to be (a damaged chunk, manifest or store entry)."""

    exit_code = EXIT_DAMAGED


class UnavailableError(GpusnapError):
    """Something this command needs is not on this machine (a GPU, a driver feature, a program)."""

    exit_code = EXIT_UNAVAILABLE
