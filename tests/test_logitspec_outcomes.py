"""`benchmarks/logitspec_outcomes.py`: its step rules replayed on made-up outcomes, and its smoke
run on the embedded target (the tree it builds, walked on the greedy text)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import logitspec_outcomes  # noqa: E402


def test_rules_replay_steps_and_prices():
    # Position i: the depth a tree verified there accepts, and whether its root branch retrieved.
    depth = [0, 0, 3, 0, 0, 0, 1, 0]
    retrieved = [1, 0, 1, 0, 0, 0, 1, 0]
    # always: trees at 0, 1, 2 (+4) and 6 (+2): 8 positions for 4 trees.
    assert logitspec_outcomes.replay(depth, retrieved, "always", 2.0) == (8, 8.0)
    # retrieved: trees at 0, 2 (+4) and 6, a plain step at 1.
    assert logitspec_outcomes.replay(depth, retrieved, "retrieved", 2.0) == (8, 2.0 + 1.0 + 2.0 + 2.0)
    # oracle: trees only where they accept (2, 6), plain steps at 0 and 1.
    assert logitspec_outcomes.replay(depth, retrieved, "oracle", 2.0) == (8, 1.0 + 1.0 + 2.0 + 2.0)


def test_smoke_run_walks_trees_on_the_greedy_text(capsys):
    assert logitspec_outcomes.main(["--smoke"]) == 0
    table = capsys.readouterr().out
    assert all(name in table for name in ("code", "prose", "repetition"))


def test_outcomes_match_a_hand_built_repeat():
    """Text that repeats the prompt: the root branch retrieves the copy and the walk accepts it."""
    import numpy as np

    prompt = [5, 6, 7, 8, 9, 5, 6]
    text = [7, 8, 9, 5, 6, 7]
    logits = np.zeros((len(prompt) + len(text), 16), np.float32)
    found = logitspec_outcomes.outcomes(prompt, text, logits, root_len=3, size=8)
    # At text[0] = 7 (after 5 6 7): the copy continues 8 9 5, all accepted.
    assert found["retrieved"][0] == 3 and found["depth"][0] == 3
    assert len(found["depth"]) == len(text)
