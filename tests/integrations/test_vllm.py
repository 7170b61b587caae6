"""vLLM as the sampler and the reference scorer, on a real engine (the session's, ``conftest.py``).

Every comparison is against a Hugging Face float32 forward on the same weights: the engine computes
in float32 too, so the two agree to float32 rounding of differently ordered sums (measured here:
about 2e-5 nats at most), and 1e-4 is the bound. Runs whenever ``vllm`` imports.
"""

from __future__ import annotations

import copy
import logging
import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule

vllm = pytest.importorskip("vllm")

from loops_callbacks import attach_reference_logprobs, token_logprobs  # noqa: E402
from loops_callbacks.integrations.vllm import rollouts  # noqa: E402
from loops_callbacks.integrations.vllm import (  # noqa: E402
    VLLMSamplingClient,
    VLLMWarning,
    VLLMWeightSync,
    generate_rollouts,
    rollout_batch,
)
from loops_callbacks.reference import ReferenceConfig, score_across_ranks  # noqa: E402
from loops_callbacks.reference.clients import TorchSamplingClient  # noqa: E402
from loops_callbacks.reference.packing import PackedTokens  # noqa: E402
from loops_callbacks.types import Datum, ModelInput  # noqa: E402
from tests.integrations.conftest import VOCAB  # noqa: E402

FP32_BOUND = 1e-4
BLOCK = 128  # tokens per KV block on the CPU: a prefix of two full blocks is served from the prefix cache


class Policy(LightningModule):
    """A LightningModule holding its Hugging Face model as an attribute, as RL modules do."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.policy = model


def random_prompts(count: int, generator: torch.Generator, shortest: int = 3, longest: int = 20) -> list[list[int]]:
    lengths = torch.randint(shortest, longest + 1, (count,), generator=generator).tolist()
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def trainer_gap(model: Any, batch: dict[str, Any]) -> torch.Tensor:
    """d = trainer - sampler logprob on the batch's action tokens, the trainer a Hugging Face forward."""
    with torch.no_grad():
        trainer = token_logprobs(model(batch["input_ids"]).logits, batch["target_tokens"])
    return (trainer - batch["logprobs"])[batch["mask"] > 0].double()


def test_fp32_rollouts_equal_a_hugging_face_forward_and_end_at_their_stop_token(engine: Any, hf_model: Any) -> None:
    stops = list(range(3, VOCAB, 3))  # a third of the vocabulary stops a completion
    params = vllm.SamplingParams(n=2, max_tokens=12, logprobs=0, flat_logprobs=True, stop_token_ids=stops)
    prompts = random_prompts(6, torch.Generator().manual_seed(0))
    outputs = engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    batch = rollout_batch(outputs, pad_id=0)
    d = trainer_gap(hf_model, batch)
    assert d.numel() == sum(len(c.token_ids) for o in outputs for c in o.outputs)
    assert d.abs().max().item() <= FP32_BOUND, d.abs().max().item()
    assert batch["group"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    stopped = 0
    for row, completion in enumerate(c for o in outputs for c in o.outputs):
        last = int(batch["mask"][row].nonzero().max())  # the completion's last action position
        assert batch["mask"][row, last + 1 :].sum() == 0 and (batch["target_tokens"][row, last + 1 :] == 0).all()
        if completion.finish_reason == "stop":
            stopped += 1
            assert int(batch["target_tokens"][row, last]) == completion.token_ids[-1] and completion.token_ids[-1] in stops
            assert batch["logprobs"][row, last] == completion.logprobs[-1][completion.token_ids[-1]].logprob
    assert stopped > 0


def test_a_completion_sampled_without_logprobs_is_refused(engine: Any) -> None:
    outputs = engine.generate([{"prompt_token_ids": [5, 6, 7]}], vllm.SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match=r"has no logprobs: sample with SamplingParams\(logprobs=0\)"):
        rollout_batch(outputs)


def test_the_engine_facts_and_the_warning_for_raw_logprobs_at_another_temperature(engine: Any) -> None:
    rollouts._SAID.reset()
    sync = VLLMWeightSync(engine)
    params = vllm.SamplingParams(max_tokens=2, logprobs=0, temperature=0.7)
    with pytest.warns(VLLMWarning, match=r"temperature 0.7 but its logprobs_mode='raw_logprobs'.*processed_logprobs"):
        batch = generate_rollouts(engine, [[5, 6, 7]], params, weight_sync=sync)
    facts = batch["sampler_facts"]
    assert (facts.engine, facts.dtype, facts.logprobs_mode, facts.temperature, facts.top_p, facts.top_k) == (
        "vllm", "float32", "raw_logprobs", 0.7, 1.0, 0)
    assert (facts.weight_version, facts.stale_prefix_cache) == (0, False) and batch["policy_version"].tolist() == [0]
    rollouts._SAID.reset()


def test_a_push_updates_the_engine_in_place_from_a_lightning_module(
    engine_back: Any, hf_model: Any, updated_model: Any
) -> None:
    prompts = random_prompts(4, torch.Generator().manual_seed(2))
    params = vllm.SamplingParams(max_tokens=8, logprobs=0, flat_logprobs=True)
    sync = VLLMWeightSync(engine_back)
    policy = Policy(updated_model)
    before = {name: tensor.clone() for name, tensor in policy.state_dict().items()}
    assert sync.push(policy) == 1  # names found under "policy.", +1 without a trainer
    batch = generate_rollouts(engine_back, prompts, params, weight_sync=sync)
    assert trainer_gap(updated_model, batch).abs().max().item() <= FP32_BOUND
    assert trainer_gap(hf_model, batch).abs().mean().item() > 100 * FP32_BOUND  # the old weights are gone
    assert all(torch.equal(tensor, before[name]) for name, tensor in policy.state_dict().items())
    assert batch["policy_version"].tolist() == [1] * 4 and sync.stale_prefix_cache is False
    assert sync.last_push_seconds is not None and sync.last_push_seconds < 30


def test_a_push_logs_no_false_alarm_about_the_rotary_cache(engine_back: Any, hf_model: Any) -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    logger.addHandler(handler)
    try:
        VLLMWeightSync(engine_back).push(hf_model)
    finally:
        logger.removeHandler(handler)
    assert not [r.getMessage() for r in records if "Failed to load weights" in r.getMessage()]


def test_a_partial_push_names_the_parameters_it_would_leave_behind_and_writes_nothing(
    engine_back: Any, hf_model: Any, updated_model: Any
) -> None:
    headless = torch.nn.Module()
    headless.model = copy.deepcopy(updated_model.model)  # names model.*, no lm_head
    before = engine_weights(engine_back)
    with pytest.raises(ValueError, match=r"refused before anything was written: it would leave 1 of the engine's "
                                         r"parameters as they were .*\['lm_head.weight'\]"):
        VLLMWeightSync(engine_back, prefix="").push(headless)
    assert engine_weights(engine_back) == before


def test_without_the_reset_a_shared_prefix_is_served_kv_of_the_older_weights(
    engine_back: Any, hf_model: Any, updated_model: Any
) -> None:
    generator = torch.Generator().manual_seed(3)
    system = torch.randint(3, VOCAB, (2 * BLOCK,), generator=generator).tolist()  # two full KV blocks
    prompts = [system + suffix for suffix in random_prompts(4, generator, shortest=4, longest=8)]
    params = vllm.SamplingParams(max_tokens=8, logprobs=0, flat_logprobs=True)
    fault = VLLMWeightSync(engine_back, reset_prefix_cache=False)
    fault.push(hf_model)
    fault.clear_prefix_cache()
    generate_rollouts(engine_back, prompts, params, weight_sync=fault)  # the prefix's KV, old weights, cached
    fault.push(Policy(updated_model))
    stale = generate_rollouts(engine_back, prompts, params, weight_sync=fault)
    assert stale["sampler_facts"].stale_prefix_cache is True
    stale_gap = trainer_gap(updated_model, stale).abs().mean().item()
    fault.clear_prefix_cache()
    fresh = generate_rollouts(engine_back, prompts, params, weight_sync=fault)
    assert fresh["sampler_facts"].stale_prefix_cache is False
    fresh_gap = trainer_gap(updated_model, fresh).abs().max().item()
    assert fresh_gap <= FP32_BOUND and stale_gap > 100 * FP32_BOUND, (stale_gap, fresh_gap)


def test_the_reference_client_equals_the_torch_client_on_the_same_weights(engine: Any, hf_model: Any) -> None:
    generator = torch.Generator().manual_seed(4)
    sequences = [[], [7]] + random_prompts(6, generator, shortest=2, longest=300)
    with pytest.warns(VLLMWarning, match="skip it"):  # the session engine has prefix caching on
        client = VLLMSamplingClient(engine)
    local = TorchSamplingClient(hf_model)
    got, want = client.compute_logprobs_batch(sequences), local.compute_logprobs_batch(sequences)
    assert [len(v) for v in got] == [len(s) for s in sequences] and got[1] == [None]
    worst = max((abs(a - b) for g, w in zip(got, want) for a, b in zip(g[1:], w[1:])), default=0.0)
    assert worst <= FP32_BOUND, worst
    packed = PackedTokens.from_sequences(sequences)
    assert torch.allclose(client.score_packed(packed), local.score_packed(packed), atol=FP32_BOUND, rtol=0)
    data = [Datum(ModelInput.from_ints(s)) for s in sequences[1:]]
    by_client = attach_reference_logprobs(data, client)
    by_local = attach_reference_logprobs(data, local)
    for a, b in zip(by_client, by_local):
        assert torch.allclose(torch.tensor(a.loss_fn_inputs["ref_logprobs"].data),
                              torch.tensor(b.loss_fn_inputs["ref_logprobs"].data), atol=FP32_BOUND, rtol=0)


def test_the_reference_client_never_reads_prompt_logprobs_from_a_stale_prefix_cache(
    engine_back: Any, hf_model: Any, updated_model: Any
) -> None:
    generator = torch.Generator().manual_seed(5)
    system = torch.randint(3, VOCAB, (2 * BLOCK,), generator=generator).tolist()
    sequences = [system + suffix for suffix in random_prompts(3, generator, shortest=4, longest=8)]
    engine_back.generate([{"prompt_token_ids": s} for s in sequences], vllm.SamplingParams(max_tokens=1),
                         use_tqdm=False)  # the shared prefix cached with the checkpoint's weights
    VLLMWeightSync(engine_back, reset_prefix_cache=False).push(Policy(updated_model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", VLLMWarning)
        client = VLLMSamplingClient(engine_back)
    packed = PackedTokens.from_sequences(sequences)
    gap = (client.score_packed(packed) - TorchSamplingClient(updated_model).score_packed(packed)).abs().max().item()
    assert gap <= FP32_BOUND, gap


def test_the_dpo_scoring_path_caches_the_engine_values_under_its_fingerprint(
    engine_back: Any, updated_model: Any, tmp_path: Any
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", VLLMWarning)
        client = VLLMSamplingClient(engine_back)
    fingerprint = client.fingerprint()
    assert client.fingerprint() == fingerprint and len(fingerprint) == 64
    packed = PackedTokens.from_sequences(random_prompts(5, torch.Generator().manual_seed(6), longest=40))
    config = ReferenceConfig(cache_dir=str(tmp_path), progress=False)
    values, report = score_across_ranks(packed, client, config)
    again, second = score_across_ranks(packed, client, config)
    assert (report.source, report.cache_written, second.source) == ("scored", True, "cache")
    assert torch.equal(torch.as_tensor(values), torch.as_tensor(again))
    VLLMWeightSync(engine_back).push(Policy(updated_model))
    assert client.fingerprint() != fingerprint  # other weights, another cache key


def engine_weights(engine: Any) -> str:
    """A sha256 of every weight the engine holds."""
    from loops_callbacks.integrations.vllm.scoring import _weights_fingerprint

    return engine.collective_rpc(_weights_fingerprint, args=("now",))[0]


def with_a_short_head(model: Any) -> Any:
    """``model`` whose output head has 12 rows too few: the last weight of its checkpoint, after every other."""
    short = copy.deepcopy(model)
    short.lm_head.weight = torch.nn.Parameter(torch.zeros(VOCAB - 12, short.lm_head.weight.shape[1]))
    return short


def test_a_mis_shaped_push_is_refused_by_name_before_the_engine_changes(
    engine_back: Any, hf_model: Any, updated_model: Any
) -> None:
    sync = VLLMWeightSync(engine_back)
    sync.push(hf_model, version=3)
    before = engine_weights(engine_back)
    with pytest.raises(ValueError, match=r"refused before anything was written: 1 of its 21 weights cannot be loaded "
                                         r"into the engine: 'lm_head.weight' of shape \(500, 128\) into the engine's "
                                         r"'lm_head.weight' of shape \(512, 128\) \(AssertionError"):
        sync.push(with_a_short_head(updated_model))
    assert engine_weights(engine_back) == before  # the embedding and every layer too
    facts = sync.facts(vllm.SamplingParams())
    assert (facts.weight_version, facts.stale_prefix_cache, facts.weights_unknown) == (3, False, False)


def test_a_module_on_the_meta_device_is_refused_by_name(engine_back: Any, hf_model: Any) -> None:
    with torch.device("meta"):
        empty = type(hf_model)(hf_model.config)
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' \(and 20 more\) is on the meta device: it holds "
                                         r"no values to push"):
        VLLMWeightSync(engine_back).push(empty)


def test_a_push_that_fails_part_way_leaves_an_engine_that_runs_with_weights_it_calls_unknown(
    engine_back: Any, hf_model: Any, updated_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = random_prompts(3, torch.Generator().manual_seed(7))
    params = vllm.SamplingParams(max_tokens=4, logprobs=0, flat_logprobs=True)
    sync = VLLMWeightSync(engine_back)
    monkeypatch.setattr(VLLMWeightSync, "_check", lambda self, weights: None)  # as if a check had missed it
    with pytest.raises(RuntimeError, match=r"the push failed part way \(AssertionError \(the last weight it was given: "
                                           r"'lm_head.weight' of shape \(500, 128\)\)\): the engine's weights are "
                                           r"unknown until a push succeeds"):
        sync.push(with_a_short_head(updated_model))  # the embedding and the layers are loaded before the head
    unknown = generate_rollouts(engine_back, prompts, params, weight_sync=sync)  # it still runs
    assert unknown["sampler_facts"].weights_unknown is True and sync.version == 0
    monkeypatch.undo()
    sync.push(hf_model)
    known = generate_rollouts(engine_back, prompts, params, weight_sync=sync)
    assert known["sampler_facts"].weights_unknown is False
    assert trainer_gap(hf_model, known).abs().max().item() <= FP32_BOUND


def test_the_reference_client_refuses_the_nan_of_an_engine_with_a_nan_weight(engine_back: Any, hf_model: Any) -> None:
    broken = copy.deepcopy(hf_model)
    with torch.no_grad():
        broken.lm_head.weight[7, 3] = float("nan")
    VLLMWeightSync(engine_back).push(broken)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", VLLMWarning)
        client = VLLMSamplingClient(engine_back)
    with pytest.raises(ValueError, match=r"vLLM's prompt logprobs: datum 0, position 0 is nan, not a logprob"):
        client.score_packed(PackedTokens.from_sequences([[5, 6, 7], [8, 9]]))


def test_the_reference_client_refuses_an_answer_short_of_a_prompt(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", VLLMWarning)
        client = VLLMSamplingClient(engine)
    generate = engine.generate
    monkeypatch.setattr(engine, "generate", lambda *args, **kwargs: generate(*args, **kwargs)[:-1])
    with pytest.raises(ValueError, match=r"vLLM returned 1 outputs for 2 prompts"):
        client.score_packed(PackedTokens.from_sequences([[5, 6, 7], [8, 9]]))
