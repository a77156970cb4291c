"""Which transformer layers each pipeline stage holds, and the micro-batch counts a schedule can run.

A pipeline of ``pp`` ranks with ``vpp`` virtual stages per rank (the interleaved schedule) cuts the model into
``S = pp * vpp`` virtual stages. Virtual stage ``s`` lives on rank ``s % pp`` as that rank's chunk ``s // pp``:
rank r holds chunks r, r + pp, r + 2 pp, ... (Megatron's interleaving), so consecutive stages are always on
neighbouring ranks and the activations travel round a ring.

By default the layers are split evenly. The first stage also runs the embedding and the last the final norm,
the head and the loss (with a large vocabulary these weigh several layers), so either may be given an explicit
layer count and the remaining layers are spread evenly over the other stages. With ``vpp > 1`` the counts are
the first and last pipeline *rank's* layers, all its chunks together (Llama 3's 126 layers on 16 ranks: 7 on
each end rank, 8 on the others): the other ranks split theirs evenly over their chunks, and an end rank splits
its count as evenly as it can, the chunk at the model's end (the embedding's chunk 0 on the first rank, the
head's last chunk on the last rank) taking the smaller share (7 over 2 chunks: 3 + 4). A multimodal model's first stage
also runs the image encoder: unless the end stages are given counts, it takes fewer decoder layers by the
encoder's cost in decoder blocks (`encoder_block_equivalents`, vpp = 1).

Everything here is pure arithmetic: it runs in the launcher before any process exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from megaloom.config import Config, ConfigError
from megaloom.model_keys.shape import resolved_ffn_dim, resolved_head_dim, resolved_kv_heads
from megaloom.models.registry import reads_images

# The settings that give the first / last stage an explicit layer count (function arguments until the config
# has these keys; errors name them so the message says what to set).
FIRST_KEY = "parallel.pp_first_stage_layers"
LAST_KEY = "parallel.pp_last_stage_layers"
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")


@dataclass(frozen=True)
class Partition:
    """Virtual stage ``s`` holds layers ``range(starts[s], starts[s + 1])`` of the full model."""

    n_layers: int
    pp: int
    vpp: int
    starts: tuple[int, ...]

    @property
    def n_stages(self) -> int:
        return self.pp * self.vpp

    def layers(self, stage: int) -> range:
        return range(self.starts[stage], self.starts[stage + 1])

    def sizes(self) -> list[int]:
        return [len(self.layers(s)) for s in range(self.n_stages)]

    def rank_of(self, stage: int) -> int:
        return stage % self.pp

    def chunk_of(self, stage: int) -> int:
        return stage // self.pp

    def stage_of(self, rank: int, chunk: int) -> int:
        return chunk * self.pp + rank

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        return tuple(self.stage_of(rank, c) for c in range(self.vpp))


def _even_alternatives(n_layers: int, n_stages: int) -> str:
    lo = max(n_stages, n_layers // n_stages * n_stages)
    hi = lo + n_stages if lo <= n_layers else lo
    return f"model.n_layers={lo}" + (f" or {hi}" if hi != lo else "")


def _explicit_hint(n_layers: int, n_stages: int) -> str:
    """A first/last layer count that would make the rest split evenly, if one exists."""
    if n_stages == 2:
        return f"{FIRST_KEY}={n_layers // 2} and {LAST_KEY}={n_layers - n_layers // 2}"
    for k in range(n_layers // n_stages, -1, -1):  # shrink first and last (they carry embedding and head)
        rest = n_layers - 2 * k
        if rest >= n_stages - 2 and rest % (n_stages - 2) == 0:
            return f"{FIRST_KEY}={k} and {LAST_KEY}={k} (the other stages take {rest // (n_stages - 2)} each)"
    return ""


def partition_layers(n_layers: int, pp: int, vpp: int = 1, first_stage_layers: int | None = None,
                     last_stage_layers: int | None = None) -> Partition:
    """Split ``n_layers`` into ``pp * vpp`` virtual stages; see the module docstring."""
    if pp < 1 or vpp < 1:
        raise ConfigError(f"parallel.pp={pp} and parallel.vpp={vpp} must both be >= 1.")
    n_stages = pp * vpp
    if n_stages == 1:
        return Partition(n_layers, pp, vpp, (0, n_layers))
    if vpp > 1 and n_layers < n_stages:
        fits = [v for v in range(1, vpp) if n_layers >= pp * v]
        raise ConfigError(f"parallel.vpp={vpp} with parallel.pp={pp} makes {n_stages} virtual stages, but "
                          f"model.n_layers={n_layers} gives fewer than one layer each; parallel.vpp="
                          f"{fits[-1] if fits else 1} would work (or model.n_layers >= {n_stages}).")
    if first_stage_layers is None and last_stage_layers is None:
        if n_layers % n_stages:
            hint = _explicit_hint(n_layers, n_stages) if vpp == 1 else _interleaved_hint(n_layers, pp, vpp)
            divisors = [d for d in range(1, n_layers + 1) if n_layers % d == 0 and d % pp == 0]
            raise ConfigError(
                f"model.n_layers={n_layers} does not split evenly into parallel.pp*vpp = {pp}*{vpp} = {n_stages} "
                f"stages. What would work: {_even_alternatives(n_layers, n_stages)}"
                + (f"; pp*vpp in {divisors}" if divisors else "")
                + (f"; or give the end stages explicit counts, e.g. {hint}" if hint else "") + ".")
        sizes = [n_layers // n_stages] * n_stages
    elif vpp == 1:
        sizes = _explicit_sizes(n_layers, n_stages, first_stage_layers, last_stage_layers)
    else:
        sizes = _interleaved_sizes(n_layers, pp, vpp, first_stage_layers, last_stage_layers)
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    return Partition(n_layers, pp, vpp, tuple(starts))


def _explicit_sizes(n_layers: int, n_stages: int, first: int | None, last: int | None) -> list[int]:
    _check_range(n_layers, first, last)
    fixed = (first or 0) + (last or 0)
    free = n_stages - (first is not None) - (last is not None)
    rest = n_layers - fixed
    if rest < 0 or (free == 0 and rest != 0) or (free > 0 and (rest < free or rest % free)):
        hint = _explicit_hint(n_layers, n_stages)
        given = " and ".join(f"{k}={v}" for k, v in ((FIRST_KEY, first), (LAST_KEY, last)) if v is not None)
        raise ConfigError(
            f"{given} leave(s) {rest} of model.n_layers={n_layers} layers for the "
            f"other {free} stage(s), which must split evenly with at least one layer each"
            + (f"; e.g. {hint} would work." if hint else "."))
    middle = rest // free if free else 0
    sizes = [middle] * n_stages
    if first is not None:
        sizes[0] = first
    if last is not None:
        sizes[-1] = last
    return sizes


def _check_range(n_layers: int, first: int | None, last: int | None) -> None:
    for key, value in ((FIRST_KEY, first), (LAST_KEY, last)):
        if value is not None and not 0 <= value <= n_layers:
            raise ConfigError(f"{key}={value} must be between 0 and model.n_layers={n_layers}.")


def _interleaved_ranks(n_layers: int, pp: int, vpp: int, first: int | None, last: int | None) -> list[int] | None:
    """Layers per pipeline rank (all chunks) for end-rank counts under interleaving, or None if they do not work:
    the other ranks share the rest equally, in a multiple of vpp each (an even split over their chunks); every
    chunk holds at least one layer, so an end rank needs vpp layers at least."""
    given = (first is not None) + (last is not None)
    rest = n_layers - (first or 0) - (last or 0)
    free = pp - given
    if rest < 0 or (free == 0 and rest) or (free and (rest % free or (rest // free) % vpp or rest // free < vpp)):
        return None
    if any(v is not None and v < vpp for v in (first, last)):
        return None
    ranks = [rest // free if free else 0] * pp
    if first is not None:
        ranks[0] = first
    if last is not None:
        ranks[-1] = last
    return ranks


def _interleaved_hint(n_layers: int, pp: int, vpp: int) -> str:
    """End-rank counts (equal, as large as balance allows) with which the interleaved split works, if any."""
    for k in range(n_layers // pp, vpp - 1, -1):
        first, last = (k, n_layers - k) if pp == 2 else (k, k)
        if _interleaved_ranks(n_layers, pp, vpp, first, last) is not None:
            other = "" if pp == 2 else f" (the other ranks take {(n_layers - 2 * k) // (pp - 2)} each)"
            return f"{FIRST_KEY}={first} and {LAST_KEY}={last}{other}"
    return ""


def end_stage_options(n_layers: int, pp: int, vpp: int) -> list[tuple[int, int]]:
    """The end-stage counts a layout search tries for ``pp`` x ``vpp``: [(0, 0)] (the settings left at 0: the
    even split) where the layers divide; else the (first, last) that works with the lightest busiest rank (a
    pipeline runs at its slowest stage's pace), then the most equal ends, the last rank (which also runs the head
    and the loss) no heavier than the first; [] if nothing works."""
    if n_layers < pp * vpp:
        return []
    if pp == 1 or n_layers % (pp * vpp) == 0:
        return [(0, 0)]
    best: tuple | None = None
    bound = min(n_layers, 2 * -(-n_layers // pp))
    for first in range(1, bound + 1):  # 0 would read as "balanced" (the settings' default)
        for last in range(1, min(bound, n_layers - first) + 1):
            ranks = _interleaved_ranks(n_layers, pp, vpp, first, last)
            if ranks is not None:
                key = (max(ranks), abs(first - last), last > first)
                if best is None or key < best[0]:
                    best = (key, (first, last))
    return [best[1]] if best else []


def _interleaved_sizes(n_layers: int, pp: int, vpp: int, first: int | None, last: int | None) -> list[int]:
    """Virtual-stage sizes for end-rank counts under interleaving (module doc)."""
    _check_range(n_layers, first, last)
    if pp < 2:
        raise ConfigError(f"{FIRST_KEY} / {LAST_KEY} need parallel.pp >= 2 (got pp={pp}, vpp={vpp}).")
    ranks = _interleaved_ranks(n_layers, pp, vpp, first, last)
    if ranks is None:
        hint = _interleaved_hint(n_layers, pp, vpp)
        given = " and ".join(f"{k}={v}" for k, v in ((FIRST_KEY, first), (LAST_KEY, last)) if v is not None)
        raise ConfigError(
            f"{given} with parallel.pp={pp} and parallel.vpp={vpp}: the counts are the end pipeline ranks' layers "
            f"(all {vpp} chunks together, at least one a chunk); the other ranks must share the remaining "
            f"{n_layers - (first or 0) - (last or 0)} of model.n_layers={n_layers} equally, in a multiple of "
            f"vpp={vpp} each" + (f"; e.g. {hint} would work." if hint else "."))
    sizes = [0] * (pp * vpp)
    for rank, total in enumerate(ranks):
        base, extra = divmod(total, vpp)
        if rank == 0 and first is not None:  # the embedding's chunk 0 takes the smaller share
            chunks = [base + (c >= vpp - extra) for c in range(vpp)]
        else:  # the last rank's head chunk (the last) takes the smaller share; the others split evenly
            chunks = [base + (c < extra) for c in range(vpp)]
        for c, n in enumerate(chunks):
            sizes[c * pp + rank] = n
    return sizes


def check_schedule_choice(schedule: str, pp: int, vpp: int) -> None:
    """The schedule exists and fits vpp (only the interleaved schedule runs several chunks per rank)."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"parallel.schedule={schedule!r} is not a pipeline schedule; choose one of "
                          f"{', '.join(SCHEDULES)}.")
    if vpp > 1 and schedule != "interleaved":
        raise ConfigError(f"parallel.vpp={vpp} needs parallel.schedule=interleaved (parallel.schedule={schedule} "
                          f"runs one model chunk per pipeline rank); or set parallel.vpp=1.")


def check_microbatches(schedule: str, pp: int, vpp: int, global_batch_size: int, micro_batch_size: int,
                       dp: int = 1) -> int:
    """The number of micro-batches per step (per data-parallel rank); raises if the schedule cannot run it."""
    check_schedule_choice(schedule, pp, vpp)
    per_step = micro_batch_size * dp
    m = global_batch_size // per_step if per_step else 0
    if m < 1:
        raise ConfigError(f"train.global_batch_size={global_batch_size} gives no micro-batch of "
                          f"train.micro_batch_size={micro_batch_size} per data-parallel rank (dp={dp}); "
                          f"train.global_batch_size={per_step} or more would work.")
    if schedule == "interleaved" and pp > 1 and m % pp:
        step = per_step * pp
        lo = max(step, global_batch_size // step * step)
        raise ConfigError(
            f"parallel.schedule=interleaved needs the micro-batches per step (train.global_batch_size / "
            f"(train.micro_batch_size * dp) = {global_batch_size} / ({micro_batch_size} * {dp}) = {m}) to be a "
            f"multiple of parallel.pp={pp} (micro-batches go through each model chunk in groups of pp); "
            f"train.global_batch_size={lo} or {lo + step} would work, or parallel.schedule=1f1b.")
    return m


def validate_pipeline(cfg: Config, dp: int, first_stage_layers: int | None = None,
                      last_stage_layers: int | None = None) -> Partition:
    """Every pipeline check for a config, before any process group: partition, schedule, micro-batches."""
    p, t = cfg.parallel, cfg.train
    check_microbatches(p.schedule, p.pp, p.vpp, t.global_batch_size, t.micro_batch_size, dp)
    if reads_images(cfg.model) and first_stage_layers is None and last_stage_layers is None and p.vpp == 1:
        balanced = encoder_balanced(cfg.model.n_layers, p.pp, encoder_block_equivalents(cfg))
        if balanced is not None:
            return balanced
    return partition_layers(cfg.model.n_layers, p.pp, p.vpp, first_stage_layers, last_stage_layers)


def encoder_block_equivalents(cfg: Config) -> float:
    """A multimodal model's image encoder and projector, run on the first pipeline stage: their matmul FLOPs per
    row (data.max_images images, the most a row holds) in units of one decoder block's (attention scores
    included). Dense MLP width for MoE decoders: an estimate for balancing, not an accounting."""
    m, seq = cfg.model, cfg.train.seq_len
    hd = resolved_head_dim(m)
    kv = resolved_kv_heads(m)
    ffn = resolved_ffn_dim(m)
    block = (seq * (m.d_model * (2 * m.n_heads + 2 * kv) * hd + 3 * m.d_model * ffn)
             + 2 * seq * seq * m.n_heads * hd)
    dv, vffn = m.vision_d_model, m.vision_ffn_dim or 4 * m.vision_d_model
    patches = (m.image_size // m.patch_size) ** 2
    tokens = patches + int(m.vision_cls)
    per_image = (m.vision_layers * tokens * (4 * dv * dv + 2 * dv * vffn + 2 * tokens * dv)
                 + patches * (dv * m.d_model + m.d_model * m.d_model))
    return cfg.data.max_images * per_image / block


def encoder_balanced(n_layers: int, pp: int, encoder_blocks: float) -> Partition | None:
    """The layers per stage when the first stage also runs an image encoder worth ``encoder_blocks`` decoder
    blocks: it takes that many (rounded) fewer than an even share, the others share the rest (differing by one
    at most, the later stages taking the extra ones). None when the encoder is worth less than half a block
    (the even split stands)."""
    fewer = round(encoder_blocks)
    if fewer < 1 or pp < 2:
        return None
    first = max(1, n_layers // pp - fewer)
    rest = n_layers - first
    if rest < pp - 1:
        return None
    base, extra = divmod(rest, pp - 1)
    sizes = [first] + [base + (i >= pp - 1 - extra) for i in range(pp - 1)]
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    return Partition(n_layers, pp, 1, tuple(starts))
