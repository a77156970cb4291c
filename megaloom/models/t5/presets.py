"""T5 shapes (T5 v1.1 blocks: gated-GeLU, RMSNorm, relative position buckets). `t5-tiny` trains on a laptop CPU;
`t5-base` and `t5-xl` are google/t5-v1_1-base and -xl's shapes (d_kv 64 = d_model / heads; 32,128-token
SentencePiece vocabulary). Released v1.1 checkpoints have an untied head; megaloom's presets tie it (and scale
the decoder's output by d_model^-0.5, T5 v1.0's rule), which is what transformers 5's T5ForConditionalGeneration
holds, so they export (docs/checkpoints.md). vocab_size 0: the tokenizer's, plus the sentinels and decoder start
it lacks, padded. max_seq_len bounds train.seq_len only (there are no position tables).
"""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    "t5-tiny": dict(n_layers=2, d_model=128, n_heads=4, n_kv_heads=0, ffn_dim=256, vocab_size=0, max_seq_len=512,
                    tie_embeddings=True, norm_eps=1e-6),
    "t5-base": dict(n_layers=12, d_model=768, n_heads=12, n_kv_heads=0, ffn_dim=2048, vocab_size=32128,
                    max_seq_len=512, tie_embeddings=True, norm_eps=1e-6, dropout=0.1),
    "t5-xl": dict(n_layers=24, d_model=2048, n_heads=32, n_kv_heads=0, ffn_dim=5120, vocab_size=32128,
                  max_seq_len=512, tie_embeddings=True, norm_eps=1e-6, dropout=0.1),
}
