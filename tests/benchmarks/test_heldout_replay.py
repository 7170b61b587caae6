"""bench_diagnosis replays each held-out set as its generator made it, and scores it as documented.

The replay's trainer module must carry the set's model with the fault's dropout p (the monitor
reads the dropout modules directly); the healthy engine before a fault is the set's own; a stale
prompt-prefix cache has its own row, where "stale" is right; "template" or "unrelated" are right for a
template change. No model is trained here: the steps are hand-made where the numbers don't matter.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_diagnosis as bench  # noqa: E402
import heldout_faults as hf  # noqa: E402

from loops_callbacks.divergence.batch import observe_modules  # noqa: E402

FRESH = hf.SETS[2]


def test_the_replay_module_shows_the_faults_dropout_p() -> None:
    fault = FRESH.fault("dropout 0.05 in the trainer")
    step = {"trainer_training": True, "training_logprobs": torch.zeros(2, 3)}
    module = bench.ReplayModule([step], FRESH, fault)
    module.training_step(step, 0)
    seen = observe_modules(module, precision=None)
    assert seen.dropout_active and seen.max_dropout_p == pytest.approx(0.05)
    assert module.policy.config.n_layer == FRESH.n_layer and module.policy.config.vocab_size == FRESH.vocab
    module.training_step({**step, "trainer_training": False}, 1)
    assert not observe_modules(module, precision=None).dropout_active


def test_every_set_2_fault_follows_healthy_steps_of_its_own_engine() -> None:
    data = {f.name: [{"fault": f.name, "index": i} for i in range(FRESH.monitor_steps)] for f in FRESH.faults}
    engines = {dtype: bench.healthy_engine(FRESH, dtype).name for dtype in ("float32", "bfloat16")}
    assert engines == {"float32": "fp32 generate, raw", "bfloat16": "bf16 sampler, processed"}
    for fault in FRESH.faults:
        prefix = bench.healthy_prefix(data, fault, FRESH)
        if fault.cause == "template":
            assert prefix == [], fault.name
            continue
        assert {step["fault"] for step in prefix} == {engines[fault.sampler_dtype]}, fault.name
        assert [step["index"] for step in prefix] == list(range(bench.HEALTHY_STEPS)), fault.name
    with pytest.raises(ValueError, match="no healthy float16 engine"):
        bench.healthy_engine(FRESH, "float16")


def test_a_stale_prefix_cache_has_its_own_row_and_template_changes_accept_their_names() -> None:
    for heldout_set in hf.SETS.values():
        for fault in heldout_set.faults:
            rows = {bench.truth_row(fault, truth) for truth in ("none", fault.cause)}
            expected = {"none", bench.PREFIX_CACHE} if fault.stale_prefix else {"none", fault.cause}
            assert rows == expected, fault.name
    assert bench.accepted(bench.PREFIX_CACHE, bench.HELDOUT_ACCEPTED) == ("stale",)
    for truth in ("template", "template, slight", "unrelated"):
        assert bench.accepted(truth, bench.HELDOUT_ACCEPTED) == bench.accepted(truth, bench.ACCEPTED)
        assert set(bench.accepted(truth, bench.ACCEPTED)) == {"template", "unrelated"}, truth
    for truth in ("none", "precision", "temperature", "truncation", "shift", "stale", "dropout"):
        assert "unclear" not in bench.accepted(truth, bench.HELDOUT_ACCEPTED), truth


def test_the_table_shows_a_named_cause_that_causes_lacks(capsys: pytest.CaptureFixture[str]) -> None:
    table = {
        "template": collections.Counter({"template": 3, "unclear": 1}),
        bench.PREFIX_CACHE: collections.Counter({"stale": 3, "precision": 1}),
    }
    bench.print_confusion(table, bench.HELDOUT_ACCEPTED, ["template", bench.PREFIX_CACHE], "true cause")
    out = capsys.readouterr().out
    header = out.splitlines()[0].split(" | ")
    assert "template" in header and header.count("template") == 1, header
    assert f"| {bench.PREFIX_CACHE} |" in out and out.count("| 75% |") == 2, out
    assert "template 3/3 (100%)" in out and "precision 0/1 (0%)" in out and "stale 3/3 (100%)" in out, out
