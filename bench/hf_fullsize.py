"""HF interchange at full size on a GPU: the released config.json of each model, random weights, megaloom's import
mapping (`model_settings` + `from_hf_names`, the same code `megaloom convert --from-hf` runs) and export mapping
(`to_hf_names`), logits against transformers in float32 (TF32 off).

The tests check the same mappings with files at tiny sizes on CPU; this checks that the released shapes (head_dim
128, vocabularies of 128k-152k, 128 experts, RoPE scaling at real lengths) go through too. The weights stay in
memory: writing 30-60 GB of safetensors per model would only test the disk. A model too large for two float32 copies
on one GPU keeps its full width and shape and fewer layers (`--layers`); the row says so.

    python bench/hf_fullsize.py --out results.jsonl [--models llama-3.1-8b,qwen3-30b-a3b] [--seq 512]
    python bench/hf_fullsize.py --tiny     # the same code at tiny sizes on CPU (a smoke test of the script)
    python bench/hf_fullsize.py --models qwen3-30b-a3b --layers 2   # full width, fewer layers (a small machine)
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaloom.config import Config  # noqa: E402
from megaloom.convert.hf_config import model_settings  # noqa: E402
from megaloom.convert.hf_names import from_hf_names, to_hf_names  # noqa: E402
from megaloom.models.presets import PRESETS  # noqa: E402
from megaloom.models.registry import get_family  # noqa: E402
from tests.checkpoint.test_hf_moe import MIXTRAL_8X7B, QWEN3_30B_A3B  # noqa: E402
from tests.checkpoint.test_hf_rope_scaling import LLAMA_31_8B, LLAMA_32_1B, QWEN3_8B_YARN  # noqa: E402

# name -> (released config.json, layers kept at full size: None = all). Two float32 copies must fit one H200.
MODELS = {
    "llama-3.2-1b": (LLAMA_32_1B, None),
    "llama-3.1-8b": (LLAMA_31_8B, None),
    "qwen3-8b-yarn": (QWEN3_8B_YARN, None),
    "qwen3-30b-a3b": (QWEN3_30B_A3B, 8),   # 48 layers of 128 experts: 122 GB per float32 copy
    "mixtral-8x7b": (MIXTRAL_8X7B, 4),     # 32 layers of 8 experts: 187 GB per float32 copy
}
TINY = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=2, num_hidden_layers=2, vocab_size=256)


def model_config(hf: dict):
    settings = model_settings(hf, "config.json")
    cfg = Config()
    for k, v in {**PRESETS[settings["preset"]], **settings}.items():
        setattr(cfg.model, k, v)
    return cfg.model


def check(name: str, hf: dict, seq: int, device: torch.device, hf_rope: bool = False) -> dict:
    import transformers

    t0 = time.time()
    hf_cfg = transformers.AutoConfig.for_model(**hf)
    torch.manual_seed(0)
    with device:
        ref = transformers.AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in ref.parameters())
    x = torch.randint(0, hf["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        want = ref(x).logits.float()
    hf_sd = {k: v for k, v in ref.state_dict().items()}
    m = model_config(hf)
    tensors = from_hf_names(m, dict(hf_sd), name)
    ref_rope = _rope_of(ref)
    del ref
    gc.collect()
    with torch.device("meta"):
        model = get_family(m.arch).build(m)
    model.load_state_dict(tensors, strict=True, assign=True)
    for mod in model.modules():  # non-persistent buffers (RoPE tables) are not in the state dict: made here
        for key, buf in mod._buffers.items():
            if buf is not None and buf.is_meta:
                mod._buffers[key] = torch.empty_like(buf, device=device)
    model = model.to(device).eval()
    model.reset_buffers()
    if hf_rope:  # transformers' own cos/sin tables (angles in float32) instead of megaloom's (float64, then cast)
        cos, sin = ref_rope(hf_cfg, model.rope_cos.shape[0], device)
        model.rope_cos.copy_(cos)
        model.rope_sin.copy_(sin)
    with torch.no_grad():
        got = model(x).float()
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    # export writes the released layout (per-expert tensors, no tied lm_head); importing that again must give
    # every tensor back bit for bit
    mine = model.state_dict()
    again = from_hf_names(m, to_hf_names(m, dict(mine)), name)
    export_equal = set(again) == set(tensors) and all(torch.equal(again[k], mine[k]) for k in tensors)
    del mine, again
    del model, tensors, hf_sd
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"model": name, "layers": hf["num_hidden_layers"], "params": n_params, "seq": seq,
            "max_abs_err": err, "max_abs_logit": scale, "rel_err": err / scale, "export_equal": export_equal,
            "seconds": round(time.time() - t0, 1)}


def _rope_of(ref):
    """A function (config, length, device) -> transformers' cos/sin tables [length, head_dim] for ``ref``."""
    rot = ref.model.rotary_emb

    def tables(_cfg, n: int, device: torch.device):
        cos, sin = rot(torch.zeros(1, n, 1, device=device), torch.arange(n, device=device)[None])
        return cos[0].float(), sin[0].float()

    return tables


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--tiny", action="store_true", help="tiny sizes on CPU: a smoke test of this script")
    ap.add_argument("--out", default=None, help="append one JSON row per model here")
    ap.add_argument("--atol", type=float, default=1e-4, help="the bar on max |logit difference|")
    ap.add_argument("--hf-rope", action="store_true",
                    help="give megaloom transformers' RoPE tables (a diagnosis: how much of the gap they explain)")
    ap.add_argument("--layers", type=int, default=None,
                    help="keep this many layers of every model (full width; for a machine too small for them all)")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    bad = 0
    for name in args.models.split(","):
        hf, layers = MODELS[name]
        hf = dict(hf)
        if args.tiny:
            hf.update({k: v for k, v in TINY.items() if k in hf or k != "moe_intermediate_size"})
            if "head_dim" in hf:
                hf["head_dim"] = TINY["hidden_size"] // TINY["num_attention_heads"]
        elif args.layers is not None or layers is not None:
            layers = args.layers if args.layers is not None else layers
            hf["num_hidden_layers"] = layers
        try:
            row = check(name, hf, 32 if args.tiny else args.seq, device, args.hf_rope)
            row["hf_rope"] = args.hf_rope
        except Exception as e:  # one model's failure is reported, the others still run
            row = {"model": name, "error": f"{type(e).__name__}: {e}"}
        row.update(bench="hf_fullsize", date=datetime.date.today().isoformat(), torch=torch.__version__,
                   device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                   full_size=not args.tiny and layers is None, atol=args.atol)
        row["ok"] = "error" not in row and row["max_abs_err"] <= args.atol and row["export_equal"]
        bad += not row["ok"]
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
