"""The one error family of trainwright: every refusal a user or an agent can act on.

Each kind maps to one CLI exit code and one MCP error, in one table (README, "Errors and exit
codes"). Anything raised that is *not* a :class:`TrainwrightError` is a bug: the MCP binding
logs its traceback and reports it as an internal error, and the CLI exits with
``EXIT_INTERNAL``; it is never passed off as bad input.

=============  =========  ============================================================
kind           exit code  meaning
=============  =========  ============================================================
``bad_input``  2          the request cannot be done as given; the message says what to change
``not_found``  3          an unknown run, recipe, checkpoint, skill or template
``internal``   70         a trainwright bug (the message says so; the log has the traceback)
=============  =========  ============================================================

A run's outcome has its own codes (1 failed, 130 stopped; 124 when ``wait`` timed out): they
describe a run, not an error.

This module is torch-free and stdlib-only: the server, the sandbox, the skills and the engine
all import it.
"""

from __future__ import annotations

from typing import ClassVar, Literal

ErrorKind = Literal["bad_input", "not_found", "internal"]

EXIT_OK = 0
EXIT_RUN_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_NOT_FOUND = 3
EXIT_INTERNAL = 70
EXIT_TIMEOUT = 124  # `trainwright wait`: the timeout passed before the run got there
EXIT_STOPPED = 130

# An error message as a caller is shown it (it may echo the caller's input or a run's output): the
# one bound of every layer's error text, here with the family since every layer imports it.
MAX_ERROR_CHARS = 2_000
# Another program's error (git, sbatch, the Hub, an OS call) quoted inside one of ours: its start.
MAX_QUOTED_CHARS = 300

EXIT_CODES: dict[str, int] = {"bad_input": EXIT_BAD_INPUT, "not_found": EXIT_NOT_FOUND, "internal": EXIT_INTERNAL}
# Every exit code of the CLI and what it means: the one table its help and docs are written from.
EXIT_MEANINGS: dict[int, str] = {
    EXIT_OK: "success",
    EXIT_RUN_FAILED: "the run failed",
    EXIT_BAD_INPUT: "bad input or refused (the message says what to change)",
    EXIT_NOT_FOUND: "not found (unknown run, recipe, checkpoint, skill, template)",
    EXIT_INTERNAL: "internal error (a trainwright bug)",
    EXIT_TIMEOUT: "wait: the timeout passed first",
    EXIT_STOPPED: "stopped or interrupted",
}


class TrainwrightError(Exception):
    """Base of every error whose message is meant for the caller."""

    kind: ClassVar[ErrorKind] = "bad_input"

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.kind]


class BadInput(TrainwrightError, ValueError):
    """The request cannot be done as given; the message says what to change."""

    kind: ClassVar[ErrorKind] = "bad_input"


class NotFound(TrainwrightError, LookupError):
    """A run, recipe, checkpoint, skill or template that does not exist; the message says how
    to list what does."""

    kind: ClassVar[ErrorKind] = "not_found"


def error_kind(error: BaseException) -> ErrorKind:
    """The kind of any exception: ours say it; everything else is a bug."""
    return error.kind if isinstance(error, TrainwrightError) else "internal"


def exit_code_for(error: BaseException) -> int:
    return EXIT_CODES[error_kind(error)]


class LaunchRefused(BadInput):
    """The engine refused the launch (bad config, bad recipe); nothing was written."""
