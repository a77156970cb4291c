"""A tokenizer's jinja chat template rendered as transformers' `apply_chat_template` renders it.

The environment mirrors transformers': a sandbox (templates come with downloaded tokenizers: untrusted code),
``trim_blocks``/``lstrip_blocks``, loop controls, ``raise_exception``, ``strftime_now``, a ``tojson`` that does not
escape HTML, and the ``{% generation %}`` tag (rendered as its body; megaloom finds assistant tokens by rendering
prefixes instead, segments.py). One difference on purpose: ``strftime_now`` returns a fixed day (Llama 3.1's
own default date), because a template that prints today's date would make the training tokens depend on the
day the data was rendered, and the data cache and exact resume on the date.
"""

from __future__ import annotations

import json
from datetime import datetime

from megaloom.data.chat.render import Render
from megaloom.data.errors import DataError

FIXED_NOW = datetime(2024, 7, 26)


def _environment():
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with it; here it renders
        its body unchanged."""

        tags = {"generation"}

        def parse(self, parser) -> list[nodes.Node]:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = FIXED_NOW.strftime
    return env


def jinja_render(source: str, specials: dict[str, str], where: str) -> Render:
    """``source`` compiled once: (messages, add_generation_prompt) -> text, with the tokenizer's special tokens."""
    try:
        import jinja2
    except ImportError:
        raise DataError(f"the chat template in {where} is jinja, and jinja2 is not installed: pip install jinja2, or "
                        "set data.chat_template=chatml (or llama3) to use a built-in template") from None
    try:
        template = _environment().from_string(source)
    except jinja2.TemplateError as e:
        raise DataError(f"the chat template in {where} does not compile ({e}); fix it, or set "
                        "data.chat_template=chatml (or llama3) to use a built-in template") from e

    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **specials)

    return render
