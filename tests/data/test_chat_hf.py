"""The README's "fine-tune Llama 3.1 on your chat data" path, on a tiny Llama 3.1-shaped model built here (no
download): `convert --from-hf` brings the tokenizer's chat template along, `train data.format=chat` renders with
it, `convert --to-hf` exports the model with that template, which transformers then applies."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from megaloom.cli import main
from megaloom.data.tokenizer import Tokenizer
from tests.data.conftest import write_chats

transformers = pytest.importorskip("transformers")

# Llama 3.1 Instruct's chat template with its tool-calling branches left out: the dated system header, trimmed
# contents, <|eot_id|> ends of turn.
LLAMA31_TEMPLATE = (
    "{{- bos_token }}\n{%- if not date_string is defined %}\n    {%- set date_string = \"26 Jul 2024\" %}\n"
    "{%- endif %}\n{%- if messages[0]['role'] == 'system' %}\n    {%- set system_message = "
    "messages[0]['content']|trim %}\n    {%- set messages = messages[1:] %}\n{%- else %}\n    {%- set "
    "system_message = \"\" %}\n{%- endif %}\n{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n"
    "{{- \"Cutting Knowledge Date: December 2023\\n\" }}\n{{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n"
    "{{- system_message }}\n{{- \"<|eot_id|>\" }}\n{%- for message in messages %}\n    {{- '<|start_header_id|>' "
    "+ message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n{%- endif %}\n"
)


def tiny_llama31(folder, chat_tokenizer) -> None:
    """A random Llama 3.1-shaped model (its RoPE scaling, GQA, untied head) with the chat tokenizer."""
    vocab = Tokenizer.from_file(chat_tokenizer).vocab_size
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=2, vocab_size=vocab, max_position_embeddings=512,
                                   rope_theta=500000.0, tie_word_embeddings=False,
                                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    shutil.copyfile(chat_tokenizer, folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
        "chat_template": LLAMA31_TEMPLATE}))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_readme_fine_tune_path(tmp_path, chat_tokenizer, capsys, lora: bool):
    """Full fine-tuning, and the README's LoRA variant (adapters on the imported weights, exported merged by
    --to-hf and alone by --to-peft)."""
    hf, run, out = tmp_path / "Llama-3.1-tiny", tmp_path / "runs" / "llama31", tmp_path / "llama31-sft"
    tiny_llama31(hf, chat_tokenizer)
    chats = write_chats(tmp_path / "chats.jsonl", 40)

    assert main(["convert", "--from-hf", str(hf), str(run)]) == 0
    assert (run / "tokenizer_config.json").is_file()  # the chat template came along
    assert main(["train", "--config", str(run / "config.yaml"), "data.format=chat", f"data.paths={chats}",
                 "train.steps=4", "train.seq_len=256", "train.global_batch_size=4", "train.micro_batch_size=2",
                 "train.lr=1e-4", "train.min_lr=1e-5",
                 "data.split=90,10", "train.eval_batches=1", "checkpoint.every=0", "data.num_workers=0",
                 f"data.cache_dir={tmp_path / 'cache'}", "run.tensorboard=false",
                 *(["model.lora.rank=4", "model.lora.alpha=8"] if lora else [])]) == 0
    said = capsys.readouterr().out
    assert f"rendered with the {run / 'tokenizer_config.json'} chat template" in said
    start = "has no LoRA adapters: this run trains new ones" if lora else "resumed from"
    assert start in said and "done: step 4/4" in said  # from the imported weights, then 4 steps
    assert main(["convert", "--to-hf", str(run), str(out), "--no-progress"]) == 0
    if lora:
        adapter = tmp_path / "adapter"
        assert main(["convert", "--to-peft", str(run), str(adapter)]) == 0
        assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4

    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == LLAMA31_TEMPLATE and tok.bos_token == "<|begin_of_text|>"
    messages = [{"role": "user", "content": "what is 2 + 2?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|begin_of_text|><|start_header_id|>system") and prompt.endswith(
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert model(**ids).logits.shape[-1] == model.config.vocab_size

    # `megaloom generate --chat` renders the same prompt transformers does and answers from the run itself
    from megaloom.data.tokenizer import Tokenizer
    from megaloom.generate import chat_prompt

    mine, stops = chat_prompt(run, Tokenizer.from_file(run / "tokenizer.json"), "what is 2 + 2?")
    assert mine == tok(prompt, add_special_tokens=False)["input_ids"]  # the text apply_chat_template rendered
    assert tok.convert_tokens_to_ids("<|eot_id|>") in stops
    capsys.readouterr()
    assert main(["generate", "--run", str(run), "--chat", "--prompt", "what is 2 + 2?", "--max-new-tokens", "4",
                 "--temperature", "0"]) == 0
    answer = capsys.readouterr().out
    assert "<|start_header_id|>" not in answer and "what is 2 + 2" not in answer  # the answer alone
