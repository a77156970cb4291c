"""Assertions on what a data-parallel world's ranks measured (see dp_worlds.py)."""

from __future__ import annotations

import math

LOSS_RTOL = 1e-5
SHARE_TOL = 0.05  # per-rank bytes within 5% of total / dp


def assert_matches_reference(res: dict) -> None:
    """Loss at every step within 1e-5 relative of the single process; gradient norms too (clipping sees the
    same norm); the final weights close (Adam magnifies float noise of tiny gradients, hence 1e-3)."""
    assert len(res["loss"]) == len(res["ref_loss"]) == 10
    for step, (loss, ref) in enumerate(zip(res["loss"], res["ref_loss"], strict=True)):
        assert abs(loss - ref) <= LOSS_RTOL * abs(ref), f"step {step}: loss {loss} vs reference {ref}"
    for step, (norm, ref) in enumerate(zip(res["norm"], res["ref_norm"], strict=True)):
        assert abs(norm - ref) <= 1e-4 * ref, f"step {step}: grad norm {norm} vs reference {ref}"
    assert res["param_err"] < 1e-3, res["param_err"]


def assert_clipping_active(res: dict) -> None:
    assert math.isfinite(res["clip"]) and min(res["ref_norm"]) > res["clip"], (res["clip"], res["ref_norm"])


def assert_buckets_reduced_once_after_last_microbatch(res: dict) -> None:
    """Counters of the bucket machinery and, independently, the collectives comm saw on the dp group."""
    stats, n_buckets, steps = res["stats"], res["n_buckets"], res.get("counted_steps", len(res["loss"]))
    early = [entry for entry in res["log"] if entry[0] == "early_micro"]
    assert not early, f"collectives on the data-parallel group before the last micro-batch: {early}"
    reductions = [e for e in res["log"] if e[1] in ("all_reduce_sum_async", "reduce_scatter_async")
                  or e[1].startswith("fsdp_reduce_scatter")]
    assert reductions and all(phase == "last_micro" for phase, _ in reductions), reductions
    if res["zero"] == 3:  # FSDP2's own reduce-scatter: counted by the wrapped torch.distributed call
        return
    assert n_buckets > 1  # the tiny bucket size really splits the model
    assert stats["steps"] == steps
    assert stats["per_step"] == [[1] * n_buckets] * steps  # every bucket exactly once per step
    assert stats["in_backward"] == [n_buckets] * steps  # all issued while backward ran (overlap) ...
    assert stats["in_finish"] == [0] * steps  # ... none left for finish()
    assert stats["issued_unarmed"] == 0
    assert stats["unarmed_hooks"] == res["n_params"] * (res["n_micro"] - 1) * steps
    assert len(reductions) == n_buckets * len(res["loss"])


def assert_memory_shares(res: dict) -> None:
    """Optimizer state (exp_avg + exp_avg_sq, fp32) per rank: all of it at zero 0, 1/dp with ZeRO; main
    gradients released by zero 2; parameters 1/dp with zero 3."""
    full_state, dp, zero = 8 * res["numel"], res["dp"], res["zero"]
    if zero == 0:
        assert res["state_bytes"] == full_state
        return
    assert abs(res["state_bytes"] - full_state / dp) <= SHARE_TOL * full_state / dp, (res["state_bytes"], full_state)
    mem = res["memory"]
    if zero == 1:  # the reduced 1/dp chunk is the bucket's own (reduce-scattered in place): no shard buffer
        assert mem["main_grads"] >= 4 * res["numel"] and mem["grad_shard"] == 0, mem
        assert res["grads_in_buckets"], "zero=1: the optimizer's gradient segments must be views of the buckets"
    if zero == 2:
        assert mem["main_grads"] == 0, mem  # between steps only the gradient shard is kept
        assert abs(mem["grad_shard"] - 4 * res["numel"] / dp) <= SHARE_TOL * 4 * res["numel"] / dp
    if zero == 3:
        assert abs(mem["params"] - 4 * res["numel"] / dp) <= SHARE_TOL * 4 * res["numel"] / dp, mem


def assert_case(res: dict) -> None:
    assert_matches_reference(res)
    assert_buckets_reduced_once_after_last_microbatch(res)
    assert_memory_shares(res)
    if math.isfinite(res["clip"]):
        assert_clipping_active(res)
    if "imported_equal" in res:  # started from a model-only checkpoint: its weights exactly, a fresh optimizer
        assert res["imported_equal"] and res["fresh_optimizer"], res
    if "state_err" in res:  # the layout-free optimizer state equals the single process's AdamW/LAMB state
        assert res["state_err"] < 1e-4, res["state_err"]
