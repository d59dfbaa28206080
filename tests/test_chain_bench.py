"""``replaylm.bench.chain``'s search and shapes (the timing itself needs a GPU)."""

from __future__ import annotations

from replaylm.bench import chain


def test_pair_descent_finds_a_pair_that_tuning_alone_misses():
    # Slot 0's option "a" is fastest alone; with slot 1 at "y" (slower alone), "b" beats it
    # together by more than "y" loses: the joint optimum (b, y).
    alone = {0: {"a": 1.0, "b": 1.5}, 1: {"x": 1.0, "y": 1.2}}

    def time_fn(opts):
        t = alone[0][opts[0]] + alone[1][opts[1]]
        return t - (1.0 if opts == ["b", "y"] else 0.0)

    best, t, trials = chain.pair_descent([["a", "b"], ["x", "y"]], ["a", "x"], time_fn)
    assert best == ["b", "y"] and abs(t - 1.7) < 1e-9
    assert trials[0] == (["a", "x"], 2.0)  # the start is timed first
    # Each combination is timed once, and the second round (no change) adds nothing new.
    assert sorted(tuple(o) for o, _ in trials) == [("a", "x"), ("a", "y"), ("b", "x"),
                                                  ("b", "y")]


def test_pair_descent_wraps_from_the_last_slot_to_the_first():
    # Only slots 2 and 0 interact (down before the next layer's qkv).
    def time_fn(opts):
        return 1.0 - (0.5 if (opts[2], opts[0]) == (1, 1) else 0.0)

    best, t, _ = chain.pair_descent([[0, 1]] * 3, [0, 0, 0], time_fn)
    assert (best[2], best[0]) == (1, 1) and t == 0.5


def test_pair_descent_keeps_the_start_when_nothing_beats_it():
    best, t, trials = chain.pair_descent([[1, 2, 3]], [2], lambda o: abs(o[0] - 2))
    assert best == [2] and t == 0 and len(trials) == 3


def test_projections_and_options_of_a_named_shape():
    ps = chain.projections_of("qwen3-0.6b")
    assert [(p.name, p.kind, p.n, p.k) for p in ps] == [
        ("qkv", "norm", 4096, 1024), ("o_proj", "plain", 1024, 2048),
        ("gate_up", "norm", 6144, 1024), ("down", "silu", 1024, 3072)]
    opts = chain.options_of(ps[0])
    assert opts[0] is None  # the unfused path
    # Tiles as gemv's tuner times them: BLOCK_K capped at K's next power of two.
    assert all(o[0] == 1 and o[2] <= 1024 for o in opts[1:]) and (1, 2, 1024, 4) in opts
