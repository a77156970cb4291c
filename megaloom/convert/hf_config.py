"""Model settings: megaloom's `model.*` <-> Hugging Face config.json (LlamaForCausalLM, GPT2LMHeadModel).

Anything HF can express that megaloom's model would compute differently is refused with the field's name,
never silently dropped: a converted model must produce the same logits.
"""

from __future__ import annotations

import torch

from megaloom.config import ModelConfig
from megaloom.convert.errors import ConversionError
from megaloom.models.transformer import resolved_ffn_dim

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# HF GPT-2 activations that are exactly megaloom's F.gelu(approximate="tanh").
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def check_exportable(m: ModelConfig) -> None:
    if m.parallel_block:
        raise ConversionError("model.parallel_block=true: Hugging Face's LlamaForCausalLM / GPT2LMHeadModel have "
                              "no parallel block, so the exported model would compute something else. Only "
                              "models trained with model.parallel_block=false can be exported.")
    if m.sliding_window:
        raise ConversionError(f"model.sliding_window={m.sliding_window}: Hugging Face's LlamaForCausalLM / "
                              "GPT2LMHeadModel attend to the full context. Only models trained with "
                              "model.sliding_window=0 can be exported.")
    if m.arch not in ("llama", "gpt2"):
        raise ConversionError(f"model.arch={m.arch!r} has no Hugging Face export; llama and gpt2 do.")


def hf_config(m: ModelConfig, dtype: str, eos_id: int | None = None) -> dict:
    """config.json for a megaloom model shape (resolved: n_kv_heads and ffn_dim may be 0 = default)."""
    check_exportable(m)
    ffn, kv = resolved_ffn_dim(m), m.n_kv_heads or m.n_heads
    common = {"vocab_size": m.vocab_size, "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.init_std,
              # transformers <4.56 reads torch_dtype, newer versions dtype
              "torch_dtype": dtype, "dtype": dtype, "use_cache": True}
    if eos_id is not None:
        common.update(bos_token_id=eos_id, eos_token_id=eos_id)
    if m.arch == "llama":
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": m.d_model,
                "intermediate_size": ffn, "num_attention_heads": m.n_heads, "num_key_value_heads": kv,
                "num_hidden_layers": m.n_layers, "head_dim": m.d_model // m.n_heads, "rms_norm_eps": m.norm_eps,
                # rope_theta for transformers 4.x, rope_parameters for 5.x
                "rope_theta": m.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": m.rope_theta},
                "max_position_embeddings": m.max_seq_len, "hidden_act": "silu", "attention_bias": False,
                "mlp_bias": False, "attention_dropout": 0.0, "pretraining_tp": 1, **common}
    if kv != m.n_heads:
        raise ConversionError(f"model.n_kv_heads={kv} with arch gpt2: GPT2LMHeadModel has no grouped-query "
                              f"attention; only n_kv_heads=0 or {m.n_heads} can be exported.")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": m.d_model, "n_layer": m.n_layers,
            "n_head": m.n_heads, "n_positions": m.max_seq_len, "n_inner": ffn, "layer_norm_epsilon": m.norm_eps,
            "activation_function": "gelu_new", "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0, **common}


def _refuse(where: str, field: str, found: object, works: str) -> None:
    raise ConversionError(f"{where}: {field}={found!r} is not supported by megaloom's model ({works}).")


def _rope_theta(hf: dict, where: str) -> float:
    """RoPE base from either the 4.x (rope_theta, rope_scaling) or the 5.x (rope_parameters) layout."""
    scaling = hf.get("rope_scaling")
    if scaling:
        _refuse(where, "rope_scaling", scaling, "plain RoPE only; Llama 3.1/3.2's 'llama3' frequency scaling, "
                "linear, dynamic and yarn scaling are not implemented")
    params = hf.get("rope_parameters") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        _refuse(where, "rope_parameters.rope_type", kind, "plain RoPE ('default') only; Llama 3.1/3.2's "
                "'llama3' frequency scaling, linear, dynamic and yarn scaling are not implemented")
    if hf.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0)) != 1.0:
        _refuse(where, "partial_rotary_factor", hf.get("partial_rotary_factor", params.get("partial_rotary_factor")),
                "RoPE over the whole head only: 1.0")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _llama_model(hf: dict, where: str) -> dict:
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("hidden_act", "silu") != "silu":
        _refuse(where, "hidden_act", hf["hidden_act"], "SwiGLU with silu")
    for field in ("attention_bias", "mlp_bias"):
        if hf.get(field, False):
            _refuse(where, field, hf[field], "Llama projections have no bias")
    if d % heads:
        _refuse(where, "hidden_size", d, f"a multiple of num_attention_heads={heads}")
    if hf.get("head_dim") not in (None, d // heads):
        _refuse(where, "head_dim", hf["head_dim"], f"hidden_size / num_attention_heads = {d // heads}")
    return dict(arch="llama", preset="tiny", n_layers=hf["num_hidden_layers"], d_model=d, n_heads=heads,
                n_kv_heads=hf.get("num_key_value_heads") or heads, ffn_dim=hf["intermediate_size"],
                vocab_size=hf["vocab_size"], max_seq_len=hf.get("max_position_embeddings", 2048),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),  # LlamaConfig's default
                norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=_rope_theta(hf, where),
                init_std=float(hf.get("initializer_range", 0.02)))


def _gpt2_model(hf: dict, where: str) -> dict:
    act = hf.get("activation_function", "gelu_new")
    if act not in _GELU_TANH:
        _refuse(where, "activation_function", act, f"GeLU with the tanh approximation: {', '.join(_GELU_TANH)}")
    for field, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
        if hf.get(field, ok) != ok:
            _refuse(where, field, hf[field], f"only {ok}")
    d, heads = hf["n_embd"], hf["n_head"]
    if d % heads:
        _refuse(where, "n_embd", d, f"a multiple of n_head={heads}")
    return dict(arch="gpt2", preset="tiny-gpt2", n_layers=hf["n_layer"], d_model=d, n_heads=heads, n_kv_heads=heads,
                ffn_dim=hf.get("n_inner") or 4 * d, vocab_size=hf["vocab_size"], max_seq_len=hf["n_positions"],
                tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
                norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), init_std=float(hf.get("initializer_range", 0.02)))


def model_settings(hf: dict, where: str) -> dict:
    """megaloom model.* values (resolved, dropout 0, full attention) for an HF config.json."""
    kind = hf.get("model_type")
    archs = hf.get("architectures") or []
    try:
        if kind == "llama":
            out = _llama_model(hf, where)
        elif kind == "gpt2":
            out = _gpt2_model(hf, where)
        else:
            raise ConversionError(f"{where}: model_type={kind!r} (architectures {archs}) cannot be imported; "
                                  "megaloom reads model_type 'llama' (LlamaForCausalLM) and 'gpt2' (GPT2LMHeadModel).")
    except KeyError as e:
        raise ConversionError(f"{where}: required field {e.args[0]!r} is missing for model_type {kind!r}.") from e
    out.update(dropout=0.0, parallel_block=False, sliding_window=0)
    return out
