"""Layout validation and rank -> coordinate arithmetic: pure, no processes."""

from __future__ import annotations

import itertools

import pytest

from megaloom.config import ConfigError, load_config
from megaloom.parallel.mesh import DIMS, Mesh, parse_order, rank_coords, validate_layout


def cfg(*overrides: str):
    base = ["model.vocab_size=128", "model.d_model=64", "model.n_layers=2", "model.n_heads=4",
            "model.n_kv_heads=2", "model.ffn_dim=128", "model.max_seq_len=32", "train.seq_len=16",
            "train.micro_batch_size=1", "train.global_batch_size=8"]
    return load_config(None, base + list(overrides))


def test_valid_layout_returns_sizes() -> None:
    sizes = validate_layout(cfg("parallel.tp=2", "parallel.pp=2", "parallel.ep=2"), 8)
    assert sizes == dict(world=8, tp=2, pp=2, cp=1, dp=2, ep=2, edp=1)
    # tp > n_kv_heads is allowed when n_kv_heads divides tp (KV heads are replicated).
    assert validate_layout(cfg("parallel.tp=4", "parallel.sp=true"), 4)["dp"] == 1


@pytest.mark.parametrize("overrides,world,needles", [
    (["parallel.tp=4"], 6, ["parallel.tp*pp*cp", "world size 6", "1, 2, 3, 6"]),
    (["parallel.tp=8"], 8, ["model.n_heads=4", "parallel.tp values this model supports: 1, 2, 4"]),
    (["model.d_model=96", "model.n_heads=6", "model.n_kv_heads=3", "model.ffn_dim=192",
      "model.vocab_size=384", "parallel.tp=2"], 2, ["model.n_kv_heads=3", "supports: 1, 3, 6"]),
    (["model.ffn_dim=130", "parallel.tp=4"], 4, ["MLP width 130", "model.ffn_dim=132"]),
    (["model.vocab_size=130", "parallel.tp=4"], 4, ["model.vocab_size=130", "model.vocab_size=256"]),
    (["train.seq_len=18", "parallel.tp=4", "parallel.sp=true"], 4, ["train.seq_len=18", "16 or 20",
                                                                     "parallel.sp=false"]),
    (["parallel.tp=2", "parallel.ep=4"], 4, ["parallel.ep=4", "data-parallel size 2", "would work: 1, 2"]),
    (["train.micro_batch_size=2", "train.global_batch_size=12"], 4, ["train.global_batch_size=12",
                                                                      "= 8", "8 or 16"]),
])
def test_layout_errors_name_the_setting_and_what_works(overrides: list[str], world: int,
                                                       needles: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        validate_layout(cfg(*overrides), world)
    for needle in needles:
        assert needle in str(err.value), str(err.value)
    assert isinstance(err.value, ValueError)


def test_world8_tp2_pp2_groups() -> None:
    sizes = dict(tp=2, pp=2, cp=1, dp=2, ep=1)
    layout = Mesh.layout(8, sizes)
    assert layout["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout["cp"] == [[r] for r in range(8)]
    assert layout["dp_cp"] == layout["dp"]
    coords = [tuple(rank_coords(r, sizes).values()) for r in range(8)]
    assert len(set(coords)) == 8
    assert rank_coords(5, sizes) == dict(pp=1, dp=0, cp=0, tp=1)


def test_expert_groups_are_carved_out_of_dp() -> None:
    layout = Mesh.layout(8, dict(tp=1, pp=1, cp=1, dp=8, ep=4))
    assert layout["ep"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    layout = Mesh.layout(8, dict(tp=2, pp=1, cp=1, dp=4, ep=2))
    assert layout["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout["edp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_custom_order_puts_tp_outermost() -> None:
    sizes = dict(tp=2, pp=2, cp=1, dp=2, ep=1)
    layout = Mesh.layout(8, sizes, order="tp-cp-dp-pp")
    assert layout["tp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout["pp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ConfigError, match="pp, dp, cp, tp exactly once"):
        parse_order("pp-dp-tp")


@pytest.mark.parametrize("order", ["pp-dp-cp-tp", "dp-pp-tp-cp"])
@pytest.mark.parametrize("pp,dp,cp,tp,ep",
                         [(2, 2, 2, 2, 2), (1, 4, 1, 4, 4), (4, 1, 2, 2, 1), (1, 6, 1, 2, 3)])
def test_every_kind_partitions_the_world(order: str, pp: int, dp: int, cp: int, tp: int, ep: int) -> None:
    sizes = dict(pp=pp, dp=dp, cp=cp, tp=tp, ep=ep)
    world = pp * dp * cp * tp
    layout = Mesh.layout(world, sizes, order)
    coords = {r: rank_coords(r, sizes, order) for r in range(world)}
    assert len({tuple(c.values()) for c in coords.values()}) == world
    expect = dict(tp=tp, cp=cp, dp=dp, pp=pp, dp_cp=dp * cp, ep=ep, edp=dp // ep * cp)
    for kind, groups in layout.items():
        assert sorted(itertools.chain(*groups)) == list(range(world)), kind
        assert all(len(g) == expect[kind] for g in groups), kind
    for d in DIMS:  # inside a group only that coordinate moves, and a rank's index is its coordinate
        for g in layout[d]:
            assert [coords[r][d] for r in g] == list(range(sizes[d]))
            others = {tuple(v for k, v in coords[r].items() if k != d) for r in g}
            assert len(others) == 1


def test_single_mesh_and_world_of_one() -> None:
    single = Mesh.single()
    assert (single.tp, single.pp, single.dp, single.cp, single.ep) == (1, 1, 1, 1, 1)
    assert single.tp_group is None and single.dp_cp_group is None
    assert single.is_first_stage and single.is_last_stage
    built = Mesh.build(cfg(), 1, 0, "cpu")  # needs no torch.distributed
    assert built.tp_group is None and built.sizes == single.sizes
