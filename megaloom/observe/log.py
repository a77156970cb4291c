"""megaloom's console output: one `megaloom` logger with a rank-aware handler.

Every module logs through ``get_logger(__name__)`` (a child of the `megaloom` logger). The handler prints the
message alone, as the console lines always looked; which records a rank prints depends on the verbosity:

- ``normal`` (default): rank 0 prints INFO and above; other ranks only WARNING and above, prefixed ``[rank N]``.
- ``quiet`` (``megaloom train --quiet``): WARNING and above on every rank.
- ``verbose`` (``megaloom train --verbose``): DEBUG and above on every rank.

Records go to stdout (where the console lines have always gone), read at the moment of writing so that a
replaced ``sys.stdout`` (pytest's capsys, a redirect) receives them; ``extra=TO_STDERR`` sends one to stderr
(notes that must not mix with a command's result on stdout, e.g. the default-corpus build). The rank is read
from torchrun's ``RANK`` at the moment of writing too, so the handler is right in workers whatever the import
order. The handler is installed on first use unless the `megaloom` logger already has one (an application that
wants its own handling adds its handler first).

Commands whose job is to print a result (``megaloom config``, ``status``, ``plot``'s "wrote", ...) use print.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

ROOT = "megaloom"
VERBOSITIES = ("quiet", "normal", "verbose")
TO_STDERR = {"to_stderr": True}  # logger.info(msg, extra=TO_STDERR)

_state = {"verbosity": "normal"}


def current_rank() -> int:
    """This process's global rank as torchrun exported it (0 outside torchrun)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def threshold(verbosity: str, rank: int) -> int:
    """The lowest level a rank prints at a verbosity."""
    if verbosity == "verbose":
        return logging.DEBUG
    if verbosity == "quiet" or rank != 0:
        return logging.WARNING
    return logging.INFO


class _RankFilter(logging.Filter):
    """Keeps the records this rank prints at the current verbosity and adds the rank prefix (none on rank 0)."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = current_rank()
        record.rank_prefix = f"[rank {rank}] " if rank != 0 else ""
        return record.levelno >= threshold(_state["verbosity"], rank)


class ConsoleHandler(logging.StreamHandler):
    """A StreamHandler whose stream is the current sys.stdout (sys.stderr for records with ``TO_STDERR``)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)
        self.setFormatter(logging.Formatter("%(rank_prefix)s%(message)s"))
        self.addFilter(_RankFilter())

    @property
    def stream(self):  # looked up when used (flush), never stored
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ / setStream: the stream is never stored
        pass

    def emit(self, record: logging.LogRecord) -> None:
        out = sys.stderr if getattr(record, "to_stderr", False) else sys.stdout
        try:
            out.write(self.format(record) + self.terminator)
            out.flush()
        except Exception:  # as logging does: a broken stream must not stop training
            self.handleError(record)


def _install() -> logging.Logger:
    logger = logging.getLogger(ROOT)
    if not logger.handlers:
        logger.addHandler(ConsoleHandler())
        logger.propagate = False  # megaloom owns its console lines; no second copy through the root logger
        logger.setLevel(logging.DEBUG if _state["verbosity"] == "verbose" else logging.INFO)
    return logger


def get_logger(name: str = ROOT) -> logging.Logger:
    """The logger of a megaloom module (``get_logger(__name__)``); installs the console handler on first use."""
    _install()
    return logging.getLogger(name)


def configure_logging(verbosity: str = "normal") -> None:
    """Set the verbosity of megaloom's console output (see the module docstring)."""
    if verbosity not in VERBOSITIES:
        raise ValueError(f"log verbosity {verbosity!r} is not one of {', '.join(VERBOSITIES)}.")
    _state["verbosity"] = verbosity
    logger = _install()
    levels = {"quiet": logging.WARNING, "normal": logging.INFO, "verbose": logging.DEBUG}
    logger.setLevel(levels[verbosity])


@contextlib.contextmanager
def console_verbosity(verbosity: str):
    """`configure_logging(verbosity)` for a block (one CLI command), then the previous verbosity again."""
    previous = _state["verbosity"]
    configure_logging(verbosity)
    try:
        yield
    finally:
        configure_logging(previous)
