"""GPT-2 shapes. `tiny-gpt2` trains on a laptop CPU; the others are the published sizes.

vocab_size 0 means "take the tokenizer's vocabulary".
"""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    # The tiny size in GPT-2 style (LayerNorm, GeLU, learned positions).
    "tiny-gpt2": dict(n_layers=4, d_model=128, n_heads=4, n_kv_heads=0, ffn_dim=512, vocab_size=0,
                      max_seq_len=1024, tie_embeddings=True, norm_eps=1e-5),
    "gpt2-124m": dict(n_layers=12, d_model=768, n_heads=12, n_kv_heads=0, ffn_dim=3072,
                      vocab_size=50304, max_seq_len=1024, tie_embeddings=True, norm_eps=1e-5),
    "gpt2-350m": dict(n_layers=24, d_model=1024, n_heads=16, n_kv_heads=0, ffn_dim=4096,
                      vocab_size=50304, max_seq_len=1024, tie_embeddings=True, norm_eps=1e-5),
}
