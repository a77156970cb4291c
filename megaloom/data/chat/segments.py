"""Which characters of a rendered conversation are trained: the assistant's answers, found by rendering prefixes.

A chat template is a program (jinja); what it prints for one message can depend on the others, so the trained text
cannot be found by looking for the message's content in the output. Instead, for each assistant message i, the
conversation up to i is rendered with the generation prompt (everything the model is given before it answers,
the assistant header included) and the conversation through i without it: the difference is what the model must
produce, its answer and the template's end-of-turn text (``<|eot_id|>``, ``<|im_end|>\\n``). Every other
character (system, user and tool turns, role headers) is context, not trained. This is the rule transformers'
``{% generation %}`` tags express, without needing templates to carry them.

It needs the template to be *prefix-stable*: the rendering of a conversation's beginning is the beginning of the
rendering of the whole. Templates that rewrite earlier turns (e.g. drop an earlier answer's reasoning) are not:
refused with the file and line, and the fix.
"""

from __future__ import annotations

from megaloom.data.chat.records import TRAINED_ROLE, Conversation
from megaloom.data.chat.templates import ChatTemplate
from megaloom.data.errors import DataError

Segment = tuple[str, bool]  # (text, trained)


def _render(template: ChatTemplate, conv: Conversation, n: int, prompt: bool) -> str:
    try:
        return template.render(conv.messages[:n], prompt)
    except Exception as e:  # jinja's TemplateError / UndefinedError, a template's raise_exception(...)
        raise DataError(f"{conv.where}: the chat template {template.name} failed on the first {n} message(s) "
                        f"({type(e).__name__}: {e}); fix the conversation, or set data.chat_template to another "
                        "template (chatml, llama3 or a .jinja file)") from e


def _extend(template: ChatTemplate, conv: Conversation, before: str, after: str) -> str:
    if not after.startswith(before):
        raise DataError(f"{conv.where}: the chat template {template.name} is not prefix-stable (rendering more "
                        "messages changed the text of earlier ones), so the assistant's tokens cannot be told "
                        "apart; set data.chat_template to a template that only appends (chatml, llama3 or a .jinja "
                        "file)")
    return after[len(before):]


def segments(template: ChatTemplate, conv: Conversation) -> list[Segment]:
    """The rendered conversation as consecutive (text, trained) pieces; joined, they are the whole rendering."""
    out: list[Segment] = []
    done = ""  # the rendering of the messages handled so far
    for i, m in enumerate(conv.messages):
        if m["role"] == TRAINED_ROLE:
            prompt = _render(template, conv, i, True)
            out.append((_extend(template, conv, done, prompt), False))
            full = _render(template, conv, i + 1, False)
            out.append((_extend(template, conv, prompt, full), True))
        else:
            full = _render(template, conv, i + 1, False)
            out.append((_extend(template, conv, done, full), False))
        done = full
    merged: list[Segment] = []
    for text, trained in out:  # neighbours with the same flag become one piece; empty pieces go
        if not text:
            continue
        if merged and merged[-1][1] == trained:
            merged[-1] = (merged[-1][0] + text, trained)
        else:
            merged.append((text, trained))
    return merged
