"""Stand-in for the three Transformer hooks megaloom.parallel relies on, until the lead adds them.

The hooks (what `parallelize_tensor` assigns): ``model.loss_fn(logits, labels)`` computes the loss from the
head's output, ``model.seq_scatter`` runs on the embedding output and ``model.seq_gather`` on the output
of the final norm, both identity by default. If the installed Transformer already has them, nothing is
patched; otherwise the class gets exactly the forward the lead is asked to write.
"""

from __future__ import annotations

import inspect

import torch
from torch.utils.checkpoint import checkpoint

from megaloom.models import transformer as tr


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None, caches=None, pos: int = 0):
    t = tokens.shape[1]
    if pos + t > self.cfg.max_seq_len:
        raise ValueError(f"sequence of {pos + t} tokens exceeds model.max_seq_len={self.cfg.max_seq_len}")
    x = self.seq_scatter(self.embed(tokens, pos))
    rope = self.rope(t, pos)
    for i, layer in enumerate(self.layers):
        cache = caches[i] if caches is not None else None
        if i < self.recompute_layers and torch.is_grad_enabled():
            x = checkpoint(layer, x, rope, use_reentrant=False)
        else:
            x = layer(x, rope, cache, pos)
    x = self.seq_gather(self.norm(x))
    if labels is None:
        return self.head(x)
    return self.loss_fn(self.head(x), labels)


def missing_hooks() -> dict[str, object]:
    """Class attributes to set on Transformer; empty once the real hooks exist."""
    cls = tr.Transformer
    if "seq_gather" in inspect.getsource(cls.forward) or cls.forward is _forward:
        return {}
    return dict(forward=_forward, loss_fn=staticmethod(tr.cross_entropy), seq_scatter=staticmethod(_identity),
                seq_gather=staticmethod(_identity))


def ensure_model_hooks() -> None:
    """For spawned ranks (processes of their own): patch for the process's lifetime."""
    for name, value in missing_hooks().items():
        setattr(tr.Transformer, name, value)
