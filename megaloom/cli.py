"""Command-line entry points: `megaloom train | preprocess | tokenizer | generate | plot | doctor | evict | schedule
| status | convert | memory | plan | config`."""

from __future__ import annotations

import argparse
import errno
import os
import subprocess
import sys
from pathlib import Path

from megaloom.config import ConfigError, describe_keys, load_config
from megaloom.errors import RunStopped
from megaloom.resilience.peers import PeerLost


def _cmd_train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)  # validated before anything heavy
    verbosity = "quiet" if args.quiet else "verbose" if args.verbose else "normal"
    if args.dry_run:
        if not args.world:
            raise ConfigError("--dry-run needs --world N: the size of the job whose rank it builds.")
        if args.nproc:
            raise ConfigError("--dry-run runs one rank in this process; leave out --nproc.")
        from megaloom.observe.log import console_verbosity
        from megaloom.training.dryrun import main_dry_run

        with console_verbosity(verbosity):
            return main_dry_run(cfg, args.world, args.rank, args.dry_run_steps, args.dry_run_memory_gb,
                                args.dry_run_json, args.dry_run_dir)
    if args.world or args.rank != "0":
        raise ConfigError("--world and --rank belong to --dry-run (a real run takes them from torchrun).")
    if args.nproc and args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        from megaloom.parallel.launch import run_torchrun, torchrun_command
        from megaloom.preflight import preflight_launch
        from megaloom.resilience.run_lock import check_run_dir_free

        preflight_launch(cfg, args.nproc)  # a user error prints once here (exit 2), not once per rank
        check_run_dir_free(Path(cfg.run.dir))  # another run in run.dir: refused here, once (rank 0 takes the lock)
        flags = {"quiet": ["--quiet"], "verbose": ["--verbose"]}.get(verbosity, [])  # the workers log alike
        argv = (["--config", args.config] if args.config else []) + flags + list(args.overrides)
        return run_torchrun(torchrun_command(args.nproc, argv, max_restarts=args.max_restarts),  # signals passed on
                            run_dir=Path(cfg.run.dir))
    from megaloom.observe.log import console_verbosity
    from megaloom.training.trainer import Trainer

    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: never train on alone once torchrun is gone
        from megaloom.parallel.launch import die_with_parent

        die_with_parent()

    args.trainer = Trainer(cfg)  # main() reads its step and run directory if Ctrl-C stops the run
    with console_verbosity(verbosity):
        result = args.trainer.build().fit()
    args.trainer.close()  # every rank done before any tears down
    if result.stopped_by is not None:  # SIGTERM/SIGUSR1/Ctrl-C, saved first (resilience.save_on_signal)
        if os.environ.get("RANK", "0") == "0":
            print(_interrupted_line(args, result.stopped_by), file=sys.stderr, flush=True)
        return 130 if result.stopped_by == "SIGINT" else 0
    return 0


def _peer_lost_line(args: argparse.Namespace, e: BaseException) -> str | None:
    """For a torchrun worker of `megaloom train` whose collective failed because another rank died: the line
    naming it ("" when a lower rank says it); None for any other error."""
    from megaloom.resilience.peers import describe, peer_loss

    world = int(os.environ.get("WORLD_SIZE", "1"))
    pattern = peer_loss(e) if world > 1 and getattr(args, "command", None) == "train" else None
    if pattern is None:
        return None
    trainer = getattr(args, "trainer", None)
    if trainer is None:  # no process group exists before the trainer
        return None
    run_dir = getattr(trainer, "run_dir", None) or Path(trainer.requested.run.dir)
    return describe(pattern, int(os.environ.get("RANK", "0")), world, getattr(trainer, "step", None), run_dir)


def _say(args: argparse.Namespace, line: str, kind: str, **facts) -> None:
    """The line this process ends with: printed, or handed to `megaloom train --nproc N`'s launcher, which says one
    line for the job (parallel/last_words.py)."""
    from megaloom.parallel.last_words import say

    step = getattr(getattr(args, "trainer", None), "step", None)
    say(line, kind=kind, step=None if step is None else step + 1, **facts)


def _loader_died(args: argparse.Namespace, e: BaseException) -> bool:
    """A data-loader worker of this rank died (killed, out of memory): one line naming it, the step and the
    checkpoint the next run resumes from, instead of the DataLoader's traceback; False for any other error."""
    from megaloom.parallel.last_words import loader_death
    from megaloom.resilience.peers import restart_note

    cause = loader_death(e) if getattr(args, "command", None) == "train" else None
    if cause is None:
        return False
    trainer = getattr(args, "trainer", None)
    run_dir = None if trainer is None else getattr(trainer, "run_dir", None) or Path(trainer.requested.run.dir)
    step = getattr(trainer, "step", None)
    when = "while the job was starting" if step is None else f"at step {step + 1}"
    rank = os.environ.get("RANK", "0")
    _say(args, f"stopped: a data-loader worker of rank {rank} died {when} ({cause}); {restart_note(run_dir)}",
         "loader", cause=cause)
    return True


def _interrupted_line(args: argparse.Namespace, signal_name: str = "SIGINT") -> str:
    """What a signal stopped: the step reached and the newest checkpoint on disk (to resume from)."""
    trainer = getattr(args, "trainer", None)
    if trainer is None:  # the launcher of --nproc, or before the config was read
        return "megaloom: interrupted"
    if not hasattr(trainer, "step"):
        return "megaloom: interrupted while starting, before the first step"
    saver = getattr(getattr(trainer, "ckpt", None), "saver", None)
    if saver is not None:
        saver.join_write()  # a background save in flight ends first (the process would wait for it anyway)
    ckpt_root = trainer.run_dir / "checkpoints"
    latest = ckpt_root / "latest"
    name = latest.read_text().strip() if latest.is_file() else ""
    if name.startswith("step_") and (ckpt_root / name).is_dir():
        last = f"the last checkpoint is step {int(name[len('step_'):])} ({ckpt_root / name})"
    else:
        last = "no checkpoint was written"
    what = "interrupted" if signal_name == "SIGINT" else f"stopped by {signal_name}"
    return f"megaloom: {what} at step {trainer.step}; {last}"


def _cmd_preprocess(args: argparse.Namespace) -> int:
    from megaloom.data.preprocess import preprocess

    stats = preprocess(args.inputs, args.tokenizer, args.out, workers=args.workers, json_key=args.json_key,
                       split=args.split)
    print(f"wrote {args.out}.bin/.idx: {stats.n_docs} documents, {stats.n_tokens:,} tokens ({stats.dtype}) "
          f"in {stats.seconds:.1f}s")
    return 0


def _cmd_tokenizer(args: argparse.Namespace) -> int:
    from megaloom.data.preprocess import iter_documents
    from megaloom.data.tokenizer import train_bpe_on_texts

    # The documents `megaloom preprocess` would tokenize: JSONL's text field (--json-key), not the raw lines.
    out = train_bpe_on_texts(iter_documents(args.inputs, args.json_key, args.split), args.vocab_size, Path(args.out))
    print(f"wrote {out}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from megaloom import accelerator
    from megaloom.generate import generate, load_for_generation

    device = accelerator.default_device()
    model, tok = load_for_generation(Path(args.run), device)
    images = None
    if args.image:  # a multimodal run: the images' tokens, then the question (if any)
        from megaloom.generate import image_prompt

        prompt, images = image_prompt(model, tok, args.prompt, args.image, device)
    elif args.chat:
        from megaloom.generate import chat_prompt

        ids, stops = chat_prompt(Path(args.run), tok, args.prompt, args.system)
        prompt = torch.tensor([ids], device=device)
    else:
        prompt = torch.tensor([tok.encode(args.prompt) or [tok.eod_id]], device=device)
    out = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                   use_cache=not args.no_cache, seed=args.seed, eod_id=stops if args.chat else tok.eod_id,
                   images=images)
    ids = out[0].tolist()
    if images is not None or args.chat:  # the answer only: the prompt is the images and question, or the chat
        ids = ids[prompt.shape[1]:]
        if args.chat and ids and ids[-1] in stops:
            ids = ids[:-1]  # the end-of-turn token itself
    print(tok.decode(ids))
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from megaloom.plot import compare_runs, plot_run

    if len(args.run_dir) > 1:
        print(f"wrote {compare_runs(args.run_dir, args.out)}")
    else:
        print(f"wrote {plot_run(args.run_dir[0], args.out)}")
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    if args.calibrate:  # this machine's GPU measured for `megaloom plan` (one process, no collectives)
        from megaloom.planning.calibrate import calibrate_command

        return calibrate_command(args.out, args.name, args.like, quick=args.quick)
    if "LOCAL_RANK" not in os.environ:  # not under torchrun: start it (one process without --nproc)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(args.nproc or 1), "-m", "megaloom", "doctor", "--factor", str(args.factor), "--matmul-n",
               str(args.matmul_n)] + (["--run-dir", args.run_dir] if args.run_dir else [])
        return subprocess.call(cmd)
    from megaloom.resilience.doctor import doctor

    return doctor(factor=args.factor, matmul_n=args.matmul_n, run_dir=args.run_dir)


def _cmd_evict(args: argparse.Namespace) -> int:
    from megaloom.resilience.suspects import read, to_evict

    if not Path(args.run_dir).is_dir():
        raise ConfigError(f"megaloom evict: {args.run_dir} is not a run directory.")
    evict = to_evict(read(args.run_dir), args.times)
    for node, why in evict.items():
        print(f"evict {node}: {'; '.join(why)}", file=sys.stderr)
    print(",".join(evict))
    return 0


def _cmd_schedule(args: argparse.Namespace) -> int:
    from megaloom.observe.timeline import schedule_command

    schedule_command(args.pp, args.vpp, args.microbatches, args.schedule, args.out)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from megaloom.observe.heartbeat import status_table
    from megaloom.observe.run_status import run_progress

    progress = run_progress(args.run_dir)
    if progress is not None:
        print(progress)
    print(status_table(args.run_dir))
    return 0


def _cmd_memory(args: argparse.Namespace) -> int:
    from megaloom.planning.memory_fit import memory_command

    print(memory_command(load_config(args.config, args.overrides), args.nproc, args.gpu_gb))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from megaloom.planning.command import plan_command

    cfg = load_config(args.config, args.overrides)
    print(plan_command(cfg, args.gpus, args.gpu, args.top, args.out, args.predict, args.gpus_per_node,
                       args.nic_gbps, args.json))
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    if args.list:
        print(describe_keys())
    else:
        print(load_config(args.config, args.overrides).to_yaml(), end="")
    return 0


def _add_train(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("train", help="train a model (also under torchrun)")
    t.add_argument("--config", help="YAML file with sections model:, parallel:, train:, data:, checkpoint:, run:")
    t.add_argument("--nproc", type=int, default=0, help="run N processes on this node through torchrun")
    t.add_argument("--max-restarts", type=int, default=0, help="with --nproc: restarts torchrun may make")
    loud = t.add_mutually_exclusive_group()
    loud.add_argument("--quiet", action="store_true", help="console: warnings and errors only")
    loud.add_argument("--verbose", action="store_true", help="console: debug lines too, from every rank")
    dry = t.add_argument_group("dry run", "one rank of a large job in this process, on a fake process group: "
                                          "its groups, shards, steps, memory and collectives (docs/parallelism.md)")
    dry.add_argument("--dry-run", action="store_true", help="build and step one rank of a --world job here")
    dry.add_argument("--world", type=int, default=0, help="with --dry-run: the job's world size")
    dry.add_argument("--rank", default="0", help="with --dry-run: a rank number, or last-stage (the first rank of "
                                                 "the last pipeline stage); default 0")
    dry.add_argument("--dry-run-steps", type=int, default=1, help="training steps to run (0: build only)")
    dry.add_argument("--dry-run-memory-gb", type=float, default=None,
                     help="memory budget: steps that the plan does not fit run without the optimizer update, or "
                          "not at all (default: 90%% of the memory available; the GPU's memory)")
    dry.add_argument("--dry-run-json", default=None, help="also write the report to this JSON file")
    dry.add_argument("--dry-run-dir", default=None, help="keep the run directory (checkpoint shard) here")
    t.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.steps=50")
    t.set_defaults(fn=_cmd_train)


def _add_preprocess(sub: argparse._SubParsersAction) -> None:
    pp = sub.add_parser("preprocess", help="text / JSONL / Parquet files, saved HF datasets, or folders -> "
                                           "memory-mapped token files")
    pp.add_argument("inputs", nargs="+", help="files or folders: text files (one document each), .jsonl (one per "
                                              "line), .parquet (one per row; pip install 'megaloom[parquet]'), "
                                              "folders written by datasets' save_to_disk or .arrow files "
                                              "(pip install 'megaloom[hf]')")
    pp.add_argument("--tokenizer", required=True, help="tokenizer.json")
    pp.add_argument("--out", required=True, help="output prefix (writes PREFIX.bin and PREFIX.idx)")
    pp.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2)))
    _add_text_column(pp)
    pp.set_defaults(fn=_cmd_preprocess)


def _add_text_column(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text-column", "--json-key", dest="json_key", default="text",
                   help="the JSONL field / Parquet or datasets column holding the text (default: text)")
    p.add_argument("--split", default=None, help="the split of a saved DatasetDict (needed where it has several)")


def _add_tokenizer(sub: argparse._SubParsersAction) -> None:
    tk = sub.add_parser("tokenizer", help="tokenizer tools")
    tk_sub = tk.add_subparsers(dest="tokenizer_command", required=True)
    tt = tk_sub.add_parser("train", help="fit a byte-level BPE on text / JSONL files or folders (the documents "
                                         "preprocess reads)")
    tt.add_argument("inputs", nargs="+")
    tt.add_argument("--vocab-size", type=int, default=8192)
    tt.add_argument("--out", required=True, help="path of the tokenizer.json to write")
    _add_text_column(tt)
    tt.set_defaults(fn=_cmd_tokenizer)


def _add_generate(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="sample text from a run's latest checkpoint")
    g.add_argument("--run", required=True, help="run directory")
    g.add_argument("--prompt", default="")
    g.add_argument("--chat", action="store_true",
                   help="--prompt is a user's message to a chat-tuned run: rendered with the run's chat template "
                        "(data.chat_template), the answer printed alone, ending at the end of the assistant's turn")
    g.add_argument("--system", default="", help="with --chat: a system message before the user's")
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-cache", action="store_true", help="recompute the whole prefix each step (slow)")
    g.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="an image for a multimodal run (repeat for several); --prompt is then the question about "
                        "them (empty: a caption)")
    g.set_defaults(fn=_cmd_generate)


def _add_plot(sub: argparse._SubParsersAction) -> None:
    pl = sub.add_parser("plot", help="write the loss curve of a run as a PNG; several runs: overlaid, with the gap "
                                     "of each to the first")
    pl.add_argument("run_dir", nargs="+", help="run directories (or, to compare, metrics .jsonl files)")
    pl.add_argument("--out", default=None)
    pl.set_defaults(fn=_cmd_plot)


def _add_doctor(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("doctor", help="pre-flight self-check of every rank (matmul, collectives); one process, "
                                      "--nproc N, or under torchrun")
    d.add_argument("--nproc", type=int, default=0, help="start N local processes through torchrun (default: one)")
    d.add_argument("--factor", type=float, default=2.0, help="slow = more than FACTOR x the median time")
    d.add_argument("--matmul-n", type=int, default=512)
    d.add_argument("--run-dir", default=None, help="record the nodes of unhealthy ranks in this run directory, "
                                                    "for `megaloom evict` to leave them out of the next restart")
    d.add_argument("--calibrate", action="store_true",
                   help="measure this GPU (GEMM, attention, HBM, launch) into a calibration file for megaloom plan")
    d.add_argument("--out", default=None, help="--calibrate: the file to write (default: megaloom/planning/gpus/)")
    d.add_argument("--name", default=None, help="--calibrate: the GPU kind's name (default: the device's)")
    d.add_argument("--like", default=None, help="--calibrate: keep this kind's node and network figures")
    d.add_argument("--quick", action="store_true", help=argparse.SUPPRESS)  # tiny sizes: tests
    d.set_defaults(fn=_cmd_doctor)


def _add_evict(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("evict", help="the nodes a restart should leave out (failed the doctor, or named slow or "
                                     "stuck twice), comma-separated for `srun --exclude`")
    e.add_argument("run_dir")
    e.add_argument("--times", type=int, default=2, help="events naming a node slow or stuck before it is evicted")
    e.set_defaults(fn=_cmd_evict)


def _add_schedule(sub: argparse._SubParsersAction) -> None:
    sc = sub.add_parser("schedule", help="draw a pipeline schedule's planned timeline and print its bubble")
    sc.add_argument("--pp", type=int, required=True)
    sc.add_argument("--vpp", type=int, default=1)
    sc.add_argument("--microbatches", type=int, required=True)
    sc.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zb"])
    sc.add_argument("--out", default="schedule.png", help=".png picture or .json Chrome trace (Perfetto)")
    sc.set_defaults(fn=_cmd_schedule)


def _add_status(sub: argparse._SubParsersAction) -> None:
    st = sub.add_parser("status", help="per-rank heartbeat of a run (step, age, last operation)")
    st.add_argument("run_dir")
    st.set_defaults(fn=_cmd_status)


def _add_convert(sub: argparse._SubParsersAction) -> None:
    from megaloom.convert.cli import add_convert_parser

    add_convert_parser(sub)


def _add_memory(sub: argparse._SubParsersAction) -> None:
    mem = sub.add_parser("memory", help="predicted memory per GPU for a configuration (nothing runs); with "
                                        "--gpu-gb, the largest micro-batch that fits for each recompute mode")
    mem.add_argument("--config")
    mem.add_argument("--nproc", type=int, default=1, help="processes (world size) of the layout")
    mem.add_argument("--gpu-gb", type=float, default=None, help="memory per GPU, e.g. 141 for an H200")
    mem.add_argument("overrides", nargs="*")
    mem.set_defaults(fn=_cmd_memory)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    from megaloom.planning.hardware import gpu_kinds

    pl = sub.add_parser("plan", help="the fastest layouts of a model on N GPUs (predicted memory, step, MFU, bubble, "
                                     "exposed communication), or --predict one layout (nothing runs)")
    pl.add_argument("--config")
    pl.add_argument("--gpus", type=int, required=True, help="GPUs of the job")
    pl.add_argument("--gpu", default="h200", help=f"GPU kind: {', '.join(gpu_kinds())}, or a calibration file")
    pl.add_argument("--gpus-per-node", type=int, default=None, help="GPUs a node (default: the kind's)")
    pl.add_argument("--nic-gbps", type=float, default=None, help="GB/s across nodes per GPU (default: the kind's)")
    pl.add_argument("--top", type=int, default=10, help="layouts listed")
    pl.add_argument("--out", default=None, help="write the best layout as a config file for megaloom train --config")
    pl.add_argument("--predict", default=None, metavar="CONFIG", help="predict this config's own layout")
    pl.add_argument("--json", default=None, help="also write the predictions as JSON")
    pl.add_argument("overrides", nargs="*")
    pl.set_defaults(fn=_cmd_plan)


def _add_config(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("config", help="print the resolved config, or every key with --list")
    c.add_argument("--config")
    c.add_argument("--list", action="store_true")
    c.add_argument("overrides", nargs="*")
    c.set_defaults(fn=_cmd_config)


# The subcommands in the order `megaloom --help` lists them.
_SUBCOMMANDS = (_add_train, _add_preprocess, _add_tokenizer, _add_generate, _add_plot, _add_doctor, _add_evict,
                _add_schedule, _add_status, _add_convert, _add_memory, _add_plan, _add_config)


def build_parser() -> argparse.ArgumentParser:
    import megaloom

    p = argparse.ArgumentParser(prog="megaloom", description=megaloom.__doc__,
                                epilog="`megaloom COMMAND --help` lists a command's options.")
    p.add_argument("--version", action="version", version=f"megaloom {megaloom.__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except PeerLost:  # another rank died: the line naming it is said (by one rank) where it was caught
        if os.environ.get("MEGALOOM_TRACEBACK"):
            raise
        return 1
    except RunStopped as e:  # before ValueError: a failed save is a CheckpointError too
        # The run cannot go on and a person must act (diverged, disk full, ...): one line, exit 1.
        if os.environ.get("MEGALOOM_TRACEBACK"):
            raise
        _say(args, f"stopped: {e}", "stopped")
        return 1
    except (ConfigError, ValueError, FileNotFoundError) as e:
        # User errors (bad settings, missing or corrupt data, unusable checkpoints): one clear line, exit 2.
        if os.environ.get("MEGALOOM_TRACEBACK"):
            raise
        _say(args, f"error: {e}", "error", status=2)
        return 2
    except OSError as e:
        # A full disk while writing metrics, config or heartbeat files: the cause in one line, not a traceback.
        if e.errno not in (errno.ENOSPC, errno.EDQUOT) or os.environ.get("MEGALOOM_TRACEBACK"):
            raise
        _say(args, f"stopped: no space left on the device writing {e.filename or 'a file'} ({e.strerror}); free "
             "space and start again (a run resumes from its newest checkpoint)", "disk_full")
        return 1
    except RuntimeError as e:
        # A rank died while the job was starting (before the training loop, which says it itself), or this rank's
        # data-loader worker died (killed, out of memory): one line.
        if os.environ.get("MEGALOOM_TRACEBACK"):
            raise
        line = _peer_lost_line(args, e)
        if line is None and not _loader_died(args, e):
            raise
        if line:
            print(f"megaloom: stopped: {line}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C: one line, no traceback, the shell's exit status for SIGINT (128 + 2). Under torchrun every rank
        # is interrupted; rank 0 speaks for the job.
        if os.environ.get("MEGALOOM_TRACEBACK"):
            raise
        if os.environ.get("RANK", "0") == "0":
            print(_interrupted_line(args), file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
