"""Shard-by-shard construction: a model built on meta, split and pruned there, then `materialize`d holds exactly
the single process's values in each rank's slice, and constructing it never costs more than the shard."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest
import torch

import megaloom.parallel.materialize as materialize_mod
from megaloom.config import load_config
from megaloom.models import init
from megaloom.models.transformer import Transformer
from megaloom.parallel.layout import layout_of
from megaloom.parallel.materialize import materialize
from megaloom.parallel.mesh import Mesh
from megaloom.parallel.pipeline.partition import partition_layers
from megaloom.parallel.pipeline.stage import PipelineStage
from megaloom.parallel.tensor import parallelize_tensor


def _coords(tp: int, pp: int, ep: int):
    for r in range(tp):
        for pr in range(pp):
            for er in range(ep):
                yield dataclasses.replace(Mesh.single(), tp=tp, tp_rank=r, pp=pp, pp_rank=pr, ep=ep, ep_rank=er)


@pytest.mark.parametrize("preset", ["tiny", "tiny-gpt2", "mixtral-tiny"])
def test_every_rank_of_every_layout_holds_the_single_process_values(preset: str, monkeypatch) -> None:
    # Small tiles, so that the tiny models' slices cross row bands and column blocks as large models' do.
    monkeypatch.setattr(init, "TILE_ELEMENTS", 4096)
    monkeypatch.setattr(init, "COLUMN_BLOCK", 48)
    cfg = load_config(None, [f"model.preset={preset}", "model.vocab_size=256"]).model
    torch.manual_seed(3)
    single = dict(Transformer(cfg).named_parameters())
    layouts = [(2, 1, 1), (4, 1, 1), (2, 2, 1), (1, 2, 1)] + ([(2, 1, 2), (1, 2, 4)] if cfg.moe_every else [])
    for tp, pp, ep in layouts:
        for mesh in _coords(tp, pp, ep):
            torch.manual_seed(3)
            with torch.device("meta"):
                model = Transformer(cfg)
            parallelize_tensor(model, mesh, sp=tp > 1)
            if pp > 1:
                PipelineStage(model, partition_layers(cfg.n_layers, pp), mesh.pp_rank)
            materialize(model, torch.device("cpu"), mesh)
            for name, p in model.named_parameters():
                lay = layout_of(p)
                want = lay.shard(single["tok_emb.weight" if lay.tied_copy else name].detach(), mesh.tp_rank, tp,
                                 mesh.ep_rank, ep)
                assert torch.equal(p.detach(), want), (tp, pp, ep, mesh.tp_rank, mesh.pp_rank, mesh.ep_rank, name)
            if cfg.tie_embeddings and model.tok_emb is not None and model.head is not None:
                assert model.head.weight is model.tok_emb.weight


def test_every_box_of_a_tensor_holds_the_full_tensors_values(monkeypatch) -> None:
    """Row slices, column slices and both, of 2-D and 3-D tensors, cut anywhere across the bands and blocks."""
    monkeypatch.setattr(init, "TILE_ELEMENTS", 200)
    monkeypatch.setattr(init, "COLUMN_BLOCK", 16)
    rule = init.InitRule("normal", 0.02)
    for shape in ([37, 50], [5, 7, 40], [9, 12]):
        full = torch.empty(shape)
        assert init.fill_slice(full, shape, [0] * len(shape), rule, 11, "w") == full.numel()
        gen = torch.Generator().manual_seed(len(shape))
        for _ in range(20):
            starts = [int(torch.randint(0, n, (1,), generator=gen)) for n in shape]
            ends = [int(torch.randint(a + 1, n + 1, (1,), generator=gen)) for a, n in zip(starts, shape, strict=True)]
            box = torch.empty([e - a for a, e in zip(starts, ends, strict=True)])
            init.fill_slice(box, shape, starts, rule, 11, "w")
            want = full[tuple(slice(a, e) for a, e in zip(starts, ends, strict=True))]
            assert torch.equal(box, want), (shape, starts, ends)


def test_a_column_slice_draws_only_its_share_of_the_tiles() -> None:
    """A row-parallel weight's tp shard is a slice of columns: it generates the column blocks it overlaps, not
    every tile of the whole tensor (what made a 70B rank's build cost the full model's time)."""
    rule, shape = init.InitRule("normal", 0.02), [1024, 8192]
    full = torch.empty(shape)
    n_full = init.fill_slice(full, shape, [0, 0], rule, 5, "w")
    for k in range(8):  # the 8 ranks of tp=8
        part = torch.empty(1024, 1024)
        assert init.fill_slice(part, shape, [0, 1024 * k], rule, 5, "w") == n_full // 8
        assert torch.equal(part, full[:, 1024 * k:1024 * (k + 1)])
    part = torch.empty(1024, 1000)  # not on block borders: at most one block more on each side
    assert init.fill_slice(part, shape, [0, 700], rule, 5, "w") <= 1024 * (1000 + 2 * init.COLUMN_BLOCK)
    assert torch.equal(part, full[:, 700:1700])


def test_a_tensor_parallel_rank_draws_its_share_of_the_model(monkeypatch) -> None:
    """Building one tp=8 rank of a model with rows wider than a column block draws about 1/8 of the single
    process's random values (row-parallel weights included), and holds exactly its values. Tiles a quarter of the
    real ones on a side (128 x 128): this model's tp=8 slices are 128 rows or columns, as llama3-70b's (1024, 3584)
    are multiples of the real 128-row bands and 512-column blocks."""
    monkeypatch.setattr(init, "COLUMN_BLOCK", init.COLUMN_BLOCK // 4)
    monkeypatch.setattr(init, "TILE_ELEMENTS", init.TILE_ELEMENTS // 4)
    cfg = load_config(None, ["model.preset=tiny", "model.vocab_size=4096", "model.d_model=1024", "model.n_layers=2",
                             "model.n_heads=8", "model.n_kv_heads=8", "model.ffn_dim=4096"]).model
    drawn: list[int] = []
    real = materialize_mod.fill_slice
    monkeypatch.setattr(materialize_mod, "fill_slice", lambda *a: drawn.append(real(*a)) or drawn[-1])

    def build(tp: int) -> Transformer:
        mesh = dataclasses.replace(Mesh.single(), tp=tp, tp_rank=tp - 2 if tp > 1 else 0)
        torch.manual_seed(4)
        with torch.device("meta"):
            model = Transformer(cfg)
        return materialize(parallelize_tensor(model, mesh, sp=False), torch.device("cpu"), mesh)

    single = dict(build(1).named_parameters())
    whole, drawn[:] = sum(drawn), []
    rank = build(8)
    assert sum(drawn) <= 1.02 * whole / 8, (sum(drawn), whole)
    for name, p in rank.named_parameters():
        assert torch.equal(p.detach(), layout_of(p).shard(single[name].detach(), 6, 8, 0, 1)), name


def test_meta_build_draws_the_same_seed_as_a_real_one() -> None:
    cfg = load_config(None, ["model.vocab_size=256"]).model
    torch.manual_seed(11)
    real = Transformer(cfg)
    torch.manual_seed(11)
    with torch.device("meta"):
        meta = Transformer(cfg)
    assert real.init_seed == meta.init_seed
    torch.manual_seed(12)
    assert Transformer(cfg).init_seed != real.init_seed


_PEAK = textwrap.dedent("""
    import dataclasses, json, sys, torch
    from pathlib import Path
    from megaloom.config import load_config
    from megaloom.models.transformer import Transformer
    from megaloom.parallel.materialize import materialize
    from megaloom.parallel.mesh import Mesh
    from megaloom.parallel.tensor import parallelize_tensor

    def status(key):  # VmHWM is this process's own high-water mark (ru_maxrss keeps the forking parent's)
        line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(key + ":"))
        return int(line.split()[1]) * 1024

    tp, meta = int(sys.argv[1]), sys.argv[2] == "meta"
    cfg = load_config(None, ["model.preset=tiny", "model.vocab_size=32768", "model.d_model=1024", "model.n_layers=8",
                             "model.n_heads=8", "model.n_kv_heads=8", "model.ffn_dim=4096"]).model
    mesh = dataclasses.replace(Mesh.single(), tp=tp, tp_rank=tp - 1)
    torch.ones(1024, 1024).sum()  # the allocator and kernels warm before the baseline
    with torch.device("meta"):  # so does torch's own lazy import of dynamo (and sympy, ~90 MB) by meta init
        torch.nn.Embedding(2, 2)
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to the current size
    base = status("VmRSS")
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            model = Transformer(cfg)
        materialize(parallelize_tensor(model, mesh, sp=False), torch.device("cpu"), mesh)
    else:  # the old way: the full model first, then the shards
        model = parallelize_tensor(Transformer(cfg), mesh, sp=False)
    peak = status("VmHWM") - base
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"peak": peak, "shard": shard}))
""")



def _peak(tp: int, how: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PEAK, str(tp), how], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_construction_peak_is_the_shard_not_the_model() -> None:
    """A 168M-parameter model at tp=4: building on meta and materialising costs this rank's shard (+ one 4 MB
    tile and allocator slack), where building the full model first costs the whole model."""
    new, old = _peak(4, "meta"), _peak(4, "full")
    full_bytes = 4 * old["shard"]  # roughly: most of the weights are split four ways
    assert new["peak"] <= new["shard"] * 1.1 + 64 * 2**20, new
    assert old["peak"] > 0.5 * full_bytes, old  # the measurement sees the difference it is meant to catch


def zero3_construction_peak(rank: int, world: int, device) -> dict:
    """ZeRO-3: FSDP2 wraps the model on meta, then each rank allocates and fills its dim-0 share."""
    from megaloom.optim.zero import build_data_parallel
    from tests.checkpoint.sharded_worlds import PeakGrowth

    torch.set_num_threads(1)
    cfg = load_config(None, ["model.preset=tiny", "model.vocab_size=32768", "model.d_model=1024", "model.n_layers=8",
                             "model.n_heads=8", "model.n_kv_heads=8", "model.ffn_dim=4096", "parallel.zero=3",
                             "train.global_batch_size=8", "train.micro_batch_size=4"])
    mesh = Mesh.build(cfg, world, rank, device)
    torch.ones(1024, 1024).sum()
    with PeakGrowth() as peak:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = Transformer(cfg.model)
        build_data_parallel(model, mesh, zero=3)
        materialize(model, device, mesh)
    shard = sum(p.to_local().numel() * 4 for p in model.parameters())
    torch.manual_seed(0)
    single = Transformer(cfg.model)  # after the measurement: the reference values
    same = all(torch.equal(p.full_tensor(), single.get_parameter(n)) for n, p in model.named_parameters())
    return {"peak": peak.bytes, "shard": shard, "same": same}


@pytest.mark.slow
def test_zero3_construction_holds_only_the_dp_share() -> None:
    from tests.parallel.harness import run_world

    for r in run_world(2, zero3_construction_peak, timeout=400):
        assert r["same"], "every rank's FSDP2 shard holds the single process's values"
        assert r["peak"] <= r["shard"] * 1.1 + 64 * 2**20, r  # half the model, not all of it
