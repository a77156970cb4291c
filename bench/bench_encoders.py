"""Training-step speed of megaloom's encoder families against Hugging Face transformers on the same shapes, in
one call: bert-large (BertForMaskedLM, masked-LM rows) and t5-base (T5ForConditionalGeneration, span-corruption
rows), one GPU, bf16 autocast over fp32 master weights, fused AdamW, the same batches for both peers.

Reported per model and peer: median step time, tokens/s (the rows' ``seq_len`` tokens: what the data pipeline
consumes) and an MFU from 6 x matmul parameters x tokens (the same formula for both peers, so their ratio is the
speed ratio; attention FLOPs are left out).

    python bench/bench_encoders.py                                  # H200: bert-large and t5-base, seq 512
    python bench/bench_encoders.py --device cpu --presets bert-tiny,t5-tiny --seq 64 --batch 2 --steps 3  # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaloom.config import load_config  # noqa: E402
from megaloom.data.objective import inputs_and_labels  # noqa: E402
from megaloom.models.registry import get_family  # noqa: E402
from megaloom.models.t5.spans import encoder_length  # noqa: E402

H200_BF16_PEAK = 989e12


class _Tok:
    """A stand-in tokenizer of ``vocab_size - 64`` ids (room for the objectives' own) with EOD 0."""

    def __init__(self, vocab: int) -> None:
        self.vocab_size, self.eod_id = vocab - 64, 0


def batches(cfg, n: int, batch: int, seq: int, seed: int = 0) -> list[torch.Tensor]:
    obj = get_family(cfg.model.arch).objective.build(cfg, _Tok(cfg.model.vocab_size))
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(1, cfg.model.vocab_size - 64, (n * batch, seq + 1), generator=g).numpy()
    out = torch.stack([torch.from_numpy(obj.sample(r, i, "train")) for i, r in enumerate(rows)])
    return list(out.split(batch))


def hf_model(cfg):
    import transformers

    m = cfg.model
    if m.arch == "bert":
        c = transformers.BertConfig(vocab_size=m.vocab_size, hidden_size=m.d_model, num_hidden_layers=m.n_layers,
                                    num_attention_heads=m.n_heads, intermediate_size=m.ffn_dim,
                                    max_position_embeddings=m.max_seq_len, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0, layer_norm_eps=m.norm_eps,
                                    attn_implementation="sdpa")
        model = transformers.BertForMaskedLM(c)
        return model, lambda x, y: model(input_ids=x, labels=y).loss
    c = transformers.T5Config(vocab_size=m.vocab_size, d_model=m.d_model, d_kv=m.d_model // m.n_heads, d_ff=m.ffn_dim,
                              num_layers=m.n_layers, num_heads=m.n_heads, feed_forward_proj="gated-gelu",
                              dropout_rate=0.0, layer_norm_epsilon=m.norm_eps, attn_implementation="sdpa")
    model = transformers.T5ForConditionalGeneration(c)

    def loss(x, y):
        te = encoder_length(x.shape[1])
        return model(input_ids=x[:, :te].contiguous(), decoder_input_ids=x[:, te:].contiguous(),
                     labels=y[:, te:].contiguous()).loss

    return model, loss


def ours(cfg):
    model = get_family(cfg.model.arch).build(cfg.model)
    return model, lambda x, y: model(x, y)


def run(model, loss_fn, data: list[torch.Tensor], device: torch.device, warmup: int) -> list[float]:
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    times = []
    for i, b in enumerate(data):
        x, y = (t.contiguous().to(device, non_blocking=True) for t in inputs_and_labels(b))
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_fn(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    model.to("cpu")
    del opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return times


def matmul_params(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="bert-large,t5-base")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = []
    for preset in args.presets.split(","):
        cfg = load_config(None, [f"model.preset={preset}", "model.dropout=0.0", f"train.seq_len={args.seq}",
                                 *(["model.vocab_size=8192"] if "tiny" in preset else [])])
        data = batches(cfg, args.steps + args.warmup, args.batch, args.seq)
        tokens = args.batch * args.seq
        for peer, make in (("megaloom", ours), ("transformers", hf_model)):
            torch.manual_seed(0)
            model, loss_fn = make(cfg)
            n = matmul_params(model)
            t = statistics.median(run(model, loss_fn, data, device, args.warmup))
            row = dict(preset=preset, peer=peer, seq=args.seq, batch=args.batch, step_s=round(t, 5),
                       tokens_per_s=round(tokens / t), mfu=round(6 * n * tokens / t / H200_BF16_PEAK, 4),
                       matmul_params=n, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
            rows.append(row)
            print(json.dumps(row), flush=True)
            del model
    if args.out:
        Path(args.out).write_text("\n".join(json.dumps(r) for r in rows) + "\n")


if __name__ == "__main__":
    main()
