"""Training objectives other than next-token prediction, applied to the packed token rows on the fly.

A causal LM trains on a row of ``seq_len + 1`` tokens shifted by one (inputs ``row[:-1]``, labels ``row[1:]``).
An encoder's objective (BERT's masked LM) instead turns each row into inputs and labels of ``seq_len`` tokens,
labels -100 where nothing is predicted. `ObjectiveDataset` does it per sample, as a pure function of (the
objective's seed, the split, the sample's global index): a resumed run, or one with another data-parallel
layout, sees exactly the same masks. Its items are ``[2, seq_len]`` (inputs, labels), so a batch is
``[B, 2, seq_len]`` and `inputs_and_labels` tells the two layouts apart: the step, the pipeline and evaluation
need nothing else. BERT's sentence-order prediction (model.sentence_order) makes ``[4, seq_len]`` items (inputs,
labels, segment ids, order label): the two extra rows reach the model as keyword arguments (`objective_kwargs`,
through `megaloom.step.model_inputs`).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch


class Objective(Protocol):
    """Turns one packed token row into (inputs, labels); made by a family's ``objective(cfg, tokenizer)``."""

    vocab_size: int  # token ids it may emit (the tokenizer's plus any it reserves, e.g. [MASK]): the model's floor

    def sample(self, tokens: np.ndarray, index: int, split: str) -> np.ndarray:
        """``tokens`` [seq_len + 1] (sample ``index`` of ``split``) -> int64 [2, seq_len]: inputs, labels (or more
        rows, which `objective_kwargs` hands to the model)."""
        ...


class ObjectiveDataset:
    """``dataset`` (token rows) with ``objective`` applied to each item; the length is the dataset's."""

    def __init__(self, dataset, objective: Objective, split: str) -> None:
        self.dataset, self.objective, self.split = dataset, objective, split

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.objective.sample(np.asarray(self.dataset[i]), int(i), self.split)


def objective_kwargs(rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """The model's keyword arguments that an objective's rows carry beyond (inputs, labels): BERT's sentence-order
    rows ``[B, 4, T]`` give ``segments`` [B, T] (segment ids) and ``order_labels`` [B] (read at position 0)."""
    if rows.dim() == 3 and rows.shape[1] == 4:
        return {"segments": rows[:, 2], "order_labels": rows[:, 3, 0]}
    return {}


def inputs_and_labels(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's (inputs, labels): ``[B, T + 1]`` token rows shifted by one (causal LM), or ``[B, 2, T]`` rows an
    objective already split (``[B, 4, T]`` with BERT's sentence order: the rest is `objective_kwargs`)."""
    if rows.dim() == 3:
        return rows[:, 0], rows[:, 1]
    return rows[:, :-1], rows[:, 1:]
