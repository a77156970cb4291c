"""parallel.cp and parallel.cp_mode before anything runs: the mode auto picks, each unsupported combination's
one-line refusal, and the memory plan / `megaloom memory` at cp (activations per rank / cp)."""

from __future__ import annotations

import pytest

from megaloom.config import ConfigError, load_config
from megaloom.parallel.context import choose_mode
from megaloom.planning.memory_fit import memory_command
from megaloom.planning.memory_plan import plan_memory
from megaloom.preflight import preflight

SMALL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=128",
         "model.vocab_size=512", "train.seq_len=64", "train.global_batch_size=8", "train.micro_batch_size=2"]


def cfg(*extra: str):
    return load_config(None, [*SMALL, *extra])


@pytest.mark.parametrize("extra,mode", [
    (["parallel.cp=2"], "alltoall"),  # 4 query and 2 kv heads: both divide 2
    (["parallel.cp=4"], "ring"),  # 2 kv heads do not divide 4
    (["parallel.cp=2", "parallel.tp=2"], "ring"),  # 1 kv head per tp rank
    (["parallel.cp=2", "parallel.cp_mode=ring"], "ring"),
])
def test_auto_picks_alltoall_when_the_heads_divide(extra, mode):
    assert choose_mode(cfg(*extra)) == mode


@pytest.mark.parametrize("world,extra,fragment", [
    (2, ["parallel.cp=2", "train.seq_len=66"], "not divisible by 4; train.seq_len=64 or 68"),
    (4, ["parallel.cp=4", "parallel.cp_mode=alltoall"], "parallel.cp_mode=ring"),
    (2, ["parallel.cp=2", "parallel.cp_mode=ring", "model.sliding_window=16"], "parallel.cp_mode=alltoall"),
    (2, ["parallel.cp=2", "model.dropout=0.1"], "model.dropout=0"),
    (4, ["parallel.cp=2", "parallel.ep=2", "model.preset=mixtral-tiny"], "model.aux_loss_weight"),
    (8, ["parallel.cp=2", "parallel.tp=4", "parallel.sp=true", "train.seq_len=36"], "divisible by 16"),
    (2, ["parallel.cp_mode=rng"], "parallel.cp_mode"),
    (2, ["parallel.cp=2", "parallel.cp_mode=ring", "data.document_mask=true"], "parallel.cp_mode=alltoall"),
])
def test_unsupported_combinations_are_refused_by_name(world, extra, fragment):
    with pytest.raises(ConfigError, match=fragment):
        preflight(cfg(*SMALL[-1:], *extra), world)


def test_supported_layouts_pass_preflight():
    assert preflight(cfg("parallel.cp=2"), 2).sizes["cp"] == 2
    assert preflight(cfg("parallel.cp=2", "parallel.cp_mode=alltoall", "model.sliding_window=16"), 2)
    assert preflight(cfg("parallel.cp=2", "parallel.cp_mode=alltoall", "data.document_mask=true"), 2)
    assert preflight(cfg("parallel.cp=2", "parallel.cp_mode=ring", "data.reset_positions=true"), 2)
    moe = ["model.preset=deepseek-v3-tiny", "model.n_kv_heads=0", "parallel.ep=2", "parallel.cp=2"]  # aux-loss-free
    assert preflight(cfg(*moe), 4).sizes == dict(world=4, tp=1, pp=1, cp=2, dp=2, ep=2, edp=2)
    mla = ["model.preset=deepseek-v3-tiny", "model.n_kv_heads=0", "parallel.cp=2", "parallel.tp=2"]  # latent attention
    assert preflight(cfg(*mla, "parallel.cp_mode=alltoall"), 4).sizes["cp"] == 2


def test_memory_plan_divides_activations_by_cp():
    # (auto would fuse the loss at cp=1 only, on a GPU; eager blocks: the compiled save-set at cp is checked in the
    # cp world, test_context_world.py)
    plain = ["train.fused_loss=false", "train.compile=false"]
    one = plan_memory(cfg(*plain), world_size=1, device="cuda")
    two = plan_memory(cfg("parallel.cp=2", *plain), world_size=2, device="cuda")
    assert two.activations == pytest.approx(one.activations / 2, rel=0.02)
    assert two.weights == one.weights  # cp splits tokens, not weights
    vocab = "model.vocab_size=8192"  # `megaloom memory` checks the vocabulary against the default tokenizer
    out = memory_command(cfg("parallel.cp=2", vocab), 2, None)
    assert "cp=2" in out
    with pytest.raises(ConfigError, match="train.seq_len"):
        memory_command(cfg("parallel.cp=2", "train.seq_len=66", vocab), 2, None)
