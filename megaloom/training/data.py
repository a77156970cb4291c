"""The datasets of one rank of a job: the sample index built by one process, memory-mapped by the others.

`build_datasets` writes its shuffled indices and blend plan to the cache once and memory-maps them; here the
ranks take turns so that one process writes each file: global rank 0 first, then (after a barrier on a host-side
gloo group) the first rank of every other node that reads data (a node-local cache directory gets its own copy, a
shared one is found already built), then everyone else. Middle pipeline stages read no tokens: they load only
the tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from megaloom.data.dataset import build_datasets
from megaloom.models.registry import reads_images

if TYPE_CHECKING:
    from megaloom.config import Config, DataConfig
    from megaloom.parallel.host_group import HostGroup
    from megaloom.runtime import Runtime


def default_builder(cfg: Config, text: Callable = build_datasets) -> Callable:
    """``text`` (`build_datasets`: token files), or for a model with an image encoder the image-text datasets
    (data/image_text/) with its image settings bound, or the packed conversations of data.format=chat
    (data/chat/)."""
    if reads_images(cfg.model):
        from megaloom.data.image_text.build import build_image_text_datasets

        return partial(build_image_text_datasets, model=cfg.model)
    if cfg.data.format == "chat":
        from megaloom.data.chat.dataset import build_chat_datasets

        return build_chat_datasets
    return text


def load_rank_datasets(build: Callable | None, data: DataConfig, seq_len: int, seed: int, n_train: int,
                       n_valid: int, rt: Runtime, reads_data: bool, default: Callable = build_datasets,
                       host: HostGroup | None = None) -> tuple:
    """(train, valid, tokenizer) for this rank. ``build``: a `build_datasets` stand-in (a dry run's synthetic
    tokens), called as is on every rank; None builds from ``data`` with ``default`` (`build_datasets`) in the three
    turns above. Collective when the world has more than one rank: two barriers on ``host``, a gloo group with a
    long timeout (the trainer's checkpoint group), never on the default group, whose NCCL has no CPU backend and
    whose training timeout a large index build must not trip (the watchdog is not armed yet)."""
    if build is not None:
        return build(data, seq_len, seed, n_train, n_valid)

    def load(reads: bool) -> tuple:
        return default(data, seq_len, seed, n_train, n_valid, reads_data=reads)

    if rt.world_size == 1:
        return load(reads_data)
    if host is None:
        raise ValueError("load_rank_datasets: a world of several ranks meets on a host-side group (host=)")
    out = None
    if rt.rank == 0:
        out = load(True)  # rank 0 is on the first pipeline stage: it always reads data
    host.barrier()
    if out is None and rt.local_rank == 0 and reads_data:
        out = load(True)
    host.barrier()
    return out if out is not None else load(reads_data)
