"""What a chat template is to the code: a function from messages to the text the model reads."""

from __future__ import annotations

from collections.abc import Callable

Render = Callable[[list[dict], bool], str]  # (messages, add_generation_prompt) -> text
