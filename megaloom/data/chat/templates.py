"""Chat templates: a conversation (role/content messages) -> the text the model reads.

`data.chat_template` picks one:
- ``auto``: the template shipped with the tokenizer (``chat_template.jinja`` or ``tokenizer_config.json``'s
  ``chat_template`` beside `data.tokenizer`, as transformers reads them), else the built-in ``chatml``;
- ``chatml`` / ``llama3``: built in, written in Python here, so they need no jinja2;
- a path to a ``.jinja`` file.

A tokenizer's template is rendered by jinja2 (jinja.py), which transformers uses too and torch installs. Each
built-in template keeps its jinja source beside the Python: the source is what a chat export writes into
tokenizer_config.json (so `apply_chat_template` formats prompts as training did), and the tests render both and
compare.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from megaloom.data.chat.render import Render
from megaloom.data.errors import DataError


@dataclass(frozen=True)
class ChatTemplate:
    """A named template: ``render(messages, add_generation_prompt)`` and its jinja ``source``."""

    name: str  # "chatml", "llama3", or the file the jinja source came from
    source: str  # jinja text: exported with the model and hashed into the data cache key
    render: Render = field(compare=False)


def _chatml(messages: list[dict], add_generation_prompt: bool) -> str:
    """ChatML (Qwen, many open chat models): <|im_start|>role\\ncontent<|im_end|>\\n per message."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


CHATML_JINJA = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _llama3(bos: str) -> Render:
    """Llama 3 Instruct's format (Meta's template for 3.0; 3.1-3.3's own add a dated system header and tools: with
    their tokenizer_config.json beside data.tokenizer, `auto` uses theirs)."""

    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        text = "".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
                       for m in messages)
        text = (bos + text) if messages else text
        return text + ("<|start_header_id|>assistant<|end_header_id|>\n\n" if add_generation_prompt else "")

    return render


LLAMA3_JINJA = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 "
    "%}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

BUILT_IN = ("chatml", "llama3")


def special_tokens(tokenizer_dir: Path | None, vocab: dict[str, int] | None = None) -> dict[str, str]:
    """The special-token texts a template may read (``bos_token``, ``eos_token``, ...), from tokenizer_config.json;
    without one, ``bos_token`` is Llama 3's ``<|begin_of_text|>`` when the vocabulary has it (else empty)."""
    out: dict[str, str] = {}
    config = _tokenizer_config(tokenizer_dir)
    for key, value in config.items():
        if key.endswith("_token"):
            text = value.get("content") if isinstance(value, dict) else value
            if isinstance(text, str):
                out[key] = text
    if "bos_token" not in out:
        out["bos_token"] = "<|begin_of_text|>" if vocab and "<|begin_of_text|>" in vocab else ""
    return out


def _tokenizer_config(tokenizer_dir: Path | None) -> dict:
    path = tokenizer_dir / "tokenizer_config.json" if tokenizer_dir is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is not readable JSON ({e}); fix or remove it, or set data.chat_template=chatml "
                        "(or llama3) to use a built-in template") from e
    return config if isinstance(config, dict) else {}


def tokenizer_template(tokenizer_dir: Path | None) -> tuple[str, Path] | None:
    """(jinja source, where) of the template shipped with a tokenizer, as transformers finds it: a
    ``chat_template.jinja`` file first, else tokenizer_config.json's ``chat_template`` (a string, or a list of
    named templates of which ``default`` is taken); None when it has none."""
    if tokenizer_dir is None:
        return None
    jinja_file = tokenizer_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), jinja_file
    value = _tokenizer_config(tokenizer_dir).get("chat_template")
    if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
    if isinstance(value, str) and value.strip():
        return value, tokenizer_dir / "tokenizer_config.json"
    return None


def resolve_template(setting: str, tokenizer_path: str, vocab: dict[str, int] | None = None) -> ChatTemplate:
    """The template `data.chat_template` names, for the tokenizer at ``tokenizer_path`` ("" = the default one)."""
    tokenizer_dir = Path(tokenizer_path).expanduser().parent if tokenizer_path else None
    specials = special_tokens(tokenizer_dir, vocab)
    if setting == "chatml":
        return ChatTemplate("chatml", CHATML_JINJA, _chatml)
    if setting == "llama3":
        return ChatTemplate("llama3", LLAMA3_JINJA, _llama3(specials["bos_token"]))
    if setting == "auto":
        found = tokenizer_template(tokenizer_dir)
        if found is None:
            return ChatTemplate("chatml", CHATML_JINJA, _chatml)
        source, where = found
    else:
        where = Path(setting).expanduser()
        if not where.is_file():
            raise DataError(f"data.chat_template={setting}: no such file; give a .jinja template file, or one of "
                            f"auto, {', '.join(BUILT_IN)}")
        source = where.read_text(encoding="utf-8")
    from megaloom.data.chat.jinja import jinja_render

    return ChatTemplate(str(where), source, jinja_render(source, specials, str(where)))
