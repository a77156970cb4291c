"""Everything between ``data.*`` settings and an indexable train/valid dataset.

The building blocks live in their own modules and are re-exported here:
``PackedDataset`` (packed.py), ``shuffled_index``/``ShuffledDataset`` (shuffle.py), ``BlendedDataset``
(blend.py). Sample ``i`` of either split depends only on (data files, seq_len, seed, split, weights),
never on how many samples were requested, which is what makes resuming a run exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from megaloom.data.blend import BlendedDataset, cached_blend_plan, normalize_weights
from megaloom.data.cache import short_hash
from megaloom.data.corpus import cache_root, prepare_default
from megaloom.data.errors import DataError
from megaloom.data.indexed import IndexedTokens
from megaloom.data.packed import PackedDataset
from megaloom.data.provenance import check_tokenizer
from megaloom.data.shuffle import ShuffledDataset, shuffled_index
from megaloom.data.split import split_ranges
from megaloom.data.token_range import check_token_ids
from megaloom.data.tokenizer import Tokenizer

if TYPE_CHECKING:
    from megaloom.config import DataConfig

__all__ = ["BlendedDataset", "PackedDataset", "ShuffledDataset", "SizeOnly", "build_datasets", "shuffled_index"]

# Bumped when the cached sample indices' layout changes (the order of samples for a seed must never change).
INDEX_VERSION = 2


class SizeOnly:
    """The length of a dataset this rank never reads (a middle pipeline stage): no index, no tokens."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        raise RuntimeError("this rank reads no tokens (a middle pipeline stage): its dataset holds only a length")


def _index_cache_file(folder: Path, tokens: IndexedTokens, role: str, doc_range: tuple[int, int],
                      seq_len: int, seed: int, split: str, n_needed: int) -> Path:
    """Cache name keyed on everything the shuffled index depends on, including the data file's identity."""
    st = tokens.bin_path.stat()
    key = short_hash(str(Path(tokens.prefix).resolve()), st.st_size, st.st_mtime_ns, role, doc_range,
                     seq_len, seed, split, n_needed)
    return folder / f"{Path(tokens.prefix).name}-{role}-{key}.npy"


def _same_file(a: Path, b: Path) -> bool:
    """Same path, or identical content (a run resumed where the cache lives elsewhere)."""
    try:
        return a.resolve() == b.resolve() or a.read_bytes() == b.read_bytes()
    except OSError:
        return False


def resolve_sources(cfg: DataConfig, root: Path) -> tuple[list[str], Tokenizer]:
    if not cfg.paths:
        tok_path, prefix = prepare_default(root, cfg.default_vocab_size)
        # A saved run config names the default tokenizer explicitly; anything else cannot match the
        # default corpus, whose tokens were made by its own tokenizer.
        if cfg.tokenizer and not _same_file(Path(cfg.tokenizer).expanduser(), tok_path):
            raise DataError(f"data.tokenizer is set ({cfg.tokenizer}) but data.paths is empty: the embedded "
                            f"default corpus is tokenized with its own tokenizer ({tok_path}); clear "
                            "data.tokenizer, or preprocess your data with it (`megaloom preprocess`) and set "
                            "data.paths")
        return [prefix], Tokenizer.from_file(tok_path)
    # Token files made by `megaloom preprocess` without --tokenizer use the default tokenizer.
    tok_path = Path(cfg.tokenizer) if cfg.tokenizer else prepare_default(root, cfg.default_vocab_size)[0]
    tok = Tokenizer.from_file(tok_path)
    setting = "data.tokenizer" if cfg.tokenizer else "the default tokenizer (data.tokenizer empty)"
    for prefix in cfg.paths:
        t = IndexedTokens(prefix)  # the header's vocabulary first: the most specific message
        if t.vocab_size > tok.vocab_size:
            raise DataError(f"token file {t.idx_path} was made with a vocabulary of {t.vocab_size} but "
                            f"the tokenizer {tok.path} has {tok.vocab_size}: they do not match; set "
                            "data.tokenizer to the tokenizer used by `megaloom preprocess`, or re-run it "
                            "with this one")
        check_tokenizer(prefix, tok_path, tok.vocab_size, setting)
    return list(cfg.paths), tok


def source_prefixes(cfg: DataConfig) -> list[str]:
    """The token-file prefixes ``data.*`` trains on: data.paths, or the default corpus's (built on first use; the
    datasets were built before this is asked, so it is found in the cache)."""
    return list(cfg.paths) if cfg.paths else [prepare_default(cache_root(cfg.cache_dir), cfg.default_vocab_size)[1]]


def _blend(parts: list[PackedDataset], tokens: list[IndexedTokens], weights: list[float], n: int, seed: int,
           role: str, seq_len: int, split: str, folder: Path) -> BlendedDataset:
    if len(parts) == 1:
        plan, counts = None, np.array([n])
    else:
        stem = folder / f"blend-{role}-{short_hash(INDEX_VERSION, weights, n)}"
        plan = cached_blend_plan(weights, n, stem)
        counts = _plan_counts(plan[0], plan[1], len(parts))
    shuffled = [
        ShuffledDataset(part, int(c), seed,
                        _index_cache_file(folder, tok, role, part.doc_range, seq_len, seed, split, int(c)))
        for part, tok, c in zip(parts, tokens, counts, strict=True)
    ]
    return BlendedDataset(shuffled, weights, n, plan=plan, counts=counts)


def _plan_counts(ids: np.ndarray, local: np.ndarray, n_datasets: int) -> np.ndarray:
    """Samples the plan takes from each dataset: one more than the last local index of each, found from the end
    of the plan (each dataset stays within a sample of its share, so its last use is near the end)."""
    counts = np.zeros(n_datasets, dtype=np.int64)
    found = np.zeros(n_datasets, dtype=bool)
    end, step = len(ids), 1 << 16
    while end > 0 and not found.all():
        lo = max(0, end - step)
        block_ids, block_local = np.asarray(ids[lo:end]), np.asarray(local[lo:end])
        for d in np.flatnonzero(~found):
            hits = np.flatnonzero(block_ids == d)
            if len(hits):
                counts[d], found[d] = block_local[hits[-1]] + 1, True
        end, step = lo, step * 2
    return counts


def build_datasets(cfg: DataConfig, seq_len: int, seed: int, n_train: int, n_valid: int, *,
                   reads_data: bool = True) -> tuple[BlendedDataset | SizeOnly, BlendedDataset | SizeOnly, Tokenizer]:
    """(train with exactly ``n_train`` samples, valid with ``n_valid``, tokenizer) from ``data.*`` settings.

    Each dataset is split by documents, shuffled epoch by epoch (valid with ``seed + 1``) and the
    datasets are blended by ``data.weights`` (default: by token count). The shuffled indices and the blend
    plan are cached under ``<cache>/indices``, written once and memory-mapped by every process that reads
    them; the token files are memory-mapped too, and a sample's tokens are read when it is. ``reads_data=False``
    (a middle pipeline stage) returns only the tokenizer and the lengths: nothing is opened, built or written.
    """
    root = cache_root(cfg.cache_dir)
    paths, tok = resolve_sources(cfg, root)
    if not reads_data:
        return SizeOnly(n_train), SizeOnly(n_valid), tok
    if cfg.weights and len(cfg.weights) != len(paths):
        raise DataError(f"data.weights has {len(cfg.weights)} entries but data.paths has {len(paths)}; "
                        "give one weight per path, or leave data.weights empty to weight by token count")
    all_tokens = [IndexedTokens(p) for p in paths]
    weights = normalize_weights(cfg.weights or [t.n_tokens for t in all_tokens])
    # Zero-weight datasets are never sampled, so they need not even be large enough to split.
    active = [(t, w) for t, w in zip(all_tokens, weights, strict=True) if w > 0]
    tokens, weights = [t for t, _ in active], [w for _, w in active]

    folder = root / "indices"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create the index cache folder {folder} ({e}); set data.cache_dir or "
                        "$MEGALOOM_CACHE to a writable folder") from e
    for t in tokens:  # ids beyond the vocabulary: an error here, not an IndexError at step 1 (cached per file)
        check_token_ids(t, folder, tok.vocab_size)

    ranges = [split_ranges(t.n_docs, cfg.split) for t in tokens]
    datasets = []
    for role, n, role_seed in (("train", n_train, seed), ("valid", n_valid, seed + 1)):
        if n == 0:
            datasets.append(BlendedDataset([[]] * len(tokens), weights, 0))
            continue
        parts = []
        for t, r in zip(tokens, ranges, strict=True):
            first, last = r[role]
            if first == last:
                raise DataError(f"data.split={cfg.split!r} leaves the {role} split of {t.prefix} empty "
                                f"({t.n_docs} documents in total); choose a split that gives every part at "
                                "least one document, e.g. '90,10'")
            parts.append(PackedDataset(t, seq_len, r[role], split=role))
        datasets.append(_blend(parts, tokens, weights, n, role_seed, role, seq_len, cfg.split, folder))
    return datasets[0], datasets[1], tok
