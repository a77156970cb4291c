"""Gemma shapes. `gemma-tiny` trains on a laptop CPU; `gemma2-2b`, `gemma2-9b` and `gemma2-27b` are the shapes of
google/gemma-2-2b, -9b and -27b (config.json: sandwich norms, GeGLU, heads of 256 (27B: 128, its scores scaled by
144^-1/2), alternating 4096-token sliding windows, tied embeddings of 256,000 rows, attention / final-logit
soft-capping at 50 / 30), for GPU runs and planning.

vocab_size 0 means "take the tokenizer's vocabulary".
"""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    # A small Gemma-style model for CPU runs and tests: heads wider than d_model / n_heads, as Gemma's are.
    "gemma-tiny": dict(n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512, vocab_size=0,
                       max_seq_len=1024, sliding_window=64, tie_embeddings=True, rope_theta=10000.0, norm_eps=1e-6),
    "gemma2-2b": dict(n_layers=26, d_model=2304, n_heads=8, n_kv_heads=4, head_dim=256, ffn_dim=9216,
                      vocab_size=256000, max_seq_len=8192, sliding_window=4096, tie_embeddings=True,
                      rope_theta=10000.0, norm_eps=1e-6, attn_softcap=50.0, final_softcap=30.0),
    "gemma2-9b": dict(n_layers=42, d_model=3584, n_heads=16, n_kv_heads=8, head_dim=256, ffn_dim=14336,
                      vocab_size=256000, max_seq_len=8192, sliding_window=4096, tie_embeddings=True,
                      rope_theta=10000.0, norm_eps=1e-6, attn_softcap=50.0, final_softcap=30.0),
    "gemma2-27b": dict(n_layers=46, d_model=4608, n_heads=32, n_kv_heads=16, head_dim=128, ffn_dim=36864,
                       vocab_size=256000, max_seq_len=8192, sliding_window=4096, tie_embeddings=True,
                       rope_theta=10000.0, norm_eps=1e-6, attn_softcap=50.0, final_softcap=30.0,
                       query_pre_attn_scalar=144),
}
