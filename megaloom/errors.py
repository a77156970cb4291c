"""The exception a run stops with when it cannot go on and a person must act (not a bug, not a bad setting).

`megaloom train` prints its message as one line and exits 1 (cli.py); under torchrun --max-restarts the job is
restarted like after any failure, so a lasting cause stops it again within the restart budget.
"""


class RunStopped(RuntimeError):
    """A run that cannot go on: the message says what happened, what is on disk, and what to do."""
