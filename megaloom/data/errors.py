"""The one exception type the data pipeline raises for problems a user can fix."""


class DataError(ValueError):
    """A user-facing data problem.

    Messages name the setting or file involved, what was found, and what would fix it, so that a
    bad path or a stale token file fails with advice instead of a numpy traceback deep in a worker.
    """
