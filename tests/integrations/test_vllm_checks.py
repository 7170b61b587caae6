"""What the vLLM integration refuses, against engine doubles (whether vLLM is installed or not): reference values
that are not logprobs or are missing, and pushes that would leave the engine's weights unknown."""

from __future__ import annotations

import math
from types import SimpleNamespace as Fake
from typing import Any

import pytest
import torch
from torch import nn

from loops_callbacks.divergence.batch import SamplerFacts
from loops_callbacks.integrations.vllm import VLLMSamplingClient, VLLMWeightSync
from loops_callbacks.reference.packing import PackedTokens
from tests.integrations.engine_double import EngineModel, Runner



def config(dtype: torch.dtype = torch.float32) -> Fake:
    return Fake(model_config=Fake(dtype=dtype, logprobs_mode="raw_logprobs", get_vocab_size=lambda: 16),
                cache_config=Fake(enable_prefix_caching=False), scheduler_config=Fake(max_num_batched_tokens=2048))


class ScoringLLM:
    """A vllm.LLM double answering prompt logprobs: -0.5 per token, ``bad`` at position 2 of a 4-token prompt,
    ``drop`` outputs left out."""

    def __init__(self, bad: float | None = None, drop: int = 0, reverse: bool = False) -> None:
        self.llm_engine = Fake(vllm_config=config())
        self.bad, self.drop, self.reverse = bad, drop, reverse

    def generate(self, requests: list[dict[str, Any]], params: Any, use_tqdm: bool = False) -> list[Fake]:
        outputs = []
        for request in requests:
            ids = request["prompt_token_ids"]
            values = [-0.5] * len(ids)
            if self.bad is not None and len(ids) == 4:
                values[2] = self.bad
            logprobs = [None] + [{t: Fake(logprob=v)} for t, v in zip(ids[1:], values[1:])]
            outputs.append(Fake(prompt_token_ids=ids, prompt_logprobs=logprobs))
        return (outputs[::-1] if self.reverse else outputs)[: len(outputs) - self.drop]


SEQUENCES = [[1, 2, 3], [4, 5, 6, 7], [9], [2, 3]]


def client(llm: ScoringLLM) -> VLLMSamplingClient:
    return VLLMSamplingClient(llm)  # prefix caching off: no warning


def test_the_double_scores_as_the_engine_does(vllm_stub: Any) -> None:
    values = client(ScoringLLM()).score_packed(PackedTokens.from_sequences(SEQUENCES))
    assert values.tolist() == [-0.5, -0.5, 0.0, -0.5, -0.5, -0.5, 0.0, 0.0, -0.5, 0.0]


@pytest.mark.parametrize("drop", [1, 3])
def test_fewer_outputs_than_prompts_is_an_error_not_zeros(vllm_stub: Any, drop: int) -> None:
    reference = client(ScoringLLM(drop=drop))
    with pytest.raises(ValueError, match=rf"vLLM returned {3 - drop} outputs for 3 prompts"):
        reference.score_packed(PackedTokens.from_sequences(SEQUENCES))
    with pytest.raises(ValueError, match=rf"vLLM returned {3 - drop} outputs for 3 prompts"):
        reference.compute_logprobs_batch(SEQUENCES)


@pytest.mark.parametrize("bad", [math.nan, 0.3, math.inf])
def test_an_engine_value_that_is_no_logprob_names_the_datum_and_position(vllm_stub: Any, bad: float) -> None:
    reference = client(ScoringLLM(bad=bad))
    with pytest.raises(ValueError, match=rf"vLLM's prompt logprobs: datum 1, position 1 is {bad:g}, not a logprob"):
        reference.score_packed(PackedTokens.from_sequences(SEQUENCES))
    with pytest.raises(ValueError, match=rf"datum 1, position 1 is {bad:g}"):
        reference.compute_logprobs_batch(SEQUENCES)


def test_outputs_in_another_order_than_the_prompts_are_refused_not_read_for_another_prompt(vllm_stub: Any) -> None:
    with pytest.raises(ValueError, match=r"vLLM's output 0 answers the prompt \[2, 3\], not datum 0's \[1, 2, 3\]"):
        client(ScoringLLM(reverse=True)).score_packed(PackedTokens.from_sequences(SEQUENCES))


def test_a_prompt_that_is_not_1d_names_itself(vllm_stub: Any) -> None:
    with pytest.raises(ValueError, match=r"prompt 0: expected a 1-D sequence of token ids, got a Tensor of shape"):
        client(ScoringLLM()).compute_logprobs(torch.tensor([[1, 2, 3]]))


# ---- the weight sync -------------------------------------------------------------------------------------


class SyncLLM:
    """A vllm.LLM double for the weight sync: collective_rpc into one worker, reset_prefix_cache."""

    def __init__(self) -> None:
        self.llm_engine = Fake(vllm_config=config())
        self.llm_engine.vllm_config.cache_config.enable_prefix_caching = True
        self.worker = Fake(model_runner=Runner(EngineModel()))

    @property
    def model(self) -> EngineModel:
        return self.worker.model_runner.model

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = (), kwargs: Any = None) -> list:
        return [method(self.worker, *args, **(kwargs or {}))]

    def reset_prefix_cache(self) -> bool:
        return True


def trained(embed: tuple[int, int] = (16, 4), head: tuple[int, int] = (16, 4), **extra: tuple[int, ...]) -> nn.Module:
    module = nn.Module()
    module.embed, module.head = nn.Embedding(*embed), nn.Linear(head[1], head[0], bias=False)
    for name, shape in extra.items():
        module.register_parameter(name, nn.Parameter(torch.zeros(shape)))
    return module


def engine_state(llm: SyncLLM) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in llm.model.state_dict().items()}


def facts_of(sync: VLLMWeightSync) -> SamplerFacts:
    return sync.facts(Fake(temperature=1.0, top_p=1.0, top_k=0))


def test_a_mis_shaped_weight_is_refused_before_anything_is_written_naming_it_and_both_shapes(vllm_stub: Any) -> None:
    llm = SyncLLM()
    sync = VLLMWeightSync(llm)
    before = engine_state(llm)
    with pytest.raises(ValueError, match=r"refused before anything was written: 1 of its 2 weights cannot be loaded "
                                         r"into the engine: 'head.weight' of shape \(12, 4\) \(AssertionError: "
                                         r"Attempted to load weight \(torch.Size\(\[12, 4\]\)\) into parameter "
                                         r"\(torch.Size\(\[16, 4\]\)\)\)"):
        sync.push(trained(head=(12, 4)))
    assert all(torch.equal(tensor, before[name]) for name, tensor in engine_state(llm).items())  # embed too
    assert (sync.version, sync.stale_prefix_cache, sync.weights_unknown) == (0, False, False)
    assert facts_of(sync).weights_unknown is False


def test_names_the_engine_does_not_have_are_all_listed_and_nothing_is_written(vllm_stub: Any) -> None:
    llm = SyncLLM()
    sync = VLLMWeightSync(llm, prefix="")
    before = engine_state(llm)
    with pytest.raises(ValueError, match=r"2 of its 4 weights cannot be loaded into the engine: 'extra_a' of shape "
                                         r"\(3,\) \(KeyError: 'extra_a'\); 'extra_b' of shape \(2, 2\) \(KeyError"):
        sync.push(trained(extra_a=(3,), extra_b=(2, 2)))
    assert all(torch.equal(tensor, before[name]) for name, tensor in engine_state(llm).items())
    assert (sync.version, sync.weights_unknown) == (0, False)


def test_a_push_that_would_leave_engine_parameters_as_they_were_is_refused_before_writing(vllm_stub: Any) -> None:
    llm = SyncLLM()
    sync = VLLMWeightSync(llm)
    before = engine_state(llm)
    with pytest.raises(ValueError, match=r"would leave 1 of the engine's parameters as they were .*\['head.weight'\]"):
        sync.push(nn.ModuleDict({"embed": nn.Embedding(16, 4)}))
    assert all(torch.equal(tensor, before[name]) for name, tensor in engine_state(llm).items())
    assert (sync.version, sync.stale_prefix_cache, sync.weights_unknown) == (0, False, False)


def test_a_module_on_the_meta_device_names_its_parameter(vllm_stub: Any) -> None:
    with torch.device("meta"):
        module = trained()
    sync = VLLMWeightSync(SyncLLM())
    with pytest.raises(ValueError, match=r"'embed.weight' \(and 1 more\) is on the meta device: it holds no values"):
        sync.push(module)
    assert (sync.version, sync.weights_unknown) == (0, False)


def test_a_push_that_fails_part_way_leaves_facts_that_say_the_weights_are_unknown(vllm_stub: Any) -> None:
    llm = SyncLLM()
    sync = VLLMWeightSync(llm)
    llm.model.fail_at = "head.weight"  # embed.weight is written first
    with pytest.raises(RuntimeError, match=r"the push failed part way \(RuntimeError: the device went away \(the "
                                           r"last weight it was given: 'head.weight' of shape \(16, 4\)\)\): the "
                                           r"engine's weights are unknown until a push succeeds"):
        sync.push(trained())
    facts = facts_of(sync)
    assert (sync.version, sync.weights_unknown, facts.weights_unknown, facts.stale_prefix_cache) == (0, True, True, True)
    llm.model.fail_at = None
    assert sync.push(trained()) == 1 and facts_of(sync).weights_unknown is False and not sync.stale_prefix_cache


def test_the_monitor_treats_a_step_sampled_from_unknown_weights_as_untrusted() -> None:
    from loops_callbacks import KLSampleTrainMonitor
    from loops_callbacks.divergence.monitor import GuardRail
    from tests.helpers import TinyPolicy, quiet_trainer

    class UnknownWeights(TinyPolicy):
        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, Any]:
            unknown = self.trainer.global_step >= 2
            facts = SamplerFacts(engine="vllm", weight_version=0, weights_unknown=unknown)
            return {**super().training_step(batch, batch_idx), "sampler_facts": facts}

    monitor = KLSampleTrainMonitor(guard_rail=GuardRail(max_kl=0.05, on_exceed="stop"))
    trainer = quiet_trainer(max_steps=6, callbacks=[monitor])
    with pytest.warns(UserWarning, match="cannot be trusted: the sampling engine's weights are unknown"):
        trainer.fit(UnknownWeights())
    assert trainer.global_step == 3 and "at step 2" in monitor.stop_reason
    assert "the step cannot be trusted: the sampling engine's weights are unknown" in monitor.stop_reason


def test_a_failed_clean_up_after_a_failed_push_is_said_with_the_push_s_own_error(
    vllm_stub: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loops_callbacks.integrations.vllm import weight_sync

    def cannot(worker: Any, model: Any) -> None:
        raise AttributeError("no model_config")

    monkeypatch.setattr(weight_sync, "_abandon_reload", cannot)
    llm = SyncLLM()
    llm.model.fail_at = "head.weight"
    sync = VLLMWeightSync(llm)
    with pytest.raises(RuntimeError, match=r"the device went away \(the last weight .*\); putting vLLM's waiting layers "
                                           r"back failed too \(AttributeError: no model_config\): rebuild the engine"):
        sync.push(trained())
    assert sync.weights_unknown
