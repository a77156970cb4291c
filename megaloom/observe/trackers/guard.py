"""A tracker that fails is disabled with one warning line, never stopping training.

A missing package (`pip install 'megaloom[wandb]'`), a login that is not there, a server that does not answer, a
full disk: each is an exception from the tracker's start or one of its calls. The guard catches it (not
KeyboardInterrupt or SystemExit: a Ctrl-C still stops the run), prints what failed and the fix, and from then on
skips that tracker; metrics.jsonl and the other trackers go on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megaloom.observe.log import get_logger

log = get_logger(__name__)
EXTRAS = {"wandb": "wandb", "mlflow": "mlflow"}  # pyproject extras that install a tracker's package


class Guarded:
    def __init__(self, name: str, start: Callable[[], Any]) -> None:
        self.name = name
        self.tracker: Any = None
        try:
            self.tracker = start()
        except ImportError as e:
            extra = EXTRAS.get(name)
            fix = f"pip install 'megaloom[{extra}]'" if extra else "install it"
            self._disable(f"is not installed ({e}); {fix}, or leave {name} out of run.trackers")
        except Exception as e:
            self._disable(f"failed to start ({type(e).__name__}: {_first_line(e)})")

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
