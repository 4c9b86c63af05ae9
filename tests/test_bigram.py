"""Max-Gram's bigram table: counting, the .npz file, `ssd-jax build-bigram`, the shipped table."""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest

from ssd_jax.cli import main
from ssd_jax.draft import bigram as bigram_module
from ssd_jax.draft.bigram import (
    DEFAULT_BIGRAM_PATH, DEFAULT_TOKENIZER_PATH, bigram_metadata, build_bigram_from_directory, compute_default_bigram,
    corpus_fingerprint, count_bigram, default_bigram, load_bigram, load_tokenizer, save_bigram, tokenizer_fingerprint,
)
from ssd_jax.errors import CheckpointError, InputError
from ssd_jax.train.corpus import collect_corpus

# Pairs: 1->2 twice, 2->1, 1->3, 4->4 and 4->5 (a tie), 5->4. Counts: 1 and 4 thrice each (a tie).
HAND_CORPUS = [[1, 2, 1, 3], [1, 2], [4, 4, 5], [5, 4], [6]]
# 0, 3 and 6 are never followed by anything: the most frequent token, 1 (smallest of the tie 1/4).
HAND_TABLE = [1, 2, 1, 1, 4, 4, 1]


def reference_bigram(sequences, vocab_size):
    pairs = collections.Counter((a, b) for seq in sequences for a, b in zip(seq, seq[1:]))
    unigrams = collections.Counter(t for seq in sequences for t in seq)
    fallback = min(unigrams, key=lambda t: (-unigrams[t], t))
    table = [fallback] * vocab_size
    for token in range(vocab_size):
        followers = [(count, -b) for (a, b), count in pairs.items() if a == token]
        if followers:
            table[token] = -max(followers)[1]
    return table


def test_hand_corpus_with_ties_and_unseen_tokens():
    assert count_bigram(HAND_CORPUS, 7).tolist() == HAND_TABLE
    # Above the dense-matrix vocabulary limit the sparse count must give the same answer.
    sparse = count_bigram((np.asarray(s, np.int64) for s in HAND_CORPUS), 20000)
    assert sparse.dtype == np.int32 and sparse.shape == (20000,)
    assert sparse[:7].tolist() == HAND_TABLE and set(sparse[7:].tolist()) == {1}


@pytest.mark.parametrize("vocab_size, id_range", [(5, 5), (37, 37), (20000, 40)])
def test_random_corpora_match_reference(vocab_size, id_range):
    rng = np.random.default_rng(vocab_size)
    sequences = [rng.integers(0, id_range, size=int(n)).tolist() for n in rng.integers(0, 30, size=60)]
    sequences.append([vocab_size - 1, vocab_size - 2])  # ids at the top of the vocabulary
    assert count_bigram(sequences, vocab_size).tolist() == reference_bigram(sequences, vocab_size)


def test_pairs_do_not_cross_sequences():
    # Joined, 1 -> 2 would win; per sequence 1 is followed only by 0.
    assert count_bigram([[1, 0], [2, 1], [2, 1], [2, 1]], 3)[1] == 0


@pytest.mark.parametrize(
    "corpus, message",
    [
        ([[1, 2], [3, -1]], r"token id -1 at position 1 of sequence 1 is outside the vocabulary \[0, 5\)"),
        ([[5]], r"token id 5 at position 0 of sequence 0 is outside the vocabulary \[0, 5\)"),
        ([[1.5, 2.0]], "sequence 0 must hold integer token ids, got dtype float64"),
        ([], "the corpus holds no tokens"),
        ([[], []], "the corpus holds no tokens"),
    ],
)
def test_bad_corpus_raises_input_error(corpus, message):
    with pytest.raises(InputError, match=message):
        count_bigram(corpus, 5)


def test_bad_vocab_size_raises_input_error():
    with pytest.raises(InputError, match="vocab_size must be a positive integer, got 0"):
        count_bigram([[0]], 0)


def test_save_load_round_trip(tmp_path):
    path = tmp_path / "sub" / "table.npz"
    table = np.array(HAND_TABLE, np.int32)
    assert save_bigram(str(path), table, "sha256:abc", {"files": 3}) == str(path)
    loaded = load_bigram(str(path), tokenizer_fingerprint="sha256:abc")
    assert loaded.dtype == np.int32 and loaded.tolist() == HAND_TABLE
    assert bigram_metadata(str(path)) == {"files": 3, "vocab_size": 7, "tokenizer_fingerprint": "sha256:abc"}
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o644)
    with pytest.raises(CheckpointError, match="was built with tokenizer sha256:abc, not sha256:other"):
        load_bigram(str(path), tokenizer_fingerprint="sha256:other")


def test_save_refuses_a_bad_table_and_writes_nothing(tmp_path):
    with pytest.raises(InputError, match="table must have dtype int32, got float32"):
        save_bigram(str(tmp_path / "t.npz"), np.zeros(4, np.float32), "sha256:abc")
    with pytest.raises(InputError, match=r"table maps token 2 to 9, outside \[0, 4\)"):
        save_bigram(str(tmp_path / "t.npz"), np.array([0, 1, 9, 3], np.int32), "sha256:abc")
    assert os.listdir(tmp_path) == []


def test_failed_save_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    path = str(tmp_path / "t.npz")
    save_bigram(path, np.array(HAND_TABLE, np.int32), "sha256:abc")

    def crash(file, **arrays):
        file.write(b"PK\x03\x04 half an archive")
        raise RuntimeError("disk full")

    monkeypatch.setattr(bigram_module.np, "savez", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        save_bigram(path, np.zeros(7, np.int32), "sha256:abc")
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["t.npz"]
    assert load_bigram(path).tolist() == HAND_TABLE


def _corruptions(good: bytes):
    """(file name, broken content) pairs made from a good file's bytes."""
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0xFF  # inside the table's data: the zip CRC check catches it
    return [("truncated.npz", good[: len(good) // 2]), ("empty.npz", b""),
            ("garbage.npz", b"this is not a zip archive at all"), ("flipped.npz", bytes(flipped))]


def test_corrupt_or_missing_file_raises_checkpoint_error(tmp_path):
    good_path = tmp_path / "good.npz"
    save_bigram(str(good_path), np.arange(64, dtype=np.int32)[::-1].copy(), "sha256:abc")
    for name, content in _corruptions(good_path.read_bytes()):
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(CheckpointError, match="corrupt or not an .npz file") as info:
            load_bigram(str(path))
        assert str(path) in str(info.value)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_bigram(str(tmp_path / "absent.npz"))
    np.save(tmp_path / "array.npy", np.zeros(4, np.int32))
    with pytest.raises(CheckpointError, match="not an .npz archive"):
        load_bigram(str(tmp_path / "array.npy"))


def _write_fields(path, **overrides):
    fields = dict(format_version=np.int64(1), table=np.array([1, 0, 2], np.int32), vocab_size=np.int64(3),
                  tokenizer_fingerprint=np.str_("sha256:abc"), metadata=np.str_("{}"))
    fields.update(overrides)
    np.savez(path, **{k: v for k, v in fields.items() if v is not None})
    return str(path)


def test_wrong_fields_raise_checkpoint_error(tmp_path):
    assert load_bigram(_write_fields(tmp_path / "ok.npz")).tolist() == [1, 0, 2]
    cases = [
        (dict(table=np.array([1, 0, 2], np.int64)), "must have dtype int32, got int64"),
        (dict(table=np.array([[1, 0, 2]], np.int32)), r"must have shape \[V\] with V >= 1, got \(1, 3\)"),
        (dict(vocab_size=np.int64(4)), r"has shape \(3,\), expected \(4,\) for its vocab_size"),
        (dict(table=np.array([1, 0, 3], np.int32)), r"maps token 2 to 3, outside \[0, 3\)"),
        (dict(metadata=None), "lacks field"),
        (dict(metadata=np.str_("{not json")), "malformed metadata"),
        (dict(format_version=np.int64(7)), "format version 7"),
    ]
    for i, (overrides, message) in enumerate(cases):
        path = _write_fields(tmp_path / f"bad{i}.npz", **overrides)
        with pytest.raises(CheckpointError, match=message):
            load_bigram(path)


def _make_data_dir(root):
    (root / "pkg" / "deep").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n")
    (root / "pkg" / "deep" / "notes.md").write_text("# Notes\n\nreturn a value; return a value.\n")
    (root / "readme.txt").write_text("plain text, plain text, plain words\n")
    (root / "data.json").write_text('{"ignored": ["json", "json", "json"]}\n')
    return sorted(str(p) for p in (root / "pkg" / "mod.py", root / "pkg" / "deep" / "notes.md", root / "readme.txt"))


def test_cli_builds_the_table_of_a_directory(tmp_path, capsys):
    data = tmp_path / "data"
    files = _make_data_dir(data)
    out = tmp_path / "out" / "bigram.npz"
    rc = main(["build-bigram", "--tokenizer", DEFAULT_TOKENIZER_PATH, "--data", str(data), "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    tokenizer = load_tokenizer(DEFAULT_TOKENIZER_PATH)
    sequences = [tokenizer.encode(open(p).read()).ids for p in files]  # the .json file is not counted
    num_tokens = sum(map(len, sequences))
    assert f"3 files, {num_tokens} tokens, vocab 4096 -> {out}" in printed
    table = load_bigram(str(out), tokenizer_fingerprint=tokenizer_fingerprint(tokenizer))
    assert table.tolist() == reference_bigram(sequences, 4096)
    assert np.array_equal(build_bigram_from_directory(DEFAULT_TOKENIZER_PATH, str(data), progress=False), table)


def test_cli_reports_bad_input_cleanly(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "only.json").write_text("{}")
    out = tmp_path / "bigram.npz"
    rc = main(["build-bigram", "--tokenizer", DEFAULT_TOKENIZER_PATH, "--data", str(empty), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and f"data directory {str(empty)!r} holds no *.py / *.txt / *.md files" in err
    rc = main(["build-bigram", "--tokenizer", str(tmp_path / "nope.json"), "--data", str(empty), "--out", str(out)])
    assert rc == 2 and "nope.json' does not exist" in capsys.readouterr().err
    assert not out.exists()


def test_shipped_table_loads_and_belongs_to_the_embedded_tokenizer():
    table = default_bigram()
    assert table.dtype == np.int32 and table.shape == (4096,)
    assert len(set(table.tolist())) > 200  # a real table, not a constant fallback
    metadata = bigram_metadata(DEFAULT_BIGRAM_PATH)
    assert metadata["tokenizer_fingerprint"] == tokenizer_fingerprint(load_tokenizer(DEFAULT_TOKENIZER_PATH))


def test_shipped_table_equals_a_rebuild():
    corpus = collect_corpus()
    if corpus_fingerprint(corpus.train, corpus.root) != bigram_metadata(DEFAULT_BIGRAM_PATH)["corpus_fingerprint"]:
        pytest.skip("this Python's standard library differs from the one the shipped table was counted on")
    table, fingerprint, metadata = compute_default_bigram(progress=False)
    assert np.array_equal(table, default_bigram())
    assert metadata["train_files"] == len(corpus.train) == bigram_metadata(DEFAULT_BIGRAM_PATH)["train_files"]


def test_missing_shipped_table_names_the_rebuild_command(tmp_path, monkeypatch):
    monkeypatch.setattr(bigram_module, "DEFAULT_BIGRAM_PATH", str(tmp_path / "gone.npz"))
    with pytest.raises(CheckpointError, match="rebuild it with `python -m ssd_jax.draft.bigram`"):
        bigram_module.default_bigram()
