"""Qwen3 shapes. `qwen3-tiny` trains on a laptop CPU (the size of llama's `tiny`); the others are the
published dense shapes (config.json of Qwen/Qwen3-0.6B, -1.7B, -4B, -8B, -14B and -32B), for GPU runs and for
planning layouts.

Qwen3 fixes head_dim at 128. That equals d_model / n_heads for 1.7B (2048 / 16), 8B (4096 / 32) and 14B
(5120 / 40); Qwen3-0.6B (1024 / 16 = 64), -4B (2560 / 32 = 80) and -32B (5120 / 64 = 80) have wider heads, so
their presets set model.head_dim = 128 (q/k/v project d_model to heads x 128, o_proj back). The MoE models
(Qwen3-30B-A3B, -235B-A22B) are model_type qwen3_moe, imported as qwen3 MoE models.

vocab_size 0 means "take the tokenizer's vocabulary".
"""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    # A small Qwen3-style model for CPU runs and tests (QK-norm, RoPE base 1e6 as the released models).
    "qwen3-tiny": dict(n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=0,
                       max_seq_len=1024, tie_embeddings=True, rope_theta=1e6, norm_eps=1e-6),
    "qwen3-0.6b": dict(n_layers=28, d_model=1024, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=3072,
                       vocab_size=151936, max_seq_len=40960, tie_embeddings=True, rope_theta=1e6, norm_eps=1e-6),
    "qwen3-1.7b": dict(n_layers=28, d_model=2048, n_heads=16, n_kv_heads=8, ffn_dim=6144, vocab_size=151936,
                       max_seq_len=40960, tie_embeddings=True, rope_theta=1e6, norm_eps=1e-6),
    "qwen3-4b": dict(n_layers=36, d_model=2560, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=9728,
                     vocab_size=151936, max_seq_len=40960, tie_embeddings=True, rope_theta=1e6, norm_eps=1e-6),
    "qwen3-8b": dict(n_layers=36, d_model=4096, n_heads=32, n_kv_heads=8, ffn_dim=12288, vocab_size=151936,
                     max_seq_len=40960, tie_embeddings=False, rope_theta=1e6, norm_eps=1e-6),
    # A Qwen3-MoE-style model (2.56B parameters) that fits one H200 with fp32 AdamW, for the MoE speed race against
    # TorchTitan's qwen3 with the same shape (flavor "moe-2.6B", bench/titan_moe.py): every block MoE, 32 experts of
    # width 768, top-4 softmax renormalised (Qwen3-MoE's routing), no shared expert, aux-loss-free balancing.
    "qwen3-moe-2.6b": dict(n_layers=12, d_model=2048, n_heads=16, n_kv_heads=4, ffn_dim=6144, vocab_size=151936,
                           max_seq_len=40960, tie_embeddings=False, rope_theta=1e6, norm_eps=1e-6, moe_every=1,
                           n_experts=32, top_k=4, n_shared_experts=0, expert_ffn_dim=768, router_score="softmax",
                           aux_loss_weight=0.0, aux_free_bias_rate=1e-3),
    "qwen3-14b": dict(n_layers=40, d_model=5120, n_heads=40, n_kv_heads=8, ffn_dim=17408, vocab_size=151936,
                      max_seq_len=40960, tie_embeddings=False, rope_theta=1e6, norm_eps=1e-6),
    "qwen3-32b": dict(n_layers=64, d_model=5120, n_heads=64, n_kv_heads=8, head_dim=128, ffn_dim=25600,
                      vocab_size=151936, max_seq_len=40960, tie_embeddings=False, rope_theta=1e6, norm_eps=1e-6),
}
