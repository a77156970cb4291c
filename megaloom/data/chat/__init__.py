"""Supervised fine-tuning data (data.format=chat): JSONL conversations rendered with a chat template, tokenized
with the assistant's tokens flagged as targets, packed whole into rows (docs/data.md, "Chat data").

``records`` (files, lines checked), ``templates`` / ``jinja`` (built-in and tokenizer templates), ``segments``
(which text is trained), ``encode`` (tokens, targets, the cache), ``dataset`` (packed rows, `build_chat_datasets`),
``identity`` (what a checkpoint records), ``settings`` (what the format refuses).
"""
