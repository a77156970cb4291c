"""megaloom's console logging: the message alone on rank 0, `[rank N]` and warnings only elsewhere, --quiet and
--verbose (also through --nproc), stdout at the moment of writing."""

from __future__ import annotations

import pytest

from megaloom import cli
from megaloom.observe.log import TO_STDERR, configure_logging, console_verbosity, get_logger
from megaloom.parallel import launch
from tests.conftest import tiny_overrides

log = get_logger("megaloom.tests")


@pytest.fixture(autouse=True)
def normal_verbosity():
    configure_logging("normal")
    yield
    configure_logging("normal")


def emit_all() -> None:
    log.debug("d")
    log.info("i")
    log.warning("w")
    log.error("e")


@pytest.mark.parametrize("verbosity,rank,expected", [
    ("normal", "0", "i\nw\ne\n"),  # rank 0: INFO and above, the message alone (the console lines as always)
    ("normal", "1", "[rank 1] w\n[rank 1] e\n"),  # other ranks: WARNING and above, prefixed
    ("quiet", "0", "w\ne\n"),
    ("quiet", "3", "[rank 3] w\n[rank 3] e\n"),
    ("verbose", "0", "d\ni\nw\ne\n"),  # debug, every rank
    ("verbose", "2", "[rank 2] d\n[rank 2] i\n[rank 2] w\n[rank 2] e\n"),
])
def test_levels_and_format_per_rank(verbosity, rank, expected, monkeypatch, capsys):
    monkeypatch.setenv("RANK", rank)
    configure_logging(verbosity)
    emit_all()
    out = capsys.readouterr()
    assert out.out == expected and out.err == ""


def test_outside_torchrun_is_rank_0(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    log.info("hello")
    assert capsys.readouterr().out == "hello\n"


def test_stderr_on_request_and_unknown_verbosity(capsys):
    log.info("note", extra=TO_STDERR)
    out = capsys.readouterr()
    assert out.err == "note\n" and out.out == ""
    with pytest.raises(ValueError, match="verbosity"):
        configure_logging("loud")


def test_console_verbosity_is_restored(capsys):
    with console_verbosity("quiet"):
        log.info("hidden")
    log.info("shown")
    assert capsys.readouterr().out == "shown\n"


@pytest.mark.parametrize("flag", ["--quiet", "--verbose"])
def test_flags_pass_through_nproc(flag, monkeypatch):
    calls = []
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setattr(launch, "run_torchrun", lambda cmd, **kw: calls.append(cmd) or 0)
    assert cli.main(["train", "--nproc", "2", flag, "train.steps=3"]) == 0
    (cmd,) = calls
    assert cmd[cmd.index("megaloom"):] == ["megaloom", "train", flag, "train.steps=3"]
    assert cli.main(["train", "--nproc", "2", "train.steps=3"]) == 0
    assert "--quiet" not in calls[1] and "--verbose" not in calls[1]


def test_quiet_and_verbose_flags_are_exclusive(capsys):
    with pytest.raises(SystemExit):
        cli.main(["train", "--quiet", "--verbose"])


def test_train_quiet_prints_no_step_lines_and_verbose_prints_debug(small_corpus, tmp_path, capsys):
    assert cli.main(["train", "--quiet", *tiny_overrides(small_corpus, tmp_path / "q", "train.steps=2")]) == 0
    quiet = capsys.readouterr().out
    assert "step " not in quiet and "params on" not in quiet, quiet
    assert cli.main(["train", "--verbose", *tiny_overrides(small_corpus, tmp_path / "v", "train.steps=2")]) == 0
    verbose = capsys.readouterr().out
    assert "step      2/2" in verbose and "model, parallel wrappers and optimizer built in" in verbose
    assert cli.main(["train", *tiny_overrides(small_corpus, tmp_path / "n", "train.steps=2")]) == 0
    normal = capsys.readouterr().out
    assert "step      2/2" in normal and "optimizer built in" not in normal  # the verbosity did not stick
