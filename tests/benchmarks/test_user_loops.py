"""The user loops (``benchmarks/user_loops.py``) run, and replaying their kept batches gives the live diagnoses.

A tiny loop of each model family trains a few steps as a user's RL loop does; the replay is what the
tables are computed from when iterating on rules, so it must name the same causes on the same steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import user_loops  # noqa: E402


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_a_tiny_healthy_loop_is_never_named_a_cause_and_its_replay_agrees(model: str) -> None:
    setting = user_loops.Setting(model, "bfloat16", sync=True, dropout=0.0, seed=3, steps=4, batch=8, group=2)
    kept: list = []
    live = user_loops.run(setting, kept)
    assert len(kept) == 4 and len(live) >= 3  # a step whose groups all tie has no action token: not judged
    assert all(step.cause in user_loops.HEALTHY_CAUSES for step in live), [s.message for s in live]
    replayed = user_loops.replay(setting, kept)
    assert [(s.step, s.cause) for s in replayed] == [(s.step, s.cause) for s in live]


def test_a_never_synced_sampler_with_dropout_is_dropout_and_stale() -> None:
    setting = user_loops.Setting("gpt2", "bfloat16", sync=False, dropout=0.1, seed=3, steps=5, batch=8, group=2)
    steps = user_loops.run(setting)
    assert steps[0].cause == "dropout" and steps[-1].cause == "dropout + stale", [s.cause for s in steps]
    assert all(user_loops.right(setting, step) for step in steps)
