"""ssd_jax.runtime.progress: the progress bar, and the notices of slow one-time work that the command line
shows on a terminal."""

from __future__ import annotations

import argparse
import io
import threading

import pytest

from ssd_jax.runtime import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def notices(monkeypatch):
    """Notices sent to a fresh stream, turned off again after the test."""
    def to(stream):
        monkeypatch.setattr(progress, "_notice_stream", stream)
        return stream
    monkeypatch.setattr(progress, "_notice_open", False)
    return to


def test_progress_bar_writes_a_line_per_tenth_off_a_terminal():
    out = io.StringIO()
    with progress.Progress(20, "converting", unit="layer", stream=out) as bar:
        for _ in range(20):
            bar.update(1, loss=0.25)
    lines = out.getvalue().splitlines()
    assert len(lines) == 11 and lines[0].startswith("converting:   0%") and "20/20" in lines[-1]
    assert "loss=0.25" in lines[-1] and "layer/s" in lines[-1]


def test_no_notice_unless_asked(notices, capsys):
    with progress.notice("compiling a decode program"):
        pass
    assert capsys.readouterr().err == ""


def test_a_notice_says_what_ran_and_how_long(notices, monkeypatch):
    out = notices(io.StringIO())
    clock = iter([10.0, 13.25])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    with progress.notice("compiling a decode program"):
        with progress.notice("timing a forward"):   # inside another: silent, the line stays whole
            pass
    assert out.getvalue() == "ssd-jax: compiling a decode program ... 3.2 s\n"


@pytest.mark.parametrize("seconds, kept", [(0.2, False), (2.0, True)])
def test_a_short_notice_is_erased_on_a_terminal(notices, monkeypatch, seconds, kept):
    out = notices(Terminal())
    clock = iter([0.0, seconds])
    monkeypatch.setattr(progress.time, "perf_counter", lambda: next(clock))
    with progress.notice("loading"):
        pass
    text = out.getvalue()
    assert text.endswith(f" {seconds:.1f} s\n") if kept else text.endswith("\r\033[K")


def test_a_notice_ends_when_its_work_fails(notices):
    out = notices(io.StringIO())
    with pytest.raises(RuntimeError):
        with progress.notice("compiling"):
            raise RuntimeError("boom")
    assert out.getvalue().endswith(" s\n")
    with progress.notice("again"):   # the next one shows: the failed one closed
        pass
    assert "again" in out.getvalue()


def test_a_notice_in_another_thread_stays_silent_while_one_shows(notices):
    out = notices(io.StringIO())
    inside, release = threading.Event(), threading.Event()

    def first():
        with progress.notice("compiling the target's program"):
            inside.set()
            release.wait(5)

    thread = threading.Thread(target=first)
    thread.start()
    inside.wait(5)
    with progress.notice("compiling the draft's program"):
        pass
    release.set()
    thread.join()
    assert "draft" not in out.getvalue() and out.getvalue().count("\n") == 1


def test_the_command_line_shows_notices_on_a_terminal_only(monkeypatch):
    from ssd_jax.cli import generate_cmd

    shown = []

    class Stop(Exception):
        pass

    def load_models(args):
        raise Stop

    monkeypatch.setattr(generate_cmd, "show_notices", shown.append)
    monkeypatch.setattr(generate_cmd, "load_models", load_models)
    parser = argparse.ArgumentParser()
    generate_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["generate", "def f(n):", "--compile-cache", ""])
    for stderr in (io.StringIO(), Terminal()):
        monkeypatch.setattr("sys.stderr", stderr)
        with pytest.raises(Stop):
            generate_cmd.run(args)
    assert len(shown) == 1 and isinstance(shown[0], Terminal)
