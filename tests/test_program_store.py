"""Compiled decode programs kept on disk whole (`ssd_jax.runtime.program_store`): a later process
loads a program instead of tracing it, and only where the program's key says everything about
it."""

from __future__ import annotations

import dataclasses
import functools
import os
import pickle
import time
import types

import jax
import numpy as np
import pytest

import ssd_jax
from ssd_jax import backend
from ssd_jax.runtime import compile_cache
from ssd_jax.runtime import program_store
from ssd_jax.runtime.compile_cache import signature
from spec_models import pair

PROMPTS = [[3, 9, 4, 9, 4, 9, 4], [5, 1, 2]]


@pytest.fixture(scope="module")
def models():
    """A pair no other module compiles for, so that this module's first compile of each program is
    fresh (the suite's JAX compilation cache holds what earlier tests compiled)."""
    return pair(vocab=40, seed=7, noise=0.3, layers=1)


def _jax_cache_on() -> bool:
    return bool(jax.config.jax_compilation_cache_dir)


@pytest.fixture
def store(tmp_path):
    """Programs kept under tmp_path for the test (the suite keeps them in memory otherwise); the
    in-process cache emptied before and after, so each call finds only the disk."""
    folder = program_store.use_directory(str(tmp_path))
    compile_cache.clear()
    yield folder
    program_store.use_directory(None)
    compile_cache.clear()


@pytest.fixture
def loads(monkeypatch):
    """How many programs came from disk."""
    found = []
    load = program_store.Entry.load

    def counted(entry):
        executable = load(entry)
        found.append(executable is not None)
        return executable

    monkeypatch.setattr(program_store.Entry, "load", counted)
    return found


def _kept(folder: str) -> list[str]:
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


@pytest.mark.parametrize("method", [ssd_jax.SD(draft_len=2), pytest.param(ssd_jax.SD(), marks=pytest.mark.slow)], ids=["L=2", "auto"])
def test_a_new_process_loads_the_program_and_decodes_the_same_tokens(models, store, loads, method):
    """A call writes its program; with the in-process cache empty (a new process) the same call
    loads it from disk and samples the same tokens at T=1, streamed too (the resume program
    donates its state)."""
    target, draft = models
    first = ssd_jax.generate(target, PROMPTS, method=method, draft=draft, max_new_tokens=12, temperature=1.0)
    kept = _kept(store)
    assert len(kept) == 1 and kept[0].endswith(program_store.SUFFIX) and loads == [False]
    compile_cache.clear()
    again = ssd_jax.generate(target, PROMPTS, method=method, draft=draft, max_new_tokens=12, temperature=1.0)
    assert loads == [False, True] and _kept(store) == kept
    assert again.tokens == first.tokens and again.finish_reasons == first.finish_reasons
    pieces = []
    streamed = ssd_jax.generate(target, PROMPTS, method=method, draft=draft, max_new_tokens=12,
                                temperature=1.0, stream=lambda tokens, counts: pieces.append(counts.copy()))
    compile_cache.clear()
    streamed_again = ssd_jax.generate(target, PROMPTS, method=method, draft=draft, max_new_tokens=12,
                                      temperature=1.0, stream=lambda tokens, counts: None)
    assert loads[-2:] == [True, True] and len(_kept(store)) == 3   # the prefill and the resume
    assert len(pieces) > 1 and streamed_again.tokens == streamed.tokens
    if method.draft_len != "auto":   # a fixed method streams its unstreamed tokens
        assert streamed.tokens == first.tokens


def test_ssd_keeps_its_device_programs_too(models, store, loads):
    """SSD's host loop runs several small programs (prefills, verification, the draft's builds),
    keyed by functions of the library (its verifier) and laid out on one-device meshes: each is
    kept, and a new process loads them all and decodes the same tokens."""
    target, draft = models
    method = ssd_jax.SSD(draft_len=2)
    first = ssd_jax.generate(target, PROMPTS, method=method, draft=draft, max_new_tokens=12, temperature=1.0)
    kept = _kept(store)
    assert len(kept) >= 4 and not any(loads)
    compile_cache.clear()
    del loads[:]
    again = ssd_jax.generate(target, PROMPTS, method=method, draft=draft, max_new_tokens=12, temperature=1.0)
    assert loads and all(loads) and _kept(store) == kept
    assert again.tokens == first.tokens


def test_another_library_setting_or_machine_finds_no_program(models, store, monkeypatch):
    """The entry's name changes with the library's source, the environment's XLA flags, JAX's
    configuration, the argument shapes, the CPU's instruction sets, Python's, numpy's and flax's
    versions, and a numpy scalar's type; a stored key that differs from the call's is not run
    (a digest collision)."""
    target, draft = models
    fn = functools.partial(ssd_jax.generate, temperature=0.0)
    args = (np.zeros((2, 3), np.int32),)
    key = (("decode", ssd_jax.SD(draft_len=2)), signature(args), ())
    entry = program_store.entry(fn, key)
    assert entry is not None and entry.path.startswith(store)
    names = {entry.path}
    monkeypatch.setattr(program_store, "source_digest", lambda: "another library")
    names.add(program_store.entry(fn, key).path)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    names.add(program_store.entry(fn, key).path)
    with jax.default_matmul_precision("highest"):
        names.add(program_store.entry(fn, key).path)
    names.add(program_store.entry(fn, (key[0], signature((np.zeros((2, 4), np.int32),)), ())).path)
    monkeypatch.setattr(backend, "cpu_features", lambda: "sse2 avx2")   # a VM hiding AVX-512
    names.add(program_store.entry(fn, key).path)
    monkeypatch.setattr(program_store, "_versions", lambda: ("3.11.7", "1.26.4", "0.10.0"))
    names.add(program_store.entry(fn, key).path)
    float32 = program_store.entry(fn, (("decode", np.float32(1.0)), signature(args), ())).path
    assert float32 != program_store.entry(fn, (("decode", 1.0), signature(args), ())).path
    assert len(names) == 7
    monkeypatch.undo()

    out = ssd_jax.generate(target, PROMPTS, method=ssd_jax.SD(draft_len=2), draft=draft, max_new_tokens=4)
    (name,) = _kept(store)
    path = os.path.join(store, name)
    with open(path, "rb") as f:
        stored = pickle.load(f)
    stored["key"] += " "
    with open(path, "wb") as f:
        pickle.dump(stored, f)
    entry = program_store.Entry(path, stored["key"][:-1], jax.devices()[0])
    assert entry.load() is None and os.path.exists(path)   # another program's entry: left alone
    compile_cache.clear()
    again = ssd_jax.generate(target, PROMPTS, method=ssd_jax.SD(draft_len=2), draft=draft, max_new_tokens=4)
    assert again.tokens == out.tokens


def test_a_damaged_entry_is_dropped_and_the_program_compiled_again(models, store, loads):
    """A truncated entry (a full disk, a killed writer) is removed and the program compiled again;
    the new executable is kept only where it was compiled afresh: one read back from JAX's
    persistent cache serializes without its code (on CPU its copy fails with "Function ... not
    found" when run), and the suite runs with that cache on."""
    target, draft = models
    method = ssd_jax.SD(draft_len=3)
    out = ssd_jax.generate(target, PROMPTS, method=method, draft=draft, max_new_tokens=4)
    (name,) = _kept(store)
    with open(os.path.join(store, name), "r+b") as f:
        f.truncate(1000)
    compile_cache.clear()
    again = ssd_jax.generate(target, PROMPTS, method=method, draft=draft, max_new_tokens=4)
    assert loads == [False, False] and again.tokens == out.tokens
    assert _kept(store) == ([] if _jax_cache_on() else [name])
    compile_cache.clear()
    third = ssd_jax.generate(target, PROMPTS, method=method, draft=draft, max_new_tokens=4)
    assert third.tokens == out.tokens and loads[-1] == (not _jax_cache_on())
    assert not [n for n in os.listdir(store) if n.endswith(".tmp")]


def test_an_entry_whose_bytes_changed_is_dropped_unrun(store, monkeypatch):
    """Bytes of the executable flipped inside an entry that still unpickles (a bad disk): run, such
    a copy crashed the process (SIGSEGV, SIGILL) on every later run; its sha256 no longer matches,
    so it is dropped and the program compiled again."""
    from ssd_jax.ssd.steps import emitted_tokens

    args = (np.zeros((1, 39), np.int32), np.zeros((1,), np.int32), np.ones((1,), np.int32))
    key = (("flipped",), signature(args), ())
    program_store.Entry.save(program_store.entry(emitted_tokens, key), jax.jit(emitted_tokens).lower(*args).compile())
    (name,) = _kept(store)
    path = os.path.join(store, name)
    with open(path, "rb") as f:
        stored = pickle.load(f)
    assert stored["digest"] == program_store._digest(stored["executable"])
    assert program_store.entry(emitted_tokens, key).load() is not None   # intact: loads
    flipped = bytearray(stored["executable"])
    flipped[len(flipped) // 2] ^= 0xFF
    with open(path, "wb") as f:
        pickle.dump(dict(stored, executable=bytes(flipped)), f)
    from jax.experimental import serialize_executable

    deserialized = []
    monkeypatch.setattr(serialize_executable, "deserialize_and_load", lambda *a, **k: deserialized.append(a))
    assert program_store.entry(emitted_tokens, key).load() is None and _kept(store) == []
    assert deserialized == []   # never handed to XLA


def test_an_executable_jax_hands_back_without_compiling_is_not_kept(store):
    """A function lowered and compiled again in one process (after the in-process cache dropped
    it, or under another key) gets JAX's earlier executable back without a compile; if that one was
    read from JAX's persistent cache it has no code, and a later process that loaded a copy of it
    would fail ("Function ... not found"), so only what JAX compiled in the call is kept."""
    from ssd_jax.ssd.steps import emitted_tokens

    args = (np.zeros((1, 37), np.int32), np.zeros((1,), np.int32), np.ones((1,), np.int32))
    sig = signature(args)

    def compile_it():
        return jax.jit(emitted_tokens).lower(*args).compile()

    program_store.load_or_compile(emitted_tokens, (("first",), sig, ()), compile_it)
    kept = _kept(store)   # the first compile's, unless JAX's persistent cache held the program already
    program_store.load_or_compile(emitted_tokens, (("second",), sig, ()), compile_it)
    assert _kept(store) == kept   # JAX's executable from the first call: not compiled here


@dataclasses.dataclass(frozen=True)
class UsersOwnSD(ssd_jax.SD):
    """A user's subclass: its code is not the library's, so no digest of the library covers it."""


def test_a_key_that_does_not_say_everything_keeps_the_program_in_memory(store):
    args = (np.zeros((2, 3), np.int32),)
    sig = signature(args)

    def decode(x):
        return x

    fn = functools.partial(ssd_jax.generate, temperature=0.0)
    assert program_store.entry(fn, (("decode", ssd_jax.SD(draft_len=2)), sig, ())) is not None
    assert program_store.entry(fn, (("decode", UsersOwnSD(draft_len=2)), sig, ())) is None
    assert program_store.entry(fn, (("decode", np.arange(3)), sig, ())) is None
    assert program_store.entry(fn, (("decode", object()), sig, ())) is None
    assert program_store.entry(fn, (("decode", "..."), sig, ())) is None
    assert program_store.entry(decode, (("decode",), sig, ())) is None   # not the library's function
    assert program_store.entry(functools.partial(ssd_jax.generate, 1), (("decode",), sig, ())) is None
    assert program_store.entry(functools.partial(ssd_jax.generate, m=UsersOwnSD()), (("decode",), sig, ())) is None
    two_devices = types.SimpleNamespace(device_set={jax.devices()[0], "another device"})
    assert program_store.entry(fn, (("decode",), (sig[0], ((sig[1][0][:2]) + (two_devices,),)), ())) is None
    assert program_store.entry(fn, (("decode", ssd_jax.generate), sig, ())) is not None   # by name
    assert program_store.entry(fn, (("decode", lambda: 0), sig, ())) is None
    program_store.use_directory(None)
    assert program_store.entry(fn, (("decode", ssd_jax.SD(draft_len=2)), sig, ())) is None


def test_the_store_keeps_the_most_recently_used_entries(tmp_path, monkeypatch):
    monkeypatch.setattr(program_store, "MAX_FILES", 2)
    for i, name in enumerate(["old", "middle", "new"]):
        path = tmp_path / f"{name}{program_store.SUFFIX}"
        path.write_bytes(b"x")
        os.utime(path, (1000 + i, 1000 + i))
    (tmp_path / "not-an-entry.txt").write_bytes(b"x")
    for name, age in (("killed-writer.tmp", 2 * program_store.STALE_TEMPORARY_S), ("writing.tmp", 5)):
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (time.time() - age,) * 2)
    program_store._evict(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["middle.program", "new.program", "not-an-entry.txt", "writing.tmp"]
    os.remove(tmp_path / "writing.tmp")
    monkeypatch.setattr(program_store, "MAX_BYTES", 1)
    program_store._evict(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["new.program", "not-an-entry.txt"]
