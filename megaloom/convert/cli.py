"""`megaloom convert --to-hf RUN_OR_CKPT OUT` / `--from-hf HF_DIR OUT_RUN` / `--to-peft RUN_OR_CKPT OUT`.

megaloom/cli.py adds the sub-command with `add_convert_parser(sub)`; the handler is `run_convert`.
"""

from __future__ import annotations

import argparse

from megaloom.convert.hf_config import DTYPES


def add_convert_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("convert", help="export a checkpoint to a Hugging Face model directory, or import one")
    way = p.add_mutually_exclusive_group(required=True)
    way.add_argument("--to-hf", nargs=2, metavar=("RUN_OR_CKPT", "OUT"),
                     help="run directory (its newest good checkpoint) or run/checkpoints/step_N -> HF directory")
    way.add_argument("--from-hf", nargs=2, metavar=("HF_DIR", "OUT_RUN"),
                     help="HF directory (config.json + safetensors) -> new megaloom run directory")
    way.add_argument("--to-peft", nargs=2, metavar=("RUN_OR_CKPT", "OUT"),
                     help="a LoRA run (model.lora) or its checkpoint -> PEFT adapter directory "
                          "(adapter_config.json + adapter_model.safetensors); --to-hf merges the adapters instead")
    p.add_argument("--peft", metavar="ADAPTER_DIR", help="with --from-hf: a PEFT LoRA adapter trained on that model, "
                   "imported with it (model.lora from its adapter_config.json): train it on, or --to-hf merges it")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES), help="with --to-hf / --to-peft: weight dtype")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="with --to-hf: shard size limit (GiB)")
    p.add_argument("--no-progress", action="store_true", help="with --to-hf: no progress bar")
    p.set_defaults(fn=run_convert)
    return p


def run_convert(args: argparse.Namespace) -> int:
    from megaloom.convert.hf import from_hf, to_hf

    if args.peft and not args.from_hf:
        from megaloom.convert.errors import ConversionError

        raise ConversionError("--peft ADAPTER_DIR goes with --from-hf HF_DIR OUT_RUN (the base model it adapts).")
    if args.to_peft:
        from megaloom.convert.peft import to_peft

        out = to_peft(args.to_peft[0], args.to_peft[1], dtype=args.dtype)
        print(f"wrote {out} (load with peft's PeftModel.from_pretrained on the base model, e.g. the --to-hf export "
              "of the checkpoint it was trained from)")
    elif args.to_hf:
        out = to_hf(args.to_hf[0], args.to_hf[1], show_progress=not args.no_progress, dtype=args.dtype,
                    max_shard_bytes=int(args.max_shard_gb * 2**30))
        print(f"wrote {out} (load with transformers' AutoModelForCausalLM.from_pretrained)")
    else:
        ckpt = from_hf(args.from_hf[0], args.from_hf[1], peft_dir=args.peft)
        print(f"wrote {ckpt}; fine-tune with: megaloom train --config {ckpt.parent.parent / 'config.yaml'} "
              "data.paths=... train.steps=...")
    return 0
