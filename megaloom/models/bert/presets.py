"""BERT shapes. `bert-tiny` trains on a laptop CPU in seconds (Google's BERT-Tiny: 2 layers, 128 wide, 2 heads);
`bert-base` and `bert-large` are the released shapes (bert-base-uncased / bert-large-uncased config.json:
WordPiece vocabulary 30,522, 512 positions, LayerNorm eps 1e-12, dropout 0.1).

vocab_size 0 means "the tokenizer's vocabulary, plus the [MASK]/[CLS]/[SEP] ids it lacks, padded".
"""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    "bert-tiny": dict(n_layers=2, d_model=128, n_heads=2, n_kv_heads=0, ffn_dim=512, vocab_size=0, max_seq_len=512,
                      tie_embeddings=True, norm_eps=1e-12),
    "bert-base": dict(n_layers=12, d_model=768, n_heads=12, n_kv_heads=0, ffn_dim=3072, vocab_size=30522,
                      max_seq_len=512, tie_embeddings=True, norm_eps=1e-12, dropout=0.1),
    "bert-large": dict(n_layers=24, d_model=1024, n_heads=16, n_kv_heads=0, ffn_dim=4096, vocab_size=30522,
                       max_seq_len=512, tie_embeddings=True, norm_eps=1e-12, dropout=0.1),
}
