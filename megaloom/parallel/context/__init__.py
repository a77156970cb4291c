"""Context parallelism (``parallel.cp``): every sequence split over cp ranks, attention exchanged between them.

- layout.py:   the load-balanced causal split (rank r holds chunks r and 2cp-1-r), positions and data shards.
- blocks.py:   one attention block with its log-sum-exp, its backward, the online-softmax merge.
- ring.py:     ring attention (p2p key/value blocks, overlapped with the block being computed).
- alltoall.py: all-to-all (Ulysses) attention (heads split instead of the sequence around the core).

Everything outside attention is token-wise, so the rest of the model runs unchanged on T/cp tokens; what needs
the global picture is handled where it lives: positions (`Transformer.seq_positions`), the data (`SequenceShard`
on tokens and labels), the loss (each rank's mean over its equal share; the data-parallel reduction over
``mesh.dp_cp_group`` divides by dp * cp, which makes it the mean over the whole sequence) and the gradients of
every weight (summed over dp x cp by the same reduction).
"""

from __future__ import annotations

from torch import nn

from megaloom.config import Config, ConfigError
from megaloom.model_keys.shape import resolved_kv_heads
from megaloom.parallel.context.alltoall import alltoall_attention
from megaloom.parallel.context.layout import SequencePositions, SequenceShard, shard_sequence
from megaloom.parallel.context.ring import register_recorder, ring_attention

__all__ = ["ContextAttention", "SequencePositions", "SequenceShard", "alltoall_attention", "check_context",
           "choose_mode", "parallelize_context", "ring_attention", "shard_sequence"]

MODES = ("auto", "ring", "alltoall")


def _local_heads(cfg: Config) -> tuple[int, int]:
    """(query heads, key/value heads) of one tensor-parallel rank."""
    m, tp = cfg.model, cfg.parallel.tp
    kv = resolved_kv_heads(m)
    return m.n_heads // tp, max(kv // tp, 1)


def choose_mode(cfg: Config) -> str:
    """``parallel.cp_mode`` resolved: auto is all-to-all when cp divides both local head counts, else ring."""
    mode = cfg.parallel.cp_mode
    if mode != "auto":
        return mode
    h, hkv = _local_heads(cfg)
    cp = cfg.parallel.cp
    return "alltoall" if h % cp == 0 and hkv % cp == 0 else "ring"


def check_context(cfg: Config) -> None:
    """Refuse what context parallelism cannot run, naming the setting and the fix (preflight)."""
    p, m, t = cfg.parallel, cfg.model, cfg.train
    if p.cp == 1:
        return
    if t.seq_len % (2 * p.cp):
        lo = max(2 * p.cp, t.seq_len // (2 * p.cp) * 2 * p.cp)
        raise ConfigError(f"parallel.cp={p.cp} cuts each sequence into 2*cp={2 * p.cp} chunks (load-balanced causal "
                          f"split), but train.seq_len={t.seq_len} is not divisible by {2 * p.cp}; train.seq_len={lo} "
                          f"or {lo + 2 * p.cp} would work.")
    if p.sp and p.tp > 1 and (t.seq_len // p.cp) % p.tp:
        raise ConfigError(f"parallel.sp=true with parallel.cp={p.cp}: each rank's {t.seq_len // p.cp} tokens must "
                          f"split over tp={p.tp}; choose train.seq_len divisible by {2 * p.cp * p.tp}.")
    mode = choose_mode(cfg)
    h, hkv = _local_heads(cfg)
    if mode == "alltoall" and (h % p.cp or hkv % p.cp):
        raise ConfigError(f"parallel.cp_mode=alltoall splits heads over cp={p.cp}, but each tp rank has {h} query "
                          f"and {hkv} key/value heads (model.n_heads={m.n_heads}, model.n_kv_heads="
                          f"{resolved_kv_heads(m)}, parallel.tp={p.tp}); use parallel.cp_mode=ring (or auto).")
    if mode == "ring" and m.sliding_window:
        raise ConfigError(f"model.sliding_window={m.sliding_window} with parallel.cp={p.cp} needs the all-to-all "
                          "mode (ring attention here is full causal only); set parallel.cp_mode=alltoall "
                          "(the heads per tp rank must be multiples of cp).")
    if mode == "ring" and cfg.data.document_mask:
        raise ConfigError(f"data.document_mask=true with parallel.cp={p.cp} needs the all-to-all mode (ring attention "
                          "here takes no masks yet); set parallel.cp_mode=alltoall (the heads per tp rank must be "
                          "multiples of cp) or data.document_mask=false. data.reset_positions works in both modes.")
    if m.dropout > 0:
        raise ConfigError(f"model.dropout={m.dropout} with parallel.cp={p.cp} is not supported (attention-probability "
                          "dropout inside the ring); set model.dropout=0.")


class ContextAttention:
    """The attention core of one layer under context parallelism, set as ``Attention._core`` (same call:
    q, k, v [B, H, T/cp, D] after RoPE, and the decoding offset ``pos``, which must be 0: no KV cache under cp).
    A plain callable, not a module: parameter and module names stay those of the single process. ``scale``: the
    layer's softmax scale (None: 1 / sqrt(D)); latent attention's heads arrive expanded (every head's key holds
    the shared RoPE part) and padded to one head size (models/mla.py), so both modes take them as they are."""

    def __init__(self, mode: str, mesh, window: int = 0, scale: float | None = None) -> None:
        self.mode, self.mesh, self.window, self.scale = mode, mesh, window, scale
        self.group_name = None
        if mode == "ring" and mesh.cp_group is not None:  # compiled blocks' ring reports to the mesh's recorder
            self.group_name = mesh.cp_group.group_name
            register_recorder(mesh.cp_group, lambda: self.mesh.recorder)

    def __call__(self, q, k, v, pos: int = 0, docs=None):
        mask = docs.mask if docs is not None else None
        if mask is not None and self.mode == "ring":  # refused at start-up (preflight); a direct caller too
            raise RuntimeError("document masks under context parallelism need parallel.cp_mode=alltoall")
        if pos != 0 or q.shape[2] != k.shape[2]:
            raise RuntimeError("context parallelism splits training sequences; decoding with a KV cache runs on "
                               "one process (parallel.cp=1)")
        if self.mode == "ring":
            return ring_attention(q, k, v, self.mesh.cp_group, self.mesh.recorder, scale=self.scale,
                                  group_name=self.group_name)
        return alltoall_attention(q, k, v, self.mesh.cp_group, self.mesh.recorder, self.window, mask=mask,
                                  scale=self.scale)


def parallelize_context(model: nn.Module, mesh, cfg: Config) -> nn.Module:
    """Split ``model``'s sequence over ``mesh.cp`` in place: every attention core exchanges keys and values (or
    heads) over the cp group, and positions are those of this rank's chunks. No parameter changes."""
    if mesh.cp == 1:
        return model
    mode = choose_mode(cfg)
    for _, block in model.blocks():
        block.attn._core = ContextAttention(mode, mesh, block.attn.window, block.attn.softmax_scale)
    model.seq_positions = SequencePositions(mesh.cp, mesh.cp_rank)
    return model
