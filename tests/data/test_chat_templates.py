"""Chat templates (data/chat/templates.py, jinja.py, segments.py): built-ins equal their jinja sources and
transformers' rendering, `auto` finds a tokenizer's template, and the trained text is exactly the answers."""

from __future__ import annotations

import json
import shutil

import pytest

from megaloom.data.chat.jinja import jinja_render
from megaloom.data.chat.records import Conversation
from megaloom.data.chat.segments import segments
from megaloom.data.chat.templates import CHATML_JINJA, LLAMA3_JINJA, ChatTemplate, resolve_template
from megaloom.data.errors import DataError

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi\n"},
            {"role": "assistant", "content": " hello "}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}]


def test_builtins_equal_their_jinja_sources():
    specials = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    for name, source in (("chatml", CHATML_JINJA), ("llama3", LLAMA3_JINJA)):
        builtin = resolve_template(name, "", {"<|begin_of_text|>": 0})
        jinja = jinja_render(source, specials, name)
        for n in range(len(MESSAGES) + 1):
            for prompt in (False, True):
                assert builtin.render(MESSAGES[:n], prompt) == jinja(MESSAGES[:n], prompt), (name, n, prompt)
    text = resolve_template("llama3", "", {"<|begin_of_text|>": 0}).render(MESSAGES[:3], True)
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\nhello<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_jinja_rendering_equals_transformers(chat_tokenizer):
    """Our jinja environment renders a template as transformers' apply_chat_template does (HF-style features:
    loop controls, tojson, raise_exception, the generation tag)."""
    transformers = pytest.importorskip("transformers")
    template = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}"
                "{% if loop.index0 > 8 %}{% break %}{% endif %}<{{ m['role'] }}>{{ m['content'] | tojson }}"
                "{% if m['role'] == 'assistant' %}{% generation %}{{ eos_token }}{% endgeneration %}{% endif %}\n"
                "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(chat_tokenizer), eos_token="<|im_end|>")
    ours = jinja_render(template, {"eos_token": "<|im_end|>"}, "test")
    for prompt in (False, True):
        theirs = tok.apply_chat_template(MESSAGES, chat_template=template, tokenize=False,
                                         add_generation_prompt=prompt)
        assert ours(MESSAGES, prompt) == theirs


def test_auto_finds_the_tokenizers_template(chat_tokenizer, tmp_path):
    assert resolve_template("auto", str(chat_tokenizer)).name == "chatml"  # none shipped: the built-in ChatML
    folder = tmp_path / "tok"
    shutil.copytree(chat_tokenizer.parent, folder)
    custom = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": custom, "bos_token": "<s>",
                                                              "eos_token": {"content": "<|im_end|>"}}))
    found = resolve_template("auto", str(folder / "tokenizer.json"))
    assert found.source == custom
    assert found.render(MESSAGES[1:3], False) == "[user] hi\n<|im_end|>[assistant]  hello <|im_end|>"
    assert resolve_template("llama3", str(folder / "tokenizer.json")).render(MESSAGES[:1], False).startswith("<s>")
    named = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "{{ messages | length }}"}]
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert resolve_template("auto", str(folder / "tokenizer.json")).render(MESSAGES, False) == "5"
    (folder / "chat_template.jinja").write_text("J{{ messages | length }}")  # transformers' newer layout wins
    assert resolve_template("auto", str(folder / "tokenizer.json")).render(MESSAGES, False) == "J5"
    (tmp_path / "mine.jinja").write_text("M")
    assert resolve_template(str(tmp_path / "mine.jinja"), "").render(MESSAGES, False) == "M"
    with pytest.raises(DataError, match="data.chat_template=.*nope.jinja: no such file"):
        resolve_template(str(tmp_path / "nope.jinja"), "")


def test_trained_text_is_the_answers_and_their_end_of_turn():
    conv = Conversation(MESSAGES, "chats.jsonl:1")
    for name, answers in (("chatml", [" hello <|im_end|>\n", "4<|im_end|>\n"]),
                          ("llama3", ["hello<|eot_id|>", "4<|eot_id|>"])):
        template = resolve_template(name, "", {"<|begin_of_text|>": 0})
        parts = segments(template, conv)
        assert "".join(t for t, _ in parts) == template.render(MESSAGES, False)
        assert [t for t, trained in parts if trained] == answers, name
        assert parts[-1][1]  # the conversation ends with an answer


def test_a_template_that_rewrites_earlier_turns_is_refused():
    # Shows only the last assistant message: the rendering of a beginning is not the beginning of the whole.
    def render(messages, prompt):
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        return "".join(m["content"] for i, m in enumerate(messages) if m["role"] != "assistant" or i == last)

    with pytest.raises(DataError, match=r"chats.jsonl:7: the chat template odd is not prefix-stable.*"
                                        "data.chat_template"):
        segments(ChatTemplate("odd", "", render), Conversation(MESSAGES, "chats.jsonl:7"))
    failing = jinja_render("{{ raise_exception('roles must alternate') }}", {}, "strict")
    with pytest.raises(DataError, match="chats.jsonl:2: the chat template strict failed.*roles must alternate"):
        segments(ChatTemplate("strict", "", failing), Conversation(MESSAGES, "chats.jsonl:2"))
