"""BERT <-> Hugging Face BertForMaskedLM: tensor names and config.json, both ways.

HF's layout: ``bert.embeddings`` (word, position, token-type, LayerNorm), ``bert.encoder.layer.{i}`` (self
attention query/key/value, ``attention.output`` dense + LayerNorm, ``intermediate.dense``, ``output`` dense +
LayerNorm: post-norm) and ``cls.predictions`` (``transform`` dense + LayerNorm, ``bias``, the ``decoder`` tied to
the word embedding). The decoder adds ``cls.predictions.decoder.bias``, which transformers ties to
``cls.predictions.bias`` when the embedding is tied and leaves apart when not (``cls.predictions.bias`` then
computes nothing): megaloom's ``head.bias`` is the decoder's bias, written under both names.
Released pre-training checkpoints (BertForPreTraining) also hold the pooler and the next-sentence head; the
masked-LM logits do not use them, so an import drops them (the run has model.sentence_order=false). A model
with megaloom's sentence-order head (model.sentence_order) is refused on export. Refused with the field named:
activations other than the exact ``gelu``, relative position embeddings, decoder / cross-attention configs and
``type_vocab_size`` other than 2.
"""

from __future__ import annotations

from megaloom.config import ModelConfig
from megaloom.errors import ConversionError
from megaloom.model_keys.shape import resolved_ffn_dim, resolved_kv_heads
from megaloom.models.family import HFMapping
from megaloom.models.hf_common import HFTensors, Tensors, refuse, refuse_head_dim

TYPE_VOCAB = 2
GLOBAL = [("tok_emb.weight", "bert.embeddings.word_embeddings.weight"),
          ("pos_emb.weight", "bert.embeddings.position_embeddings.weight"),
          ("type_emb.weight", "bert.embeddings.token_type_embeddings.weight"),
          ("emb_norm.weight", "bert.embeddings.LayerNorm.weight"), ("emb_norm.bias", "bert.embeddings.LayerNorm.bias"),
          ("norm.dense.weight", "cls.predictions.transform.dense.weight"),
          ("norm.dense.bias", "cls.predictions.transform.dense.bias"),
          ("norm.norm.weight", "cls.predictions.transform.LayerNorm.weight"),
          ("norm.norm.bias", "cls.predictions.transform.LayerNorm.bias")]
HEAD_BIAS, DECODER_BIAS = "cls.predictions.bias", "cls.predictions.decoder.bias"
_PARTS = [("attn.q_proj", "attention.self.query"), ("attn.k_proj", "attention.self.key"),
          ("attn.v_proj", "attention.self.value"), ("attn.o_proj", "attention.output.dense"),
          ("attn_norm", "attention.output.LayerNorm"), ("mlp.up_proj", "intermediate.dense"),
          ("mlp.down_proj", "output.dense"), ("mlp_norm", "output.LayerNorm")]
LAYER = [(f"{ml}.{leaf}", f"{hf}.{leaf}") for ml, hf in _PARTS for leaf in ("weight", "bias")]
# In exports, but not parameters of the masked-LM model: buffers, and BertForPreTraining's pooler and
# next-sentence head.
DROPPED = ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids")
DROPPED_PREFIXES = ("bert.pooler.", "cls.seq_relationship.")


def to_hf_names(sd: Tensors, m: ModelConfig) -> Tensors:
    out = {hf: sd[ml] for ml, hf in GLOBAL} | {HEAD_BIAS: sd["head.bias"], DECODER_BIAS: sd["head.bias"].clone()}
    for i in range(m.n_layers):
        out.update({f"bert.encoder.layer.{i}.{hf}": sd[f"layers.{i}.{ml}"] for ml, hf in LAYER})
    return out


def normalize(hf: Tensors) -> Tensors:
    return {k: v for k, v in hf.items() if k not in DROPPED and not k.startswith(DROPPED_PREFIXES)}


def from_hf_names(hf: HFTensors, m: ModelConfig) -> Tensors:
    sd = {ml: hf.take(name) for ml, name in GLOBAL}
    used = DECODER_BIAS if DECODER_BIAS in hf.tensors else HEAD_BIAS  # tied exports may write only one of them
    sd["head.bias"] = hf.take(used)
    hf.ignore(HEAD_BIAS)
    for i in range(m.n_layers):
        sd.update({f"layers.{i}.{ml}": hf.take(f"bert.encoder.layer.{i}.{name}") for ml, name in LAYER})
    return sd


def to_hf_config(m: ModelConfig) -> dict:
    if m.sentence_order:
        raise ConversionError("model.sentence_order=true: BertForMaskedLM has no pooler or sentence-order head (and "
                              "BertForPreTraining's next-sentence head means something else); export a run trained "
                              "with model.sentence_order=false.")
    kv = resolved_kv_heads(m)
    if kv != m.n_heads:
        raise ConversionError(f"model.n_kv_heads={kv} with arch bert: BertForMaskedLM has no grouped-query "
                              f"attention; only n_kv_heads=0 or {m.n_heads} can be exported.")
    refuse_head_dim(m, "BertForMaskedLM")
    return {"hidden_size": m.d_model, "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
            "intermediate_size": resolved_ffn_dim(m), "hidden_act": "gelu", "max_position_embeddings": m.max_seq_len,
            "type_vocab_size": TYPE_VOCAB, "layer_norm_eps": m.norm_eps, "position_embedding_type": "absolute",
            "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, "is_decoder": False,
            "add_cross_attention": False}


def from_hf_config(hf: dict, where: str) -> dict:
    for field, ok in (("hidden_act", "gelu"), ("position_embedding_type", "absolute"), ("is_decoder", False),
                      ("add_cross_attention", False), ("type_vocab_size", TYPE_VOCAB)):
        if hf.get(field, ok) != ok:
            refuse(where, field, hf[field], f"only {ok!r}")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    if d % heads:
        refuse(where, "hidden_size", d, f"a multiple of num_attention_heads={heads}")
    return dict(arch="bert", preset="bert-tiny", n_layers=hf["num_hidden_layers"], d_model=d, n_heads=heads,
                n_kv_heads=heads, ffn_dim=hf["intermediate_size"], vocab_size=hf["vocab_size"],
                max_seq_len=hf["max_position_embeddings"], tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
                norm_eps=float(hf.get("layer_norm_eps", 1e-12)), init_std=float(hf.get("initializer_range", 0.02)))


HF = HFMapping(architecture="BertForMaskedLM", model_types=("bert",), to_hf_config=to_hf_config,
               from_hf_config=from_hf_config, to_hf_names=to_hf_names, from_hf_names=from_hf_names,
               normalize=normalize, head_name="cls.predictions.decoder.weight")
