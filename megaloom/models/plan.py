"""The decoder's parallel plan (Megatron's layout), as data: submodule name -> style.

  attention: enter the region once -> q/k/v column-parallel (whole heads per rank) -> SDPA on local heads ->
             o_proj row-parallel -> all-reduce (reduce-scatter with sp)
  latent attention (model.attention=mla, models/mla.py): the down-projections q_a_proj / kv_a_proj replicated
             (every rank all rows; gradients summed over tp like replicated KV heads), their norms replicated with
             partial gradients, q_b_proj / kv_b_proj (or q_proj) column-parallel by heads, o_proj row-parallel,
             as Megatron-Core splits MLA
  MLP:       enter the region once -> gate/up column-parallel -> activation -> down_proj row-parallel -> reduce
  MoE:       experts over ep, each expert's hidden units over tp (parallel/expert.py)
  embedding and head split by vocabulary, the loss vocabulary-parallel (full logits never exist); with sp the
  residual stream between regions holds T/tp tokens per rank from the embedding to the head.

Model families whose modules carry the decoder's names use it as is (gpt2, llama) or extend it (qwen3).
"""

from __future__ import annotations

from megaloom.models.plan_styles import (
    Colwise,
    Experts,
    LocalHeads,
    PartialGrad,
    Plan,
    Region,
    Rowwise,
    SequenceDropout,
    SequenceParallel,
    SequencePositions,
    VocabEmbedding,
    VocabHead,
    VocabLoss,
)

DECODER_PLAN: Plan = {
    "tok_emb": VocabEmbedding(),
    "pos_emb": SequencePositions(),
    "drop": SequenceDropout(),
    "layers.*.attn_norm": SequenceParallel(),
    "layers.*.attn": (Region(), LocalHeads()),
    "layers.*.attn.q_proj": Colwise(),
    "layers.*.attn.k_proj": Colwise(kv_heads=True),
    "layers.*.attn.v_proj": Colwise(kv_heads=True),
    "layers.*.attn.o_proj": Rowwise(),
    "layers.*.attn.q_a_proj": Colwise(replicated=True),
    "layers.*.attn.q_a_norm": PartialGrad(),
    "layers.*.attn.q_b_proj": Colwise(region_input=False),
    "layers.*.attn.kv_a_proj": Colwise(replicated=True),
    "layers.*.attn.kv_a_norm": PartialGrad(),
    "layers.*.attn.kv_b_proj": Colwise(region_input=False),
    "layers.*.attn.resid_dropout": SequenceDropout(),
    "layers.*.mlp_norm": SequenceParallel(),
    "layers.*.mlp": (Experts(), Region()),
    "layers.*.mlp.gate_proj": Colwise(),
    "layers.*.mlp.up_proj": Colwise(),
    "layers.*.mlp.down_proj": Rowwise(),
    "layers.*.mlp.dropout": SequenceDropout(),
    "norm": SequenceParallel(),
    "head": VocabHead(),
    "loss": VocabLoss(),
}

