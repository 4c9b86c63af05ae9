"""Streaming of the synchronous methods: a decode run in pieces by two compiled programs
(`ssd_jax.runtime.streaming`), whose sink sees each piece's new tokens."""

from __future__ import annotations

import dataclasses
import re
import time
import types

import numpy as np
import pytest

import ssd_jax
from ssd_jax.draft.maxgram import MaxGram
from ssd_jax.runtime import streaming
from ssd_jax.runtime.compile_cache import PROGRAMS
from spec_models import pair


@pytest.fixture(scope="module")
def models():
    return pair(vocab=64, seed=0, noise=0.3, layers=1)


PROMPTS = [[3, 9, 4, 9, 4, 9, 4], [5, 1, 2], [7, 7, 8, 7, 7, 8, 7, 7, 8, 2]]


class Collector:
    """A sink keeping each row's streamed tokens and the pieces' counts."""

    def __init__(self, rows: int):
        self.rows: list[list[int]] = [[] for _ in range(rows)]
        self.pieces: list[np.ndarray] = []

    def __call__(self, tokens: np.ndarray, counts: np.ndarray) -> None:
        assert tokens.dtype == np.int32 and counts.dtype == np.int32 and tokens.shape[0] == len(self.rows)
        self.pieces.append(counts.copy())
        for row, count in enumerate(counts):
            self.rows[row].extend(int(t) for t in tokens[row, :count])


def _streamed(target, draft, method, temperature: float, new: int = 30):
    sink = Collector(len(PROMPTS))
    out = ssd_jax.generate(target, PROMPTS, method=method, draft=draft, max_new_tokens=new,
                           temperature=temperature, stream=sink)
    return out, sink


@pytest.mark.parametrize("method", [ssd_jax.AR(), ssd_jax.SD(draft_len=3), ssd_jax.PLD(draft_len=3),
                                    ssd_jax.SpecInfer(draft_len=2, paths=2)], ids=lambda m: m.name)
def test_a_streamed_fixed_method_gives_the_unstreamed_tokens(models, method):
    """T=1: pieces of a fixed method's loop are one loop (each step's keys come from its step
    count), so the streamed call samples the very tokens of the unstreamed one, and the sink gets
    each exactly once, in order, over several pieces."""
    target, draft = models
    draft = draft if method.name not in ("ar", "pld") else None
    plain = ssd_jax.generate(target, PROMPTS, method=method, draft=draft, max_new_tokens=30, temperature=1.0)
    out, sink = _streamed(target, draft, method, 1.0)
    assert out.tokens == plain.tokens and out.finish_reasons == plain.finish_reasons
    assert sink.rows == out.tokens
    assert len(sink.pieces) > 3
    assert out.stats["target_calls"] == plain.stats["target_calls"]


@pytest.mark.parametrize("method", [ssd_jax.SD(), ssd_jax.LogitSpec(), ssd_jax.CSD()], ids=lambda m: m.name)
def test_streamed_auto_is_greedy_exact(models, method):
    """draft_len "auto" at T=0, streamed: the pauses end the adaptive loop's phases, and the
    tokens are AR's, each streamed once."""
    target, draft = models
    # CSD: a model, then Max-Gram with a made-up table (the tiny pair has no tokenizer for the shipped one).
    cascade = (draft, MaxGram.for_target(target, (np.arange(64, dtype=np.int32) * 7) % 64))
    draft = {"logitspec": None, "csd": cascade}.get(method.name, draft)
    reference = ssd_jax.generate(target, PROMPTS, max_new_tokens=30)
    out, sink = _streamed(target, draft, method, 0.0)
    assert out.tokens == reference.tokens
    assert sink.rows == out.tokens
    assert out.stats["adaptive"] and len(sink.pieces) > 3


def test_rows_that_stop_at_eos_stream_what_they_keep(models):
    """Rows ending at an EOS early stop receiving tokens; the others go on to the length limit."""
    target, draft = models
    reference = ssd_jax.generate(target, PROMPTS, max_new_tokens=30)
    eos = reference.tokens[1][4]
    with_eos = dataclasses.replace(target, config=dataclasses.replace(target.config, eos_token_ids=(eos,)))
    expected = ssd_jax.generate(with_eos, PROMPTS, max_new_tokens=30, method=ssd_jax.SD(draft_len=3), draft=draft)
    out, sink = _streamed(with_eos, draft, ssd_jax.SD(draft_len=3), 0.0)
    assert out.tokens == expected.tokens and out.finish_reasons == expected.finish_reasons
    assert "eos" in out.finish_reasons and len(out.tokens[1]) <= 5
    assert sink.rows == out.tokens


def test_streamed_programs_hold_no_host_callback(models):
    """The programs of a streamed call call nothing on the host, so JAX's persistent compilation
    cache keeps them (it skips any program with a host callback: a per-step stream compiled again
    in every process)."""
    target, draft = models
    PROGRAMS._entries.clear()
    _streamed(target, draft, ssd_jax.SD(), 0.0, new=8)
    kinds = sorted(key[0][0] for key in PROGRAMS._entries)
    assert kinds == ["begin", "resume"]
    for executable in PROGRAMS._entries.values():
        targets = re.findall(r'custom_call_target="([^"]*)"', executable.as_text())
        assert not [t for t in targets if "callback" in t], targets


def test_untimed_pieces_double_to_a_fixed_size(models):
    """With the suite's deterministic tuner the first piece is FIRST_PIECE tokens past
    the first token, then they double up to FIXED_LAST_PIECE, whatever they take."""
    target, _ = models
    out, sink = _streamed(target, None, ssd_jax.AR(), 0.0, new=100)
    sizes = [int(counts[0]) for counts in sink.pieces]
    assert sizes[0] == 1   # the first token, from the prefill program
    assert sizes[1:4] == [streaming.FIRST_PIECE * 2 ** i for i in range(3)]
    assert max(sizes) == streaming.FIXED_LAST_PIECE and sum(sizes) == len(out.tokens[0]) == 100


class FakeDecode:
    """begin and resume of a one-row decode of `total` tokens, each resume taking `seconds`."""

    def __init__(self, total: int, seconds: float):
        self.total, self.seconds, self.pieces = total, seconds, []

    def output(self, count: int):
        tokens = np.zeros((1, self.total), np.int32)
        tokens[0, :count] = np.arange(count)
        finish = np.asarray([2 if count >= self.total else 0], np.int32)
        return types.SimpleNamespace(num_tokens=np.asarray([count], np.int32), finish_reason=finish, tokens=tokens)

    def begin(self):
        return 1, self.output(1)

    def resume(self, count: int, piece):
        self.pieces.append(int(piece))
        time.sleep(self.seconds)
        count = min(count + int(piece), self.total)
        return count, self.output(count)


@pytest.mark.parametrize("seconds, growing", [(0.0, True), (0.02, False)])
def test_timed_pieces_double_while_they_are_quick(monkeypatch, seconds, growing):
    """With timings allowed, a piece doubles the next one while it took under PIECE_SECONDS, and
    past FIXED_LAST_PIECE; a slow piece keeps its size. The sink gets every token once."""
    monkeypatch.setattr(streaming, "PIECE_SECONDS", 0.01)
    fake, sink = FakeDecode(200, seconds), Collector(1)
    _, wall = streaming.stream_pieces(fake.begin, fake.resume, sink, timed=True)
    first = streaming.FIRST_PIECE
    if growing:
        assert fake.pieces[:6] == [first * 2 ** i for i in range(6)] and max(fake.pieces) > streaming.FIXED_LAST_PIECE
    else:
        assert set(fake.pieces) == {first}
    assert sink.rows == [list(range(200))] and wall > 0
