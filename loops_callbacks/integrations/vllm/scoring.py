"""``VLLMSamplingClient``: a reference scorer on vLLM's prompt logprobs, for DPO's reference logprobs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from loops_callbacks import run_warnings
from loops_callbacks.integrations.vllm.engine import VLLMWarning, engine_config, import_vllm, refuse_logits
from loops_callbacks.integrations.vllm.rollouts import _sampled_logprobs
from loops_callbacks.reference.clients import ScorerClient
from loops_callbacks.reference.packing import PackedTokens, check_token_ids
from loops_callbacks.validation import check_reference_logprobs


class VLLMSamplingClient(ScorerClient):
    """A ``SamplingClient`` on vLLM's prompt logprobs: one ``SamplingParams(max_tokens=1, prompt_logprobs=0)``
    request per sequence, all at once (vLLM batches them).

    ``compute_logprobs(prompt)`` / ``compute_logprobs_batch(prompts)`` answer as every
    ``SamplingClient`` does (element 0 ``None``); ``score_packed`` gives the flat ``ref_logprobs``
    layout the DPO DataModule reads; ``fingerprint()`` hashes the engine's weights, so its values
    are cached like a local reference's. The requests skip the prefix cache
    (``skip_reading_prefix_cache=True``): prompt logprobs served with prefix caching came back
    stale (vLLM #42019), so an engine built with prefix caching on is told, once, that its scoring
    requests do not use it. An engine that reports logits (``logprobs_mode="*_logits"``) is refused, and so is an
    answer that is not every prompt's logprobs: fewer outputs than prompts, one that answers another prompt, or a
    value that is not a logprob (NaN, infinite, above 0 beyond rounding), a ``ValueError`` naming the datum and
    position.

    Args:
        llm: the ``vllm.LLM`` holding the reference weights.

    On the same weights it equals ``TorchSamplingClient`` in float32 (to 1e-4 in the tests)::

        reference = VLLMSamplingClient(LLM(model_dir, dtype="float32"))
        data = attach_reference_logprobs(data, reference)
    """

    path = "vllm"  # what scored: the engine (a local client's is its model's output head or logits)

    def __init__(self, llm: Any) -> None:
        vllm = import_vllm("VLLMSamplingClient")
        config = engine_config(llm)
        refuse_logits(str(config.model_config.logprobs_mode),
                      "the reference engine with logprobs_mode='raw_logprobs' (the default)")
        self.llm = llm
        self.vocab_size = int(config.model_config.get_vocab_size())
        self.dtype = str(config.model_config.dtype).removeprefix("torch.")
        self.max_tokens_per_batch = int(config.scheduler_config.max_num_batched_tokens)  # of one forward pass
        self._params = vllm.SamplingParams(
            max_tokens=1, prompt_logprobs=0, skip_reading_prefix_cache=True, flat_logprobs=True, detokenize=False
        )
        if config.cache_config.enable_prefix_caching:
            run_warnings.warn(
                "VLLMSamplingClient: the engine has prefix caching on; its scoring requests skip it "
                "(skip_reading_prefix_cache=True), since prompt logprobs served from the prefix cache came back stale "
                "(vLLM #42019). Build a reference-only engine with enable_prefix_caching=False to say so yourself",
                VLLMWarning,
            )

    def score_packed(
        self, packed: PackedTokens, *, progress: Callable[[int], None] | None = None, lockstep: Any = None
    ) -> torch.Tensor:
        """Flat float32 values in the ``ref_logprobs`` layout: value k of a sequence is log p(token k + 1 | tokens
        up to k), its last value 0. ``lockstep`` is not used (one engine scores for the rank)."""
        check_token_ids(packed, self.vocab_size)
        scored = np.flatnonzero(packed.lengths >= 2)  # a one-token sequence has nothing to score
        offsets = packed.offsets
        requests = [{"prompt_token_ids": packed.ids[offsets[i] : offsets[i + 1]].tolist()} for i in scored]
        outputs = list(self.llm.generate(requests, self._params, use_tqdm=False)) if requests else []
        if len(outputs) != len(requests):  # zipped, the sequences without one would read 0.0: certain tokens
            raise ValueError(f"vLLM returned {len(outputs)} outputs for {len(requests)} prompts (the sequences of "
                             "two or more tokens); every prompt needs its prompt logprobs")
        values = np.zeros(packed.num_tokens, dtype=np.float32)
        base = int(offsets[0])
        for number, (index, output) in enumerate(zip(scored.tolist(), outputs)):
            start, stop = int(offsets[index]), int(offsets[index + 1])
            targets, where = packed.ids[start + 1 : stop], f"sequence {index}"
            answered = getattr(output, "prompt_token_ids", None)
            if answered is not None and list(answered) != requests[number]["prompt_token_ids"]:
                raise ValueError(f"vLLM's output {number} answers the prompt {_short(answered)}, not datum {index}'s "
                                 f"{_short(requests[number]['prompt_token_ids'])}")
            logprobs = output.prompt_logprobs
            if logprobs is None or len(logprobs) != stop - start:
                raise ValueError(f"vLLM gave {where} {0 if logprobs is None else len(logprobs)} prompt logprobs for "
                                 f"{stop - start} tokens")
            values[start - base : stop - base - 1] = _sampled_logprobs(logprobs[1:], targets, where)  # [0] is None
        check_reference_logprobs(values, where="vLLM's prompt logprobs", lengths=packed.lengths)
        if progress is not None:
            progress(packed.num_tokens)
        return torch.from_numpy(values)

    def fingerprint(self) -> str:
        """A sha256 of the engine's weights (vLLM's names and layout) and dtype: a cache key, read from every weight."""
        return self.llm.collective_rpc(_weights_fingerprint, args=(f"vllm:{self.dtype}",))[0]

    def __repr__(self) -> str:
        return f"VLLMSamplingClient(dtype={self.dtype!r}, vocab_size={self.vocab_size})"


def _short(ids: Any) -> str:
    """Token ids for a message: all of them up to 8, else the first 8 and how many."""
    ids = list(ids)
    return str(ids) if len(ids) <= 8 else f"{str(ids[:8])[:-1]}, ... ({len(ids)} tokens)]"


def _weights_fingerprint(worker: Any, tag: str) -> str:
    """On a vLLM worker: ``weights_fingerprint`` of its model."""
    from loops_callbacks.distributed import ProcessGroup
    from loops_callbacks.reference.fingerprint import weights_fingerprint

    return weights_fingerprint(worker.model_runner.get_model(), tag=tag, group=ProcessGroup(local=True))
