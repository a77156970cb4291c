"""TorchTitan 0.2.2's own trainer on the shape of megaloom's `qwen3-moe-2.6b` preset (the MoE speed race).

Registers qwen3 flavor "moe-2.6B" (every layer MoE: 32 experts of width 768, top-4 softmax with the top-k weights
renormalised, no shared expert, aux-loss-free load balancing at 1e-3, untied 151,936-token vocabulary, QK-norm,
head_dim 128), then runs TorchTitan's main exactly as bench/.peer/torchtitan/run_titan.py does. Run it from
bench/.peer/torchtitan (its tokenizer assets and synthetic data), e.g. by `bash bench/run_speed.sh moe`.
"""

from torchtitan.models.moe import MoEArgs
from torchtitan.models.qwen3 import Qwen3ModelArgs, qwen3_args

qwen3_args["moe-2.6B"] = Qwen3ModelArgs(
    vocab_size=151936, max_seq_len=40960, head_dim=128, dim=2048, n_layers=12, n_heads=16, n_kv_heads=4,
    qk_norm=True, hidden_dim=6144, rope_theta=1000000, moe_enabled=True, moe_inter_dim=768,
    moe_args=MoEArgs(num_experts=32, num_shared_experts=0, top_k=4, score_func="softmax", route_norm=True,
                     route_scale=1.0, score_before_experts=False, load_balance_coeff=1e-3),
)

if __name__ == "__main__":
    from torchtitan.train import Trainer, main

    main(Trainer)
