"""Whole records packed greedily into fixed-length rows: the plan of which records share row i.

Fine-tuning data (image-text records, chat conversations) must not be cut across rows as pretraining text is
(packed.py): a prompt in one row would be missing from the row that trains its answer. So records are kept whole.
The plan walks the records in a fresh permutation per epoch (drawn from the seed and the epoch number) and fills
rows greedily: a record goes into the current row if it fits every budget (tokens, and images for image-text),
otherwise the row is closed (the dataset pads it) and the record starts the next one. Row i therefore depends
only on (records, budgets, seed), never on how many rows were asked for: a resumed run reads exactly the rows it
would have read. A record too large for a row on its own is left out (counted in ``skipped``).
"""

from __future__ import annotations

import numpy as np


def greedy_rows(sizes: list[np.ndarray], budgets: list[int], seed: int, n_rows: int) -> tuple[list[list[int]], int]:
    """(record indices of each of the first ``n_rows`` rows, records skipped as too large for a row).

    ``sizes[k][r]``: record r's use of budget k (its tokens, its images); a row holds at most ``budgets[k]`` of
    each. The caller makes sure at least one record fits (else no row could ever close)."""
    fits = np.ones(len(sizes[0]), dtype=bool)
    for size, budget in zip(sizes, budgets, strict=True):
        fits &= size <= budget
    if not fits.any():
        raise ValueError("greedy_rows: no record fits a row")
    columns = [np.asarray(s).tolist() for s in sizes]  # Python ints: the loop below is per record
    rows: list[list[int]] = []
    row: list[int] = []
    used = [0] * len(sizes)
    epoch = 0
    while len(rows) < n_rows:
        for r in np.random.default_rng([seed, epoch]).permutation(len(fits)).tolist():
            if not fits[r]:
                continue
            if any(u + c[r] > b for u, c, b in zip(used, columns, budgets, strict=True)):
                rows.append(row)
                if len(rows) == n_rows:
                    break
                row, used = [], [0] * len(sizes)
            row.append(r)
            used = [u + c[r] for u, c in zip(used, columns, strict=True)]
        epoch += 1
    return rows, int((~fits).sum())
