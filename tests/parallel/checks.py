"""Assertions on what a world's ranks measured (shared by the CPU and GPU world tests)."""

from __future__ import annotations

from .worlds import VOCAB


def assert_regions(errs: dict[str, float]) -> None:
    bad = {k: v for k, v in errs.items() if v > 1e-5}
    assert not bad, f"tensor-parallel region borders disagree with their definition: {bad}"


def assert_vocab_ce(errs: dict[str, float]) -> None:
    assert errs["loss"] < 1e-5 and errs["loss_3d"] < 1e-5, errs
    assert errs["grad"] < 1e-6 and errs["grad_3d"] < 1e-6, errs
    assert errs["loss_bf16"] < 1e-4 and errs["dtypes_ok"] == 1.0, errs


def assert_collectives(per_rank: list[dict], tp: int) -> None:
    for r, res in enumerate(per_rank):
        assert res["broadcast"] == [float(tp - 1)] * 2  # the source was the group's last rank
        assert res["all_to_all"] == [10.0 * i + r for i in range(tp)]
        scale = tp * (tp + 1) / 2  # rank k contributed (k + 1) * arange
        assert res["reduce_scatter"] == [scale * 2 * r, scale * (2 * r + 1)]
        assert res["rs_input_intact"]
        assert res["recorder"] == ("barrier", 4, False)


def assert_parity(res: dict, tie: bool = True) -> None:
    """Losses within 1e-5 relative at every step; every full gradient of step 1 within float32 tolerance
    of the single-process reference, both as backward left it and after sync_tp_grads."""
    for step, (loss, ref) in enumerate(zip(res["loss"], res["loss_ref"], strict=True)):
        assert abs(loss - ref) <= 1e-5 * abs(ref), f"step {step}: loss {loss} vs reference {ref}"
    names, ref_names = res["grad_names"]
    assert names == ref_names
    bad = {n: e for n, e in res["grad_err"].items() if not (e[2] and e[3])}
    assert not bad, f"gradients differ from the reference (max abs err, max abs ref, ok, ok unsynced): {bad}"
    norm, ref_norm = res["norm"]
    assert abs(norm - ref_norm) <= 1e-5 * ref_norm
    assert res["logits_err"] < 1e-5, res["logits_err"]  # the same weights through both generation paths
    assert res["param_err"] < 1e-4, (res["param_err"], res.get("param_err_at"))  # after 10 AdamW steps (eps 1e-6)
    assert res["tied"] == tie
    if "base_changed" in res:  # LoRA: the frozen base bit-identical, no gradient; every adapter factor moved
        assert res["base_changed"] == [] and res["adapters_trained"], res["base_changed"]


def assert_element_counts(per_rank: list[dict], tp: int, n_kv: int = 2) -> None:
    for res in per_rank:
        for name, (local, full, dim, replicas) in res["numel"].items():
            if dim is None:
                assert local == full, name
            elif replicas > 1:  # one KV head per rank, shared by tp / n_kv ranks
                assert local * n_kv == full and replicas == tp // n_kv, name
            else:
                assert local * tp == full, name
        assert res["numel"]["tok_emb.weight"][0] == VOCAB * 64 // tp
        assert res["numel"]["layers.0.attn.q_proj.weight"][0] == 64 * 64 // tp
        assert res["numel"]["layers.1.mlp.down_proj.weight"][0] == 64 * 128 // tp


def assert_gathered_linears(res: dict) -> None:
    """The sp region node matches F.linear on the gathered sequence within float32 tolerance, and its backward
    issues the re-gather before the grad-input GEMMs and the reduce-scatter before the weight GEMMs."""
    bad = {k: v for k, v in res["errs"].items() if v > 1e-5}
    assert not bad, f"sequence-parallel linears disagree with F.linear on the gathered sequence: {bad}"
    ev = res["events"]
    back = ev[ev.index("all_gather_async"):]
    assert back == ["all_gather_async", "gemm", "gemm", "wait all_gather", "reduce_scatter_async", "gemm", "gemm",
                    "wait reduce_scatter"], ev


def assert_ring_steps(sync: dict, ring: dict) -> None:
    """parallel.async_tp: the regions' all-gathers and reduce-scatters (``sync``: the tp op counts of one step
    without it) became point-to-point ring steps (``ring``); what is left of them is the embedding's
    reduce-scatter (and its backward all-gather)."""
    assert sync.get("send", 0) == 0 and sync["all_gather"] > 4, sync
    assert ring["send"] > 0 and ring["send"] == ring["recv"], ring
    assert ring.get("all_gather", 0) <= 1 and ring.get("reduce_scatter", 0) <= 1, ring
