"""T5 <-> Hugging Face T5ForConditionalGeneration (gated-GeLU blocks): tensor names and config.json, both ways.

HF's layout: ``shared`` (the embedding; ``encoder.embed_tokens`` / ``decoder.embed_tokens`` / ``lm_head`` are
tied to it), ``encoder.block.{i}.layer.0`` (SelfAttention q/k/v/o + layer_norm), ``layer.1`` (DenseReluDense
wi_0/wi_1/wo + layer_norm), ``decoder.block.{i}`` with ``layer.1`` the cross-attention (EncDecAttention) and
``layer.2`` the MLP; the relative-position bias lives in block 0 of each stack (shared by all its layers).

transformers 5 always ties the head to ``shared`` and scales the decoder's output by d_model^-0.5 unless
``scale_decoder_outputs`` is false (T5 v1.1's untied, unscaled head cannot be held by it). megaloom's tied t5 is
the scaled one: an untied t5 is refused on export, ``scale_decoder_outputs=false`` on import. Refused too, by
field: other feed-forward kinds (``relu``: T5 v1.0), bucket counts / distances other than 32 / 128, d_kv other
than d_model / num_heads, decoder depth other than the encoder's.
"""

from __future__ import annotations

from megaloom.config import ModelConfig
from megaloom.errors import ConversionError
from megaloom.model_keys.shape import resolved_ffn_dim, resolved_head_dim, resolved_kv_heads
from megaloom.models.family import HFMapping
from megaloom.models.hf_common import HFTensors, Tensors, refuse
from megaloom.models.t5.model import MAX_DISTANCE, NUM_BUCKETS

ATTN = [(f"{p}_proj.weight", f"{p}.weight") for p in "qkvo"]
MLP = [("mlp.gate_proj.weight", "DenseReluDense.wi_0.weight"), ("mlp.up_proj.weight", "DenseReluDense.wi_1.weight"),
       ("mlp.down_proj.weight", "DenseReluDense.wo.weight")]


def _pairs(m: ModelConfig) -> list[tuple[str, str]]:
    """(megaloom, HF) name of every tensor but the head."""
    n = m.n_layers
    out = [("tok_emb.weight", "shared.weight"), ("enc_norm.weight", "encoder.final_layer_norm.weight"),
           ("norm.weight", "decoder.final_layer_norm.weight"),
           ("enc_bias.weight", "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
           ("dec_bias.weight", "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")]
    for i in range(n):
        e, d = f"encoder.block.{i}.layer", f"decoder.block.{i}.layer"
        out += [(f"layers.{i}.attn.{ml}", f"{e}.0.SelfAttention.{hf}") for ml, hf in ATTN]
        out += [(f"layers.{i}.attn_norm.weight", f"{e}.0.layer_norm.weight"),
                (f"layers.{i}.mlp_norm.weight", f"{e}.1.layer_norm.weight")]
        out += [(f"layers.{i}.{ml}", f"{e}.1.{hf}") for ml, hf in MLP]
        j = n + i
        out += [(f"layers.{j}.attn.{ml}", f"{d}.0.SelfAttention.{hf}") for ml, hf in ATTN]
        out += [(f"layers.{j}.cross.{ml}", f"{d}.1.EncDecAttention.{hf}") for ml, hf in ATTN]
        out += [(f"layers.{j}.attn_norm.weight", f"{d}.0.layer_norm.weight"),
                (f"layers.{j}.cross_norm.weight", f"{d}.1.layer_norm.weight"),
                (f"layers.{j}.mlp_norm.weight", f"{d}.2.layer_norm.weight")]
        out += [(f"layers.{j}.{ml}", f"{d}.2.{hf}") for ml, hf in MLP]
    return out


BIAS_TABLES = ("enc_bias.weight", "dec_bias.weight")  # [heads, buckets] here, [buckets, heads] in HF


def to_hf_names(sd: Tensors, m: ModelConfig) -> Tensors:
    return {hf: sd[ml].t() if ml in BIAS_TABLES else sd[ml] for ml, hf in _pairs(m)}


def normalize(hf: Tensors) -> Tensors:
    """Drop the stacks' copies of the shared embedding (some exports write them)."""
    return {k: v for k, v in hf.items() if k not in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")}


def from_hf_names(hf: HFTensors, m: ModelConfig) -> Tensors:
    return {ml: hf.take(name).t() if ml in BIAS_TABLES else hf.take(name) for ml, name in _pairs(m)}


def to_hf_config(m: ModelConfig) -> dict:
    kv = resolved_kv_heads(m)
    if kv != m.n_heads:
        raise ConversionError(f"model.n_kv_heads={kv} with arch t5: T5 has no grouped-query attention; only "
                              f"n_kv_heads=0 or {m.n_heads} can be exported.")
    if not m.tie_embeddings:
        raise ConversionError("model.tie_embeddings=false with arch t5: transformers 5's T5ForConditionalGeneration "
                              "always ties its head to the embedding; only tied t5 models can be exported.")
    return {"d_model": m.d_model, "d_kv": resolved_head_dim(m), "d_ff": resolved_ffn_dim(m), "num_layers": m.n_layers,
            "num_decoder_layers": m.n_layers, "num_heads": m.n_heads, "relative_attention_num_buckets": NUM_BUCKETS,
            "relative_attention_max_distance": MAX_DISTANCE, "dropout_rate": 0.0, "layer_norm_epsilon": m.norm_eps,
            "feed_forward_proj": "gated-gelu", "is_encoder_decoder": True, "scale_decoder_outputs": True,
            "decoder_start_token_id": 0, "pad_token_id": 0}


def from_hf_config(hf: dict, where: str) -> dict:
    for field, ok in (("feed_forward_proj", "gated-gelu"), ("relative_attention_num_buckets", NUM_BUCKETS),
                      ("relative_attention_max_distance", MAX_DISTANCE), ("scale_decoder_outputs", True),
                      ("tie_word_embeddings", True)):
        if hf.get(field, ok) != ok:
            refuse(where, field, hf[field], f"only {ok!r}")
    d, heads = hf["d_model"], hf["num_heads"]
    if hf.get("d_kv", d // heads) * heads != d:
        refuse(where, "d_kv", hf["d_kv"], f"d_model / num_heads = {d / heads:g}")
    if hf.get("num_decoder_layers") not in (None, hf["num_layers"]):
        refuse(where, "num_decoder_layers", hf["num_decoder_layers"], f"num_layers = {hf['num_layers']}")
    return dict(arch="t5", preset="t5-tiny", n_layers=hf["num_layers"], d_model=d, n_heads=heads, n_kv_heads=heads,
                ffn_dim=hf["d_ff"], vocab_size=hf["vocab_size"], tie_embeddings=True,
                norm_eps=float(hf.get("layer_norm_epsilon", 1e-6)))


HF = HFMapping(architecture="T5ForConditionalGeneration", model_types=("t5",), to_hf_config=to_hf_config,
               from_hf_config=from_hf_config, to_hf_names=to_hf_names, from_hf_names=from_hf_names,
               normalize=normalize)
