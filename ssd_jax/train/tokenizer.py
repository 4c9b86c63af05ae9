"""Byte-level BPE tokenizer training with the `tokenizers` library."""

from __future__ import annotations

from typing import Iterable

from ssd_jax.errors import InputError

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 4096, min_frequency: int = 2):
    """Trains a byte-level BPE tokenizer; ids 0 and 1 are EOS and PAD. Returns a `tokenizers.Tokenizer`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 300:
        raise InputError(f"vocab_size must be at least 300 (256 bytes + merges), got {vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer
