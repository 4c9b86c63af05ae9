"""Checks that a draft can speculate for a target: same tokenizer (vocabulary sizes may differ,
as Qwen2's 151936 vs 152064 padding does; the ids one side lacks are masked by the engines)."""

from __future__ import annotations

import threading

from ssd_jax.errors import InputError
from ssd_jax.model import Model
from ssd_jax.runtime.recent import Recent

# Pairs of tokenizers found to agree, with their vocabulary sizes then: comparing two vocabularies
# takes milliseconds, and every call of
# a draft-model method checks its pair. The cache holds the tokenizers themselves, so their ids
# cannot be reused while listed; a tokenizer that gained tokens since is compared again.
_AGREEING = Recent(16)   # (id, id) -> (target tokenizer, draft tokenizer, their sizes)
_LOCK = threading.Lock()


def check_same_tokenizer(target: Model, draft: Model) -> None:
    """Raises InputError when both models carry tokenizers that map text to different ids."""
    if target.tokenizer is None or draft.tokenizer is None or target.tokenizer is draft.tokenizer:
        return
    key = (id(target.tokenizer), id(draft.tokenizer))
    sizes = (target.tokenizer.get_vocab_size(with_added_tokens=True),
             draft.tokenizer.get_vocab_size(with_added_tokens=True))
    with _LOCK:
        known = _AGREEING.lookup(key)
    if known is not None and known[2:] == sizes:
        return
    target_vocab = target.tokenizer.get_vocab(with_added_tokens=True)
    draft_vocab = draft.tokenizer.get_vocab(with_added_tokens=True)
    if target_vocab != draft_vocab:
        differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda kv: kv[1])
        example = differing[0] if differing else None
        raise InputError(
            f"draft tokenizer differs from the target's ({len(draft_vocab)} vs {len(target_vocab)} tokens; "
            f"first difference: {example!r}); the draft must share the target's tokenizer"
        )
    with _LOCK:
        _AGREEING.store(key, (target.tokenizer, draft.tokenizer) + sizes)
