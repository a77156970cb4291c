"""Sampling from a trained run: temperature, top-k and top-p (nucleus) with a KV cache. A decoder continues the
prompt; an encoder-decoder (t5) encodes the prompt once and decodes an answer (its KV cache and cross-attention
keys/values built once)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from megaloom.checkpoint import CheckpointError, load_newest
from megaloom.config import ConfigError
from megaloom.data.tokenizer import Tokenizer
from megaloom.models import Transformer
from megaloom.models.registry import get_family


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
                generator: torch.Generator | None) -> torch.Tensor:
    """Pick the next token [B] from logits [B, V]. temperature 0 = greedy."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0 < top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop tokens once the mass before them already exceeds top_p (the first token always stays)
        drop = probs.cumsum(-1) - probs > top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: Transformer, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, top_p: float = 1.0, use_cache: bool = True, seed: int = 0,
             eod_id: int | Sequence[int] | None = None, images: dict | None = None) -> torch.Tensor:
    """Continue prompt [B, T]; returns [B, T + n]. With use_cache=False every step re-runs the whole prefix
    (the reference that the cached path must agree with). ``images``: a multimodal model's image keywords
    (``images``, ``n_images``) for the prompt's <image> tokens, passed with every forward from position 0.
    ``eod_id``: the token (or tokens: a chat's end of turn and the end of document) that stops a row."""
    images = images or {}
    stops = None if eod_id is None else torch.tensor([eod_id] if isinstance(eod_id, int) else list(eod_id),
                                                     device=prompt.device)
    model.eval()
    gen = torch.Generator(device=prompt.device).manual_seed(seed)
    if model.family.traits.encoder_decoder:  # the prompt is the encoder's input
        return _generate_encoder_decoder(model, prompt, max_new_tokens, temperature, top_k, top_p, use_cache, gen,
                                         eod_id)
    limit = model.cfg.max_seq_len
    max_new_tokens = min(max_new_tokens, limit - prompt.shape[1])
    out = prompt
    caches = model.new_caches(prompt.shape[0], prompt.shape[1] + max_new_tokens) if use_cache else None
    logits = model(prompt, caches=caches, pos=0, **images)[:, -1]
    for _ in range(max_new_tokens):
        nxt = sample_next(logits, temperature, top_k, top_p, gen)
        out = torch.cat([out, nxt[:, None]], dim=1)
        if stops is not None and bool(torch.isin(nxt, stops).all()):
            break
        if out.shape[1] >= limit:
            break
        if use_cache:
            logits = model(nxt[:, None], caches=caches, pos=out.shape[1] - 1)[:, -1]
        else:
            logits = model(out, **images)[:, -1]
    return out


def _generate_encoder_decoder(model, prompt: torch.Tensor, max_new_tokens: int, temperature: float, top_k: int,
                              top_p: float, use_cache: bool, gen: torch.Generator, eod_id: int | None) -> torch.Tensor:
    """The encoder runs once on ``prompt``; the decoder starts from ``model.decoder_start_id`` and samples up to
    ``max_new_tokens``, with a KV cache (and the cross-attention's keys and values computed once) or, without,
    re-running the whole decoder each step. Returns the decoder's tokens after the start token [B, n]."""
    start = torch.full((prompt.shape[0], 1), getattr(model, "decoder_start_id", 0), dtype=torch.long,
                       device=prompt.device)
    out = start
    state = model.start_decoding(prompt, max_new_tokens + 1) if use_cache else None
    for _ in range(max_new_tokens):
        if use_cache:
            logits = model.decode_step(out[:, -1:], state, out.shape[1] - 1)[:, -1]
        else:
            logits = model.seq2seq(prompt, out)[:, -1]
        nxt = sample_next(logits, temperature, top_k, top_p, gen)
        out = torch.cat([out, nxt[:, None]], dim=1)
        if eod_id is not None and bool((nxt == eod_id).all()):
            break
    return out[:, 1:]


def load_for_generation(run_dir: Path, device: torch.device) -> tuple[Transformer, Tokenizer]:
    from megaloom.train import load_run_config

    cfg = load_run_config(run_dir)
    family = get_family(cfg.model.arch)
    model = family.build(cfg.model)
    if not (family.traits.causal or family.traits.encoder_decoder):  # an encoder (bert) has no next token
        raise ConfigError(f"--run {run_dir}: model.arch={cfg.model.arch} is neither a decoder nor an encoder-decoder "
                          f"({family.description}); megaloom generate samples those only.")
    model = model.to(device)
    if load_newest(run_dir / "checkpoints", model, None, model_cfg=cfg.model.__dict__) is None:
        raise CheckpointError(f"--run {run_dir}: no usable checkpoint in {run_dir / 'checkpoints'}.")
    tok = Tokenizer.from_file(cfg.data.tokenizer)
    if family.traits.encoder_decoder:  # the decoder's first token is the one its training objective used
        model.decoder_start_id = family.objective.build(cfg, tok).start_id
    return model, tok


def image_prompt(model: Transformer, tok: Tokenizer, text: str, image_files: list[str],
                 device: torch.device) -> tuple[torch.Tensor, dict]:
    """The prompt ids [1, T] and image keywords for a question about images (`megaloom generate --image`): each
    "<image>" in ``text`` (or, if it has none, one before it per image) becomes the image's tokens; a question
    is wrapped as the training conversations are ("USER: ...\nASSISTANT: "), no text asks for a caption."""
    from megaloom.data.errors import DataError
    from megaloom.data.image_text.images import decode
    from megaloom.data.image_text.tokens import encode_records

    if not model.family.reads_images(model.cfg):
        raise DataError(f"--image: the run's model ({model.cfg.arch}) has no image encoder; use a multimodal run "
                        "(e.g. model.preset=llava-tiny)")
    if tok.image_id is None or tok.image_id != model.cfg.image_token_id:
        raise DataError(f"--image: the run's tokenizer has no <image> token matching model.image_token_id="
                        f"{model.cfg.image_token_id}")
    turn = f"USER: {text}\nASSISTANT: " if text else ""
    if turn.count("<image>") > len(image_files):
        raise DataError(f"--prompt has {turn.count('<image>')} <image> placeholders but {len(image_files)} --image")
    rec = {"images": list(image_files), "turns": [("prompt", "<image>" * (len(image_files) - turn.count("<image>"))
                                                   + turn)]}
    (ids, _), = encode_records([rec], tok, model.tokens_per_image)
    pixels = torch.stack([torch.from_numpy(decode(f, model.cfg.image_size, f)) for f in image_files])
    return (torch.tensor(ids[:-1], dtype=torch.long, device=device)[None],  # without the closing end-of-document
            {"images": pixels[None].to(device), "n_images": torch.tensor([len(image_files)], device=device)})


# Tokens that end an assistant's turn in the built-in templates and the common released ones (ChatML / Qwen,
# Llama 3, Gemma, Mistral-style end of sequence); those the run's vocabulary has stop a chat answer.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "</s>", "<|endoftext|>")


def chat_prompt(run_dir: Path, tok: Tokenizer, message: str, system: str = "") -> tuple[list[int], list[int]]:
    """(prompt ids, stop ids) for one user ``message`` (and a ``system`` prompt) to a chat-tuned run: rendered with
    the run's own template (its data.chat_template, as training rendered the conversations), the assistant's turn
    opened, the markup tokenized as special tokens; the answer stops at the template's end of turn."""
    from megaloom.data.chat.encode import _markup_as_specials
    from megaloom.data.chat.templates import resolve_template, special_tokens
    from megaloom.train import load_run_config

    cfg = load_run_config(run_dir)
    vocab = tok.hf.get_vocab()
    template = resolve_template(cfg.data.chat_template, cfg.data.tokenizer, vocab)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": message}]
    with _markup_as_specials(tok):
        ids = tok.encode(template.render(messages, True))
    eos = special_tokens(Path(cfg.data.tokenizer).expanduser().parent, vocab).get("eos_token")
    names = {*END_OF_TURN, *([eos] if eos else [])}
    stops = sorted({vocab[n] for n in names if n in vocab} | {tok.eod_id})
    return ids, stops

