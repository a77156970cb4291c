"""BERT's key (megaloom/models/bert/): the sentence-order head. Refused for families without the trait
`sentence_order` (megaloom/models/rules.py)."""

from __future__ import annotations

from dataclasses import dataclass

from megaloom.model_keys.base import _f


@dataclass
class BertKeys:
    sentence_order: bool = _f(False, "BERT only: ALBERT's sentence-order prediction head besides the masked LM: each "
                                     "row becomes [CLS] A [SEP] B [SEP] (A, B its two halves, swapped for half the "
                                     "rows), a pooler + 2-way head on [CLS] predicts the order; not with pp>1.",
                              shape=True)
