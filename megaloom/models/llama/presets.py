"""Llama shapes (and Llama-based MoE shapes). `tiny` trains on a laptop CPU in minutes; the others are the
published shapes, for GPU runs and for planning sharded layouts.

vocab_size 0 means "take the tokenizer's vocabulary".
"""

from __future__ import annotations

LLAMA3_1B = dict(n_layers=16, d_model=2048, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
                 max_seq_len=8192, tie_embeddings=True, rope_theta=500000.0, norm_eps=1e-5)

PRESETS: dict[str, dict] = {
    # A small Llama-style model for CPU runs and tests.
    "tiny": dict(n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=0,
                 max_seq_len=1024, tie_embeddings=True, rope_theta=10000.0, norm_eps=1e-5),
    # Mixture-of-Experts (Mixtral style): MoE in every other block, 8 experts, top-2, one shared expert.
    "mixtral-tiny": dict(n_layers=4, d_model=128, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=0,
                         max_seq_len=1024, tie_embeddings=True, rope_theta=10000.0, norm_eps=1e-5, moe_every=2,
                         n_experts=8, top_k=2, n_shared_experts=1, expert_ffn_dim=128, router_score="softmax",
                         aux_loss_weight=0.01, z_loss_weight=0.001),
    # DeepSeek-V3 style: multi-head latent attention (no query compression at this width, as DeepSeek-V2-Lite),
    # sigmoid router with group-limited top-k and scaled weights, aux-loss-free balancing, a shared expert, the first
    # block dense, MoE in the others.
    "deepseek-v3-tiny": dict(n_layers=4, d_model=128, n_heads=4, n_kv_heads=0, ffn_dim=384,
                             vocab_size=0, max_seq_len=1024, tie_embeddings=True, rope_theta=10000.0, norm_eps=1e-5,
                             attention="mla", q_lora_rank=0, kv_lora_rank=64, qk_nope_head_dim=32,
                             qk_rope_head_dim=16, v_head_dim=32,
                             moe_every=1, first_dense_layers=1, n_experts=16, top_k=4, n_shared_experts=1,
                             expert_ffn_dim=64, router_score="sigmoid", n_expert_groups=4, topk_groups=2,
                             routed_scaling_factor=2.5, aux_loss_weight=0.0, aux_free_bias_rate=1e-3),
    # DeepSeek-V3's published shape (671B parameters, 37B active; config.json of deepseek-ai/DeepSeek-V3), for
    # planning layouts. The release extends the context with YaRN (factor 40 over 4096 positions, mscale 1);
    # pretraining ran at 4096 without it, which is what this preset trains (model.rope_scaling=yarn
    # model.rope_factor=40 model.rope_original_max_len=4096 model.max_seq_len=163840 adds it; an import has it).
    # Its sequence-wise balance loss (alpha 1e-4) is approximated by megaloom's batch-wise one. It also trained one
    # multi-token-prediction module, left out here (the plans of the planner's checks are of the main model):
    # model.mtp_depth=1 adds it, under pipelines too (the last stage keeps a copy of the untied input embedding).
    "deepseek-v3": dict(n_layers=61, d_model=7168, n_heads=128, n_kv_heads=0, ffn_dim=18432, vocab_size=129280,
                        max_seq_len=4096, tie_embeddings=False, rope_theta=10000.0, norm_eps=1e-6,
                        attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128,
                        moe_every=1, first_dense_layers=3, n_experts=256, top_k=8, n_shared_experts=1,
                        expert_ffn_dim=2048, router_score="sigmoid", n_expert_groups=8, topk_groups=4,
                        routed_scaling_factor=2.5, aux_loss_weight=1e-4, aux_free_bias_rate=1e-3),
    # For planning: Mixtral 8x7B's shape.
    "mixtral-8x7b": dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                         vocab_size=32000, max_seq_len=8192, tie_embeddings=False, rope_theta=1e6, norm_eps=1e-5,
                         moe_every=1, n_experts=8, top_k=2, n_shared_experts=0, expert_ffn_dim=14336,
                         router_score="softmax", aux_loss_weight=0.01),
    # Llama-3.2-1B shape (tied embeddings). The 3.2 release's RoPE frequency scaling is not set here (the benchmarks
    # train this shape from scratch at 8k); model.rope_scaling=llama3 model.rope_factor=32
    # model.rope_original_max_len=8192 adds it, and an imported checkpoint has it.
    "llama3-1b": LLAMA3_1B,
    # The same shape untied: what TorchTitan's "1B" flavour in ../shared/bench trains (1,498,482,688 params).
    "llama3-1b-untied": {**LLAMA3_1B, "tie_embeddings": False},
    "llama3-8b": dict(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                      vocab_size=128256, max_seq_len=8192, tie_embeddings=False, rope_theta=500000.0,
                      norm_eps=1e-5),
    "llama3-70b": dict(n_layers=80, d_model=8192, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                       vocab_size=128256, max_seq_len=8192, tie_embeddings=False, rope_theta=500000.0,
                       norm_eps=1e-5),

}
