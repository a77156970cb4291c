"""QK-clip (MuonClip, megaloom/optim/qk_clip.py) on one process: the attention's logit measurement against the
scores written out, a head with large logits clipped to tau by the step, the other heads left alone, and the
refused combinations. The layouts (tp2, dp2 ZeRO-1, tp4) against this process: tests/parallel/test_muon_world.py."""

from __future__ import annotations

import pytest
import torch

from megaloom.config import ConfigError, load_config
from megaloom.data.objective import inputs_and_labels
from megaloom.models.attention import Attention, attention_mask, head_logit_max
from megaloom.models.registry import get_family
from megaloom.optim.muon import build_muon
from megaloom.optim.qk_clip import install_qk_clip, scale_head_rows
from megaloom.parallel.mesh import Mesh
from tests.parallel.worlds import SEQ, VOCAB, tiny_config


def _brute(q, k, scale, mask):
    reps = q.shape[1] // k.shape[1]
    s = (q.double() @ k.double().repeat_interleave(reps, dim=1).transpose(-2, -1)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s.amax(dim=(0, 2, 3)).float()


@pytest.mark.parametrize(("window", "causal", "chunk"), [(0, True, 1 << 24), (0, True, 37), (5, True, 50),
                                                         (0, False, 64)])
def test_head_logit_max_equals_the_scores_written_out(window, causal, chunk):
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 6, 24, 8, generator=g), torch.randn(2, 3, 24, 8, generator=g)
    q[:, 0, 3] *= 40  # one early query large: counted only where it may attend
    k[:, 1, 20] *= 40  # a late key, invisible to early queries under the causal mask
    mask = attention_mask(24, 24, 0, window, q.device) if causal else None
    got = head_logit_max(q, k, 0.3, window=window, causal=causal, chunk_elements=chunk)
    torch.testing.assert_close(got, _brute(q, k, 0.3, mask), rtol=1e-5, atol=1e-5)


def test_head_logit_max_respects_a_dense_document_mask():
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, 2, 16, 4, generator=g), torch.randn(1, 2, 16, 4, generator=g)
    doc = torch.tensor([0] * 8 + [1] * 8)
    mask = (doc[:, None] == doc[None, :]) & attention_mask(16, 16, 0, 0, q.device)
    k[0, :, 2] *= 50  # in the first document: the second document's queries may not see it
    got = head_logit_max(q, k, 0.5, mask=mask[None, None], chunk_elements=20)
    torch.testing.assert_close(got, _brute(q, k, 0.5, mask[None, None]), rtol=1e-5, atol=1e-5)


def test_scale_head_rows_scales_each_piece_of_a_segmented_parameter():
    full = torch.arange(24.0)  # 3 heads of 8 elements (2 rows of 4)
    want = full * torch.tensor([1.0, 0.5, 2.0]).repeat_interleave(8)
    for start, stop in ((0, 5), (5, 17), (17, 24)):  # ZeRO-like segments cutting through heads
        scale_head_rows(full[start:stop], start, 8, torch.tensor([1.0, 0.5, 2.0]))
    assert torch.equal(full, want)


def _clipped_step(tau: float, boost: float):
    """The tiny model with query head 0 made `boost` times larger, one Muon step at lr 0 (so that only the clip
    changes the weights) with the clip at ``tau``: (clip, the measured maxima before, after the step)."""
    cfg = tiny_config()
    torch.manual_seed(0)
    model = get_family(cfg.model.arch).build(cfg.model)
    attn = [m for m in model.modules() if isinstance(m, Attention)]
    with torch.no_grad():
        attn[0].q_proj.weight[:attn[0].head_dim] *= boost
    opt = build_muon(model, Mesh.single(), 0.0, 0.0, (0.9, 0.95))
    clip = install_qk_clip(model, opt, tau, Mesh.single())
    batch = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(5))

    def measure() -> list[torch.Tensor]:
        with torch.no_grad():
            model(*inputs_and_labels(batch))
        out = [a.qk_logit_max.clone() for a in attn]
        for a in attn:
            a.qk_logit_max = None
        return out

    before = measure()
    model(*inputs_and_labels(batch)).backward()
    opt.step()
    return clip, before, measure()


def test_a_head_with_large_logits_is_clipped_to_tau_and_the_others_are_not():
    tau = 1.0  # the tiny model's logits start near 0.1
    clip, before, after = _clipped_step(tau, boost=100.0)
    assert before[0][0] > 5 * tau, before[0]  # the boosted head: far above tau
    rest = [(i, h) for i, m in enumerate(before) for h in range(m.numel()) if (i, h) != (0, 0)]
    assert all(before[i][h] < tau for i, h in rest), before  # nothing else above tau: one head clipped
    assert clip.clipped == 1
    torch.testing.assert_close(clip.last_max[0], before[0])  # the step read what the forwards measured
    # Layer 0, head 0 lands on tau (its key head's group: heads 0 and 1, whose smallest gamma is head 0's own)
    assert after[0][0] <= tau * (1 + 1e-5) and after[0][0] > tau * (1 - 1e-4), after[0]
    assert after[0][1] < before[0][1]  # head 1 shares the key head: it shrank too (sqrt of head 0's gamma)
    torch.testing.assert_close(after[0][2:], before[0][2:])  # the other key head's group is untouched
    # (later layers' logits moved with their inputs; their weights did not: one head clipped, lr 0)


def test_below_tau_nothing_changes():
    clip, before, after = _clipped_step(tau=1e6, boost=30.0)
    assert clip.clipped == 0
    for a, b in zip(after, before, strict=True):
        torch.testing.assert_close(a, b)


def test_qk_norm_attention_is_refused():
    cfg = tiny_config("qwen3")
    model = get_family(cfg.model.arch).build(cfg.model)
    opt = build_muon(model, Mesh.single(), 1e-3, 0.0, (0.9, 0.95))
    with pytest.raises(ConfigError, match="QK-norm"):
        install_qk_clip(model, opt, 10.0, Mesh.single())


def test_context_parallelism_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match="parallel.cp=1"):
        load_config(None, ["train.optimizer=muon", "train.muon_qk_clip=50", "parallel.cp=2"])


def test_the_clip_is_accepted_by_the_config_compiled_too():
    cfg = load_config(None, ["train.optimizer=muon", "train.muon_qk_clip=50", "train.compile=true"])
    assert cfg.train.muon_qk_clip == 50


def test_compiled_blocks_trace_the_measurement_without_a_graph_break():
    """Each block compiled as train.compile does (dynamo's eager backend: the same tracing; fullgraph=True fails on
    any graph break): the maxima recorded equal the eager model's, over two forwards (the max kept)."""
    cfg = tiny_config()
    torch.manual_seed(0)
    model = get_family(cfg.model.arch).build(cfg.model)
    attn = [m for m in model.modules() if isinstance(m, Attention)]
    for a in attn:
        a.track_qk_logits = True
    batch = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(5))
    model(*inputs_and_labels(batch)).backward()
    want = [a.qk_logit_max.clone() for a in attn]
    for a in attn:
        a.qk_logit_max = None
    for layer in model.layers.values():
        layer.compile(backend="eager", fullgraph=True)
    for _ in range(2):
        model(*inputs_and_labels(batch)).backward()
    for a, w in zip(attn, want, strict=True):
        torch.testing.assert_close(a.qk_logit_max, w, rtol=0, atol=1e-7)
