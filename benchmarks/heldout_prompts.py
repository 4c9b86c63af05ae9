"""Held-out prompts: windows of the stdlib files the embedded models never trained on."""

from __future__ import annotations

import numpy as np

from ssd_jax.train.corpus import collect_corpus, read_text


def heldout_prompts(tokenizer, count: int = 20, prompt_tokens: int = 64, seed: int = 0) -> list[list[int]]:
    """`count` prompts of `prompt_tokens` ids, each starting at a line start of a held-out file."""
    corpus = collect_corpus()
    rng = np.random.default_rng(seed)
    files = list(corpus.heldout)
    rng.shuffle(files)
    prompts = []
    for path in files:
        ids = tokenizer.encode(read_text(path)).ids
        if len(ids) < prompt_tokens + 256:
            continue
        newline_starts = [i + 1 for i, t in enumerate(ids[: len(ids) - prompt_tokens - 200])
                          if "\n" in tokenizer.decode([t])]
        start = int(rng.choice(newline_starts)) if newline_starts else 0
        prompts.append(ids[start: start + prompt_tokens])
        if len(prompts) == count:
            break
    return prompts


def repetition_prompts(tokenizer, count: int = 20, body_tokens: int = 32, copies: int = 2, lead_tokens: int = 4,
                       seed: int = 1) -> list[list[int]]:
    """A repetition-heavy task: a held-out code snippet of body_tokens ids written `copies` times
    (separated by a blank line), then the first lead_tokens of it once more: the natural
    continuation repeats the snippet. (The embedded 11M-parameter target does not copy a snippet
    it has seen only once; twice is enough for it to pick up the pattern.)"""
    separator = tokenizer.encode("\n\n").ids
    snippets = heldout_prompts(tokenizer, count, prompt_tokens=body_tokens, seed=seed)
    return [(snippet + separator) * copies + snippet[:lead_tokens] for snippet in snippets]


def prose_prompts(tokenizer, count: int = 20, prompt_tokens: int = 64, min_continuation: int = 128,
                  seed: int = 2) -> list[list[int]]:
    """`count` prompts of English prose: windows of prompt_tokens ids at the start of a held-out
    file's docstrings (module, class or function) whose text runs at least prompt_tokens +
    min_continuation ids, taken from the source as written (quotes and indentation included), so
    the natural continuation is more of the same prose. Docstrings are the stdlib's prose; the
    embedded models trained on other files' docstrings."""
    import ast

    corpus = collect_corpus()
    candidates = []
    for path in sorted(corpus.heldout):
        if not path.endswith(".py"):
            continue
        source = read_text(path)
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        line_starts = np.cumsum([0] + [len(line) for line in source.splitlines(keepends=True)])
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = node.body
            if not (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                continue
            text = body[0].value.value
            if len(tokenizer.encode(text).ids) < prompt_tokens + min_continuation:
                continue
            start = int(line_starts[body[0].lineno - 1])
            ids = tokenizer.encode(source[start:]).ids
            candidates.append(ids[:prompt_tokens])
    if len(candidates) < count:
        raise ValueError(f"only {len(candidates)} held-out docstrings run {prompt_tokens + min_continuation} "
                         f"tokens; asked for {count} prose prompts")
    order = np.random.default_rng(seed).permutation(len(candidates))
    return [candidates[i] for i in order[:count]]
