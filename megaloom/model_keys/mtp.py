"""Multi-token prediction's key (megaloom/models/mtp.py; its loss weights are train.mtp_*)."""

from __future__ import annotations

from dataclasses import dataclass

from megaloom.model_keys.base import _f


@dataclass
class MtpKeys:
    mtp_depth: int = _f(0, "Multi-token prediction (DeepSeek-V3: 1): this many sequential modules after the last "
                           "block, module k predicting the token k+1 places after the next from the previous "
                           "module's states and the embedding of the token k places ahead, through its own block and "
                           "the shared head (megaloom/models/mtp.py); trained with train.mtp_loss_weight, not used "
                           "at inference. 0 = off.", shape=True)
