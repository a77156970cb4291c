import json
import subprocess
import sys

import pytest

from megaloom.cli import main
from megaloom.config import ConfigError, load_config
from megaloom.train import resolve_model_shape
from tests.conftest import tiny_overrides, wait_for_step


def test_bad_key_exits_2_with_suggestion(capsys):
    assert main(["train", "train.stpes=3"]) == 2
    err = capsys.readouterr().err
    assert "Did you mean 'train.steps'" in err


def test_missing_data_path_is_clear_before_training(tmp_path, capsys):
    assert main(["train", f"data.paths={tmp_path}/nope", f"run.dir={tmp_path}/r"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "preprocess" in err
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_tokenizer_larger_than_model_vocab_is_refused():
    cfg = load_config(None, ["model.vocab_size=256"])
    with pytest.raises(ConfigError, match="model.vocab_size"):
        resolve_model_shape(cfg, tokenizer_vocab=512)


def test_train_generate_plot_via_cli(small_corpus, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *tiny_overrides(small_corpus, run, "train.steps=4", "train.log_every=2")]) == 0
    assert main(["generate", "--run", str(run), "--prompt", "import ", "--max-new-tokens", "8"]) == 0
    assert main(["plot", str(run)]) == 0
    assert (run / "loss.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "step      4/4" in out


def test_preprocess_and_tokenizer_cli(small_corpus, tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"text": f"document number {i} " * 5}) for i in range(20)))
    assert main(["tokenizer", "train", str(docs), "--vocab-size", "300", "--out", str(tmp_path / "t.json")]) == 0
    assert main(["preprocess", str(docs), "--tokenizer", str(tmp_path / "t.json"), "--out", str(tmp_path / "d"),
                 "--workers", "1"]) == 0
    assert (tmp_path / "d.bin").is_file() and (tmp_path / "d.idx").is_file()


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "megaloom", "config", "--list"], capture_output=True, text=True,
                         check=True).stdout
    assert "train.global_batch_size" in out


def test_version_and_help_list_every_command():
    import megaloom
    from megaloom.cli import build_parser

    run = lambda *a: subprocess.run([sys.executable, "-m", "megaloom", *a], capture_output=True, text=True)  # noqa: E731
    v = run("--version")
    assert v.returncode == 0 and v.stdout.strip() == f"megaloom {megaloom.__version__}"
    h = run("--help")
    assert h.returncode == 0
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    helps = {c.dest: c.help for c in sub._choices_actions}
    assert set(helps) == set(sub.choices)  # every command has a help string ...
    for name, text in helps.items():
        assert text, name
        assert name in h.stdout  # ... and --help lists it


@pytest.mark.parametrize("overrides, message", [
    (["parallel.tp=2", "data.paths=/nonexistent"], "/nonexistent.bin does not exist"),
    (["parallel.tp=3"], "does not divide the world size 2"),
    (["parallel.zero=1", "parallel.tp=2"], "dp=1"),
    (["train.device=cuda:1"], "train.device=cuda:1 with 2 processes on this node would put every rank on GPU 1"),
])
def test_nproc_user_errors_print_once_before_torchrun(tmp_path, overrides, message):
    """Checked in the launching process: one line, exit 2, no rank started (so no torchrun traceback)."""
    r = subprocess.run([sys.executable, "-m", "megaloom", "train", "--nproc", "2", f"run.dir={tmp_path}/r", *overrides],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count(message) == 1, r.stderr
    assert r.stderr.count("megaloom: error:") == 1
    assert "Traceback" not in r.stderr and "torch.distributed" not in r.stderr
    assert not (tmp_path / "r").exists()


def test_one_gpu_for_every_rank_of_a_torchrun_node_is_refused_before_the_process_group(tmp_path, capsys,
                                                                                        monkeypatch):
    """Under torchrun (its environment: two processes on this node), train.device=cuda:N is refused by preflight,
    before any process group or GPU is touched (so this runs on CPU); one process per node may choose its GPU."""
    from megaloom.preflight import preflight

    for key, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    assert main(["train", "train.device=cuda:0", f"run.dir={tmp_path / 'r'}"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == ("megaloom: error: train.device=cuda:0 with 2 processes on this node would put every rank on GPU 0 "
                    "(NCCL: \"Duplicate GPU detected\"); set train.device=cuda (or auto) so that each rank takes the "
                    "GPU of its local rank (restrict the GPUs used with CUDA_VISIBLE_DEVICES).")
    assert not (tmp_path / "r").exists()
    cfg = load_config(None, ["train.device=cuda:0"])
    assert preflight(cfg, 8, local_world_size=1).sizes["dp"] == 8  # 8 nodes of one process each: allowed


def test_train_again_after_a_finished_run_says_nothing_to_do(small_corpus, tmp_path, capsys):
    run = tmp_path / "run"
    args = tiny_overrides(small_corpus, run, "train.steps=3", "checkpoint.every=3")
    assert main(["train", *args]) == 0
    capsys.readouterr()
    assert main(["train", *args]) == 0  # resumes at step 3 == train.steps
    out = capsys.readouterr().out
    assert (f"run.dir {run} already trained to step 3 of train.steps=3: nothing to do; raise train.steps to "
            "continue") in out
    assert "step      " not in out  # no step was trained
    assert main(["train", *args, "train.steps=5"]) == 0  # steps raised: one line says so, and it trains on
    out = capsys.readouterr().out
    assert "the checkpoint's run had train.steps=3; this run trains on from step 3 to the new train.steps=5" in out
    assert "step      5/5" in out and "nothing to do" not in out


def test_resume_changes_name_the_layout_and_steps():
    from megaloom.training.checkpoints import resume_changes

    cfg = load_config(None, ["train.steps=10"])
    now = {"tp": 1, "pp": 1, "dp": 2, "cp": 1, "ep": 1, "zero": 0, "world": 2}
    same = {"step": 4, "layout": dict(now), "train_steps": 10}
    assert resume_changes(same, cfg, now) == []
    assert resume_changes({"step": 4}, cfg, now) == []  # an older checkpoint: nothing known, nothing said
    (line,) = resume_changes({**same, "layout": {**now, "tp": 2, "dp": 1}}, cfg, now)
    assert "tp=2 pp=1 dp=1" in line and "this run is tp=1 pp=1 dp=2" in line and "resharded" in line
    (line,) = resume_changes({**same, "train_steps": 6}, cfg, now)
    assert "train.steps=6" in line and "new train.steps=10" in line
    assert resume_changes({**same, "step": 12, "train_steps": 12}, cfg, now) == []  # the nothing-to-do line says it


def test_ctrl_c_saves_then_stops_training_with_one_line_and_exit_130(small_corpus, tmp_path):
    import re
    import signal

    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "megaloom", "train",
                          *tiny_overrides(small_corpus, run, "train.steps=100000", "checkpoint.every=0")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(p, 2, 100000)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    m = re.search(r"megaloom: interrupted at step (\d+); the last checkpoint is step (\d+)", err)
    # checkpoint.every=0: the only checkpoint is the one Ctrl-C asked for, of the step reached
    assert m and int(m[1]) >= 2 and m[2] == m[1], (err, sorted((run / "checkpoints").iterdir()))
    assert (run / "checkpoints" / f"step_{int(m[2]):08d}").is_dir()


def _megaloom(*args: str, cwd=None) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "megaloom", *args], capture_output=True, cwd=cwd, timeout=300)
    # decoded by hand: text=True would turn a progress bar's '\r' redraws into newlines
    res.stdout, res.stderr = res.stdout.decode(), res.stderr.decode()
    return res


def _blank_lines(res: subprocess.CompletedProcess) -> bool:
    return any("\n\n" in s or s.startswith("\n") for s in (res.stdout, res.stderr))


def test_doctor_without_nproc_runs_on_one_process():
    """Issue 24 (9): `megaloom doctor` alone used to refuse ("runs under torchrun")."""
    res = _megaloom("doctor", "--matmul-n", "64")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "1 ranks" in res.stdout + res.stderr and "all ranks healthy" in res.stdout + res.stderr


def test_tokenizer_train_reads_the_jsonl_text_field_and_prints_no_blank_lines(tmp_path):
    """Issue 24 (9): `tokenizer train` fitted the raw JSON lines (keys, quotes, braces) and printed blank lines."""
    lines = [json.dumps({"text": f"alpha beta gamma {i}", "meta": "zzzqqq"}) for i in range(200)]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    res = _megaloom("tokenizer", "train", str(tmp_path / "c.jsonl"), "--vocab-size", "300", "--out",
                    str(tmp_path / "tok.json"))
    assert res.returncode == 0, res.stderr
    assert not _blank_lines(res)
    vocab = json.loads((tmp_path / "tok.json").read_text())["model"]["vocab"]
    merged = [t for t in vocab if len(t) > 1 and t != "<|endoftext|>"]
    assert any("alpha" in t or "beta" in t for t in merged)
    assert not any("meta" in t or "zzz" in t or '"' in t for t in merged), merged  # only the text field was read
    res = _megaloom("preprocess", str(tmp_path / "c.jsonl"), "--tokenizer", str(tmp_path / "tok.json"), "--out",
                    str(tmp_path / "d" / "c"))
    assert res.returncode == 0 and not _blank_lines(res)


def test_warmup_longer_than_the_run_is_warned(small_corpus, tmp_path, capsys):
    assert main(["train", *tiny_overrides(small_corpus, tmp_path / "w", "train.steps=2", "train.warmup_steps=10",
                                          "checkpoint.final=false")]) == 0
    assert "train.warmup_steps=10 > train.steps=2" in capsys.readouterr().out
