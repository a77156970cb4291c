"""A tracker that cannot start stops the run before its first step (unless run.trackers_optional=true); one that
fails later is disabled with one warning line, never stopping training.

A missing package (`pip install 'megaloom[wandb]'`), a login that is not there, a server that does not answer, a
full disk: each is an exception from the tracker's start or one of its calls. At the start the guard turns it into
a ConfigError naming the tracker, the cause and the fix (a run asked for a dashboard that would stay empty: issue
49, where MLflow's refused file store left a run without its tracker and only a warning said so); with
``optional`` (run.trackers_optional=true) it warns and leaves the tracker out instead. Later it catches the failure
(not KeyboardInterrupt or SystemExit: a Ctrl-C still stops the run), prints what failed, and from then on skips that
tracker; metrics.jsonl and the other trackers go on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megaloom.errors import ConfigError
from megaloom.observe.log import get_logger

log = get_logger(__name__)
EXTRAS = {"wandb": "wandb", "mlflow": "mlflow"}  # pyproject extras that install a tracker's package


class Guarded:
    def __init__(self, name: str, start: Callable[[], Any], optional: bool = False) -> None:
        """``optional`` (run.trackers_optional): a tracker that cannot start is a warning, not a ConfigError."""
        self.name = name
        self.tracker: Any = None
        try:
            self.tracker = start()
        except ImportError as e:
            extra = EXTRAS.get(name)
            fix = f"pip install 'megaloom[{extra}]'" if extra else "install it"
            self._not_started(f"is not installed ({e}); {fix}, or leave {name} out of run.trackers", optional)
        except Exception as e:
            self._not_started(f"failed to start ({type(e).__name__}: {_first_line(e)})", optional)

    def _not_started(self, why: str, optional: bool) -> None:
        if not optional:
            raise ConfigError(f"run.trackers: {self.name} {why}; or set run.trackers_optional=true to train without "
                              "it (metrics.jsonl has every record)")
        self._disable(why)

    @property
    def active(self) -> bool:
        return self.tracker is not None

    def _disable(self, why: str) -> None:
        log.warning(f"WARNING: run.trackers: {self.name} {why}; training goes on without it (metrics.jsonl has every "
                    "record)")
        tracker, self.tracker = self.tracker, None
        if tracker is not None:
            try:
                tracker.close()
            except Exception:  # already failing: the warning above said so
                pass

    def log(self, record: dict[str, Any], step: int) -> None:
        if self.tracker is None:
            return
        try:
            self.tracker.log(record, step)
        except Exception as e:
            self._disable(f"failed at step {step} ({type(e).__name__}: {_first_line(e)})")

    def close(self) -> None:
        if self.tracker is None:
            return
        try:
            self.tracker.close()
        except Exception as e:
            log.warning(f"WARNING: run.trackers: {self.name} failed to close ({type(e).__name__}: {_first_line(e)})")
        self.tracker = None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "no message"
