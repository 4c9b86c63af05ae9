"""Max-Gram's bigram table: the most frequent next token of every token, counted over a corpus
with numpy and stored as a small `.npz` tied to its tokenizer by a fingerprint.

The table for the embedded tokenizer ships at `ssd_jax/assets/models/maxgram_bigram.npz`. It is
built from the training split of the stdlib corpus (`collect_corpus().train`, the split the
embedded models were trained on; held-out files stay unseen) and is rebuilt exactly with
`python -m ssd_jax.draft.bigram`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import tempfile
import zipfile
from typing import Iterable, Iterator, Sequence

import numpy as np

from ssd_jax.errors import CheckpointError, InputError
from ssd_jax.runtime.progress import Progress
from ssd_jax.train.corpus import collect_corpus, read_text

_MODELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "models")
DEFAULT_BIGRAM_PATH = os.path.join(_MODELS_DIR, "maxgram_bigram.npz")
DEFAULT_TOKENIZER_PATH = os.path.join(_MODELS_DIR, "target", "tokenizer.json")
REBUILD_COMMAND = "python -m ssd_jax.draft.bigram"
DIRECTORY_EXTENSIONS = (".py", ".txt", ".md")

_FORMAT_VERSION = 1
_FIELDS = ("format_version", "table", "vocab_size", "tokenizer_fingerprint", "metadata")
# A dense V x V count matrix up to this vocabulary (4096^2 counts = 128 MiB as bincount's int64);
# above it, pair counts come from sorting the pair codes.
_DENSE_MAX_VOCAB = 4096
_ENCODE_CHUNK = 64  # files per tokenizer.encode_batch call


def count_bigram(sequences: Iterable[Sequence[int]], vocab_size: int) -> np.ndarray:
    """The most frequent next token of each token: int32 [vocab_size].

    sequences: token id sequences (lists, arrays, ...); pairs are counted within each sequence,
    never across two. Ties go to the smallest next id. A token never followed by anything maps to
    the corpus' most frequent token overall (ties: smallest id).
    Raises InputError for an id outside [0, vocab_size) (naming it) or a corpus without tokens.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
        raise InputError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    vocab_size = int(vocab_size)
    ids, codes = [], []
    for index, sequence in enumerate(sequences):
        seq = _as_ids(sequence, vocab_size, index)
        ids.append(seq)
        codes.append(seq[:-1] * vocab_size + seq[1:])
    all_ids = np.concatenate(ids) if ids else np.zeros((0,), np.int64)
    if all_ids.size == 0:
        raise InputError("the corpus holds no tokens: cannot count a bigram table")
    most_frequent = int(np.argmax(np.bincount(all_ids, minlength=vocab_size)))
    table = np.full((vocab_size,), most_frequent, np.int32)
    codes = np.concatenate(codes)
    if codes.size == 0:
        return table
    if vocab_size <= _DENSE_MAX_VOCAB:
        counts = np.bincount(codes, minlength=vocab_size * vocab_size).reshape(vocab_size, vocab_size)
        seen = counts.max(axis=1) > 0
        table[seen] = counts.argmax(axis=1)[seen]  # argmax takes the first maximum: the smallest id
    else:
        pairs, counts = np.unique(codes, return_counts=True)
        previous, following = np.divmod(pairs, vocab_size)
        order = np.lexsort((following, -counts, previous))  # per previous token: most counts, then smallest id
        previous, following = previous[order], following[order]
        first = np.ones(previous.shape, bool)
        first[1:] = previous[1:] != previous[:-1]
        table[previous[first]] = following[first]
    return table


def _as_ids(sequence, vocab_size: int, index: int) -> np.ndarray:
    """One sequence as int64 [N], checked against the vocabulary."""
    arr = np.asarray(sequence)
    if arr.size == 0:
        return np.zeros((0,), np.int64)
    if arr.ndim != 1:
        raise InputError(f"sequence {index} must be 1-D token ids, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise InputError(f"sequence {index} must hold integer token ids, got dtype {arr.dtype}")
    bad = np.flatnonzero((arr < 0) | (arr >= vocab_size))
    if bad.size:
        position = int(bad[0])
        raise InputError(
            f"token id {int(arr[position])} at position {position} of sequence {index} "
            f"is outside the vocabulary [0, {vocab_size})"
        )
    return arr.astype(np.int64)


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of a `tokenizers.Tokenizer`'s canonical JSON (`to_str()`), as 'sha256:<hex>'."""
    return "sha256:" + hashlib.sha256(tokenizer.to_str().encode("utf-8")).hexdigest()


def load_tokenizer(path: str):
    """A `tokenizers.Tokenizer` from a tokenizer.json file; InputError naming a missing/bad file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise InputError(f"tokenizer file {path!r} does not exist")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path)
    except Exception as err:  # the Rust side raises a bare Exception
        raise InputError(f"unreadable tokenizer file {path!r}: {err}") from None


def list_text_files(data_dir: str, extensions: Sequence[str] = DIRECTORY_EXTENSIONS) -> list[str]:
    """Sorted paths of the files under data_dir (recursive) ending in one of extensions.

    Raises InputError naming data_dir if it is missing, not a directory, or holds no such file.
    """
    data_dir = os.fspath(data_dir)
    if not os.path.isdir(data_dir):
        raise InputError(f"data directory {data_dir!r} does not exist or is not a directory")
    paths = [
        os.path.join(directory, name)
        for directory, _, names in os.walk(data_dir)
        for name in names
        if name.endswith(tuple(extensions))
    ]
    if not paths:
        raise InputError(f"data directory {data_dir!r} holds no {' / '.join('*' + e for e in extensions)} files")
    return sorted(paths)


def bigram_from_files(tokenizer, paths: Sequence[str], *, progress: bool = True,
                      desc: str = "bigram") -> tuple[np.ndarray, int]:
    """Tokenizes each file (one sequence per file) and counts the table.

    Returns (table int32 [tokenizer vocab size], number of tokens counted).
    """
    num_tokens = 0

    def encoded(bar: Progress) -> Iterator[list[int]]:
        nonlocal num_tokens
        for start in range(0, len(paths), _ENCODE_CHUNK):
            chunk = paths[start: start + _ENCODE_CHUNK]
            for encoding in tokenizer.encode_batch([read_text(p) for p in chunk]):
                num_tokens += len(encoding.ids)
                yield encoding.ids
            bar.update(len(chunk))

    with Progress(len(paths), desc, unit="files", enabled=progress) as bar:
        table = count_bigram(encoded(bar), tokenizer.get_vocab_size())
    return table, num_tokens


def build_bigram_from_directory(tokenizer_path: str, data_dir: str, progress: bool = True) -> np.ndarray:
    """The table of every *.py / *.txt / *.md file under data_dir (sorted, recursive), tokenized
    with tokenizer_path: int32 [vocab size]. InputError if no such file exists."""
    tokenizer = load_tokenizer(tokenizer_path)
    table, _ = bigram_from_files(tokenizer, list_text_files(data_dir), progress=progress)
    return table


def save_bigram(path: str, table: np.ndarray, tokenizer_fingerprint: str, metadata: dict | None = None) -> str:
    """Writes the table atomically (temp file + os.replace: never a half-written file) as an
    `.npz` with its vocab size, the tokenizer fingerprint and optional JSON metadata.

    table: int32 [V] with ids in [0, V). Returns the absolute path.
    """
    table = _checked_table(np.asarray(table), InputError, "table")
    if not isinstance(tokenizer_fingerprint, str) or not tokenizer_fingerprint:
        raise InputError(f"tokenizer_fingerprint must be a non-empty string, got {tokenizer_fingerprint!r}")
    try:
        metadata_json = json.dumps(dict(metadata or {}), sort_keys=True)
    except (TypeError, ValueError) as err:
        raise InputError(f"bigram metadata must be JSON-serializable: {err}") from None
    path = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".partial-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(
                f, format_version=np.int64(_FORMAT_VERSION), table=table.astype(np.int32),
                vocab_size=np.int64(table.shape[0]), tokenizer_fingerprint=np.str_(tokenizer_fingerprint),
                metadata=np.str_(metadata_json),
            )
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes a private file; the table is ordinary readable data
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    return path


def load_bigram(path: str, *, tokenizer_fingerprint: str | None = None) -> np.ndarray:
    """Reads a table written by `save_bigram`: int32 [V].

    Raises CheckpointError naming the path if the file is missing or corrupt, the table has the
    wrong dtype/shape or ids outside [0, V), or (when tokenizer_fingerprint is given) it was
    built with another tokenizer.
    """
    table, fingerprint, _ = _read(path)
    if tokenizer_fingerprint is not None and fingerprint != tokenizer_fingerprint:
        raise CheckpointError(
            f"bigram table {path!r} was built with tokenizer {fingerprint}, not {tokenizer_fingerprint}"
        )
    return table


def bigram_metadata(path: str) -> dict:
    """The metadata saved with a table, plus its vocab_size and tokenizer_fingerprint."""
    table, fingerprint, metadata = _read(path)
    return dict(metadata, vocab_size=int(table.shape[0]), tokenizer_fingerprint=fingerprint)


def _read(path: str) -> tuple[np.ndarray, str, dict]:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"bigram table {path!r} does not exist")
    try:
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise ValueError(f"holds a single {type(data).__name__}, not an .npz archive")
        with data:
            missing = [name for name in _FIELDS if name not in data.files]
            fields = {name: data[name] for name in _FIELDS if name in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise CheckpointError(f"bigram table {path!r} is corrupt or not an .npz file: {err}") from None
    if missing:
        raise CheckpointError(f"bigram table {path!r} lacks field(s) {', '.join(missing)}")
    version = fields["format_version"]
    if version.shape != () or int(version) != _FORMAT_VERSION:
        raise CheckpointError(f"bigram table {path!r} has format version {version}, expected {_FORMAT_VERSION}")
    vocab_size = fields["vocab_size"]
    if vocab_size.shape != () or vocab_size.dtype.kind not in "iu":
        raise CheckpointError(f"bigram table {path!r} has a malformed vocab_size {vocab_size!r}")
    table = _checked_table(fields["table"], CheckpointError, f"bigram table {path!r}")
    if table.shape[0] != int(vocab_size):
        raise CheckpointError(
            f"bigram table {path!r} has shape {table.shape}, expected ({int(vocab_size)},) for its vocab_size"
        )
    try:
        fingerprint = str(fields["tokenizer_fingerprint"][()])
        metadata = json.loads(str(fields["metadata"][()]))
    except (ValueError, TypeError) as err:
        raise CheckpointError(f"bigram table {path!r} has malformed metadata: {err}") from None
    if not isinstance(metadata, dict):
        raise CheckpointError(f"bigram table {path!r} has metadata that is not a JSON object")
    return table, fingerprint, metadata


def _checked_table(table: np.ndarray, error: type[Exception], what: str) -> np.ndarray:
    if table.dtype != np.int32:
        raise error(f"{what} must have dtype int32, got {table.dtype}")
    if table.ndim != 1 or table.shape[0] < 1:
        raise error(f"{what} must have shape [V] with V >= 1, got {table.shape}")
    bad = np.flatnonzero((table < 0) | (table >= table.shape[0]))
    if bad.size:
        raise error(f"{what} maps token {int(bad[0])} to {int(table[bad[0]])}, outside [0, {table.shape[0]})")
    return table


# --- the shipped table -------------------------------------------------------------------------


def default_bigram() -> np.ndarray:
    """The shipped table for the embedded tokenizer: int32 [4096]. CheckpointError if missing."""
    if not os.path.isfile(DEFAULT_BIGRAM_PATH):
        raise CheckpointError(
            f"the Max-Gram bigram table {DEFAULT_BIGRAM_PATH!r} is missing; rebuild it with `{REBUILD_COMMAND}`"
        )
    return load_bigram(DEFAULT_BIGRAM_PATH)


def corpus_fingerprint(paths: Sequence[str], root: str) -> str:
    """sha256 over each file's path relative to root and its bytes: names the exact corpus."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            content = f.read()
        relative = os.path.relpath(path, root).replace(os.sep, "/").encode("utf-8")
        for part in (relative, content):
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
    return "sha256:" + digest.hexdigest()


def compute_default_bigram(progress: bool = True) -> tuple[np.ndarray, str, dict]:
    """Counts the shipped table from scratch: the embedded tokenizer over the stdlib corpus'
    training split. Returns (table int32 [V], tokenizer fingerprint, metadata)."""
    tokenizer = load_tokenizer(DEFAULT_TOKENIZER_PATH)
    corpus = collect_corpus()
    table, num_tokens = bigram_from_files(tokenizer, corpus.train, progress=progress, desc="bigram (stdlib train)")
    metadata = dict(
        source="python stdlib, training split of ssd_jax.train.corpus.collect_corpus()",
        python=sys.version.split()[0], train_files=len(corpus.train), tokens=num_tokens,
        corpus_fingerprint=corpus_fingerprint(corpus.train, corpus.root), rebuild=REBUILD_COMMAND,
    )
    return table, tokenizer_fingerprint(tokenizer), metadata


def rebuild_default_bigram(path: str = DEFAULT_BIGRAM_PATH, progress: bool = True) -> str:
    """Recounts the shipped table and writes it to path. Returns the absolute path."""
    table, fingerprint, metadata = compute_default_bigram(progress=progress)
    return save_bigram(path, table, fingerprint, metadata)


if __name__ == "__main__":
    print(rebuild_default_bigram())
