"""How often a run may roll back past non-finite steps before it stops instead.

A rollback restores the last checkpoint and skips the data window of the bad steps: it helps when the data
caused them. When the run diverges again on the same steps (its new run of bad steps begins before the step
where the last one ended), although it now reads other data, the data is not the cause (a learning rate too
high, an unstable model) and every further rollback would only throw data away: the run stops.
`resilience.max_rollbacks` bounds the rollbacks of one process in any case.
"""

from __future__ import annotations

from dataclasses import dataclass

from megaloom.errors import Diverged


@dataclass
class RollbackBudget:
    max_rollbacks: int
    done: int = 0
    last_bad_step: int | None = None  # the step at which the last rolled-back run of bad steps ended

    def allow(self, bad_step: int, bad_steps: int, checkpoint_step: int | None, fix: str) -> None:
        """A run of `bad_steps` non-finite steps ended at `bad_step`; raise Diverged unless a rollback (to
        `checkpoint_step`, the newest checkpoint; None without one) may follow. `fix`: what the person can do."""
        where = f"{bad_steps} non-finite steps in a row up to step {bad_step}"
        resume = (f"; the last checkpoint is step {checkpoint_step}, resumed from by the next start"
                  if checkpoint_step is not None else "")
        # Again on the same steps: this run of bad steps began before the last rolled-back one had ended (a step
        # or two of jitter either way is common, so overlap, not an equal step, is the test).
        if self.last_bad_step is not None and bad_step - bad_steps + 1 <= self.last_bad_step:
            raise Diverged(f"training diverged again: {where}, after a rollback skipped the data of the earlier "
                           f"bad steps (up to step {self.last_bad_step}); other data did not help, so the data is "
                           f"not the cause; {fix}{resume}.")
        if self.done >= self.max_rollbacks:
            raise Diverged(f"training diverged: {where}, and the run has already rolled back {self.done} time(s) "
                           f"(resilience.max_rollbacks={self.max_rollbacks}); {fix}{resume}.")
        self.done += 1
        self.last_bad_step = bad_step
