"""LLaVA shapes. `llava-tiny` trains on a CPU in seconds on the synthetic shapes set (32x32 images, 16 patches
each); `llava-1.5-8b` is LLaVA-1.5's vision side (CLIP ViT-L/14 at 336 px: 24 blocks, of which LLaVA reads the
23rd's output, so 23 are kept; 576 tokens per image) in front of Llama-3-8B, for GPU runs and layout planning.

vocab_size 0 means "take the tokenizer's vocabulary"; image_token_id -1 the tokenizer's <image> token.
"""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    "llava-tiny": dict(n_layers=2, d_model=128, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=0,
                       max_seq_len=1024, tie_embeddings=True, vision_layers=2, vision_d_model=64, vision_heads=4,
                       vision_ffn_dim=128, image_size=32, patch_size=8, vision_act="gelu"),
    "llava-1.5-8b": dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
                         max_seq_len=8192, tie_embeddings=False, rope_theta=500000.0, norm_eps=1e-5,
                         vision_layers=23, vision_d_model=1024, vision_heads=16, vision_ffn_dim=4096,
                         image_size=336, patch_size=14, vision_act="quick_gelu"),
}
