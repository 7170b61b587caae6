"""vLLM's ``RequestOutput``s as the monitor's padded batch, and the check of the engine's sampling settings."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from loops_callbacks import run_warnings
from loops_callbacks.divergence.batch import SamplerFacts
from loops_callbacks.integrations.vllm.engine import VLLMWarning, engine_config, engine_facts, refuse_logits
from loops_callbacks.validation import check, check_int, check_reference_logprobs

_SAID = run_warnings.RunWarnings()
"""The sampling-settings warning, once per process and settings."""


def prompt_token_ids(prompts: Sequence[Any], tokenizer: Any = None, *, vocab_size: int | None = None) -> list[list[int]]:
    """Each prompt's token ids: ids as given (a list, a 1-D integer array or tensor, a ``ModelInput``), or chat
    messages (a list of ``{"role": ..., "content": ...}``) through ``tokenizer``'s chat template with the
    generation prompt. Ids are ints in ``[0, vocab_size)`` (``>= 0`` when ``vocab_size`` is not given): a
    float, a bool or an id out of range is refused (``token_id_array``), never rounded.

    Examples:
        >>> import torch
        >>> prompt_token_ids([[1, 2], torch.tensor([3])])
        [[1, 2], [3]]
        >>> prompt_token_ids([[{"role": "user", "content": "hi"}]])
        Traceback (most recent call last):
        ...
        ValueError: prompt 0 is chat messages: pass tokenizer= (a Hugging Face tokenizer with a chat template)
    """
    check("prompts", prompts, (list, tuple), "a list of prompts")
    check_int("vocab_size", vocab_size, least=1, optional=True)
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
            prompt = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, return_dict=False)
        ids = token_id_array(prompt, f"prompt {index}", vocab_size, what="a list, a 1-D array or tensor, a "
                             "ModelInput, or chat messages")
        if not ids.size:
            raise ValueError(f"prompt {index} is empty; vLLM needs at least one prompt token")
        result.append(ids.tolist())
    return result


def token_id_array(ids: Any, where: str, vocab_size: int | None = None, *, what: str = "") -> np.ndarray:
    """``ids`` as an int64 array: a list or tuple of ints (NumPy integers too), a 1-D array or tensor of an
    integer dtype, or a ``ModelInput``; each in ``[0, vocab_size)``, or in int64 and ``>= 0`` when the
    vocabulary is not known. A float, a bool or anything else is a ``TypeError``, an id out of range a
    ``ValueError``, both naming ``where`` and the position: ids are never rounded or wrapped. Arrays and
    tensors are checked whole; a list is read once.

    Examples:
        >>> token_id_array([3, 1.5], "prompt 0")
        Traceback (most recent call last):
        ...
        TypeError: prompt 0: position 1 is 1.5 (float), not a token id (an int >= 0)
    """
    to_ints = getattr(ids, "to_ints", None)
    if callable(to_ints):  # a ModelInput
        ids = to_ints()
    if isinstance(ids, (torch.Tensor, np.ndarray)):
        kind = "tensor" if isinstance(ids, torch.Tensor) else "array"
        if ids.ndim != 1:
            raise TypeError(f"{where} is a {ids.ndim}-D {kind}; token ids are 1-D")
        integer = ids.dtype.kind in "iuO" if kind == "array" else not (
            ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool)
        if not integer:
            readable = len(ids) and (kind == "array" or ids.device.type != "meta")
            first = f" (position 0 is {ids[0].item()!r})" if readable else ""
            raise TypeError(f"{where} holds {ids.dtype} values{first}; token ids are integers (an integer dtype)")
        if kind == "tensor" and ids.device.type == "meta":
            raise TypeError(f"{where} is a tensor on the meta device: it holds no token ids")
        ids = ids.detach().cpu().numpy() if kind == "tensor" else ids
        ids = ids.tolist() if ids.dtype.kind == "O" else ids
    if isinstance(ids, np.ndarray):
        array = ids
    elif isinstance(ids, (list, tuple)):
        kinds = set(map(type, ids))
        if not all(issubclass(kind, (int, np.integer)) and not issubclass(kind, bool) for kind in kinds):
            position, value = next((k, v) for k, v in enumerate(ids)
                                   if not isinstance(v, (int, np.integer)) or isinstance(v, bool))
            raise TypeError(f"{where}: position {position} is {value!r} ({type(value).__name__}), not a token id "
                            "(an int >= 0)")
        values = ids if kinds <= {int} else list(map(int, ids))  # NumPy integers as ints: exact, never via floats
        try:
            array = np.array(values, dtype=np.int64)
        except OverflowError:
            position = next(k for k, v in enumerate(values) if not -(2**63) <= v < 2**63)
            raise ValueError(f"{where} has token id {values[position]} at position {position}; a token id is an int "
                             ">= 0 (within int64)") from None
    else:
        raise TypeError(f"{where} must be token ids ({what or 'a list, a 1-D array or tensor, a ModelInput'}), got "
                        f"{type(ids).__name__}")
    bad = array < 0 if array.dtype.kind == "i" else np.zeros(array.shape, dtype=bool)
    if vocab_size is not None:
        bad |= array >= vocab_size
    elif array.dtype == np.uint64:
        bad |= array >= np.uint64(2**63)
    if bad.any():
        position = int(np.argmax(bad))
        token = int(array[position])
        within = f", outside the vocabulary [0, {vocab_size})" if vocab_size is not None and token >= 0 else \
            "; a token id is an int >= 0 (within int64)"
        raise ValueError(f"{where} has token id {token} at position {position}{within}")
    return array.astype(np.int64, copy=False)


def generate_rollouts(
    llm: Any, prompts: Sequence[Any], sampling_params: Any, *, tokenizer: Any = None, weight_sync: Any = None,
    pad_id: int = 0, groups: Sequence[int] | None = None, device: str | torch.device | None = None,
) -> dict[str, Any]:
    """``llm.generate`` on ``prompts`` (``prompt_token_ids``), as ``rollout_batch`` with the engine's facts.

    ``weight_sync`` (the engine's ``VLLMWeightSync``) gives the weights' version and whether the prefix
    cache is stale; without it both are unknown. See ``rollout_batch`` for the rest.
    """
    vocab_size = getattr(engine_config(llm).model_config, "get_vocab_size", None)
    ids = prompt_token_ids(prompts, tokenizer, vocab_size=int(vocab_size()) if callable(vocab_size) else None)
    if weight_sync is not None and weight_sync.llm is not llm:
        raise ValueError("weight_sync belongs to another engine than llm; pass the VLLMWeightSync of this engine")
    facts = weight_sync.facts(sampling_params) if weight_sync is not None else engine_facts(llm, sampling_params)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in ids], sampling_params, use_tqdm=False)
    if len(outputs) != len(ids):
        raise ValueError(f"llm.generate answered {len(outputs)} RequestOutputs for {len(ids)} prompts")
    for index, (output, prompt) in enumerate(zip(outputs, ids)):
        answered = list(getattr(output, "prompt_token_ids", None) or ())
        if answered != prompt:
            raise ValueError(f"llm.generate's outputs[{index}] answers the prompt {answered!r:.200}, not prompt {index} "
                             f"({prompt!r:.200})")
    return rollout_batch(outputs, facts=facts, pad_id=pad_id, groups=groups, device=device)


def rollout_batch(
    outputs: Sequence[Any], *, facts: SamplerFacts | None = None, policy_version: int | None = None,
    groups: Sequence[int] | None = None, pad_id: int = 0, device: str | torch.device | None = None,
) -> dict[str, Any]:
    """The monitor's padded batch from ``LLM.generate``'s ``RequestOutput``s (the package docstring says how).

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
    ``[B, T]``), ``group`` (and ``policy_version``) int64 ``[B]``, ``sampler_prompt_ids`` (int64 ``[B, P]``, each
    row's ``prompt_token_ids`` padded on the left with -1: the monitor compares them with the prompt the trainer
    scores), and ``sampler_facts`` when given.
    """
    check("outputs", outputs, (list, tuple), "the list LLM.generate returns")
    if not outputs:
        raise ValueError("outputs is empty: LLM.generate answers one RequestOutput per prompt, and a batch needs one")
    prompts, completions, logprobs, counts = [], [], [], []
    for i, output in enumerate(outputs):
        prompt, samples = getattr(output, "prompt_token_ids", None), getattr(output, "outputs", None)
        if prompt is None or samples is None:
            raise TypeError(f"outputs[{i}] is not a vLLM RequestOutput (it needs prompt_token_ids and outputs), got "
                            f"{type(output).__name__}")
        prompt = token_id_array(prompt, f"outputs[{i}].prompt_token_ids")
        if not prompt.size:
            raise ValueError(f"outputs[{i}].prompt_token_ids is empty; vLLM samples after at least one prompt token")
        if not len(samples):
            raise ValueError(f"outputs[{i}] has no completions (its outputs is empty)")
        counts.append(len(samples))
        for j, sample in enumerate(samples):
            where = f"outputs[{i}].outputs[{j}]"
            if getattr(sample, "token_ids", None) is None or not hasattr(sample, "logprobs"):
                raise TypeError(f"{where} is not a vLLM CompletionOutput (it needs token_ids and logprobs), got "
                                f"{type(sample).__name__}")
            tokens = token_id_array(sample.token_ids, f"{where}.token_ids")
            if not tokens.size:
                raise ValueError(f"{where} has no tokens: a completion has at least one (max_tokens >= 1)")
            prompts.append(prompt)
            completions.append(tokens)
            logprobs.append(_sampled_logprobs(sample.logprobs, tokens, where))
    _check_sampled_logprobs(logprobs, counts)
    return _padded_batch(prompts, completions, logprobs, counts, facts, policy_version, groups, pad_id, device)


def _check_sampled_logprobs(logprobs: list[np.ndarray], counts: list[int]) -> None:
    """A ``ValueError`` naming ``outputs[i].outputs[j]`` and the position unless every sampled token's logprob is
    one (``check_reference_logprobs``): one pass over them all, and over each completion only to name a bad one."""
    try:
        check_reference_logprobs(np.concatenate(logprobs), where="the sampled tokens' logprobs")
    except ValueError:
        owners = [(i, j) for i, count in enumerate(counts) for j in range(count)]
        for (i, j), values in zip(owners, logprobs):
            check_reference_logprobs(values, where=f"outputs[{i}].outputs[{j}].logprobs")
        raise


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
            if entry is not None and not isinstance(entry, Mapping):
                raise TypeError(f"{where}.logprobs[{position}] is {entry!r:.100} ({type(entry).__name__}), not a dict "
                                "of token id to Logprob")
            found = entry.get(token) if entry else None
            if found is None:
                raise ValueError(f"{where}: position {position} has no logprob for its token {token}")
            value = getattr(found, "logprob", None)
            if value is None:
                raise TypeError(f"{where}.logprobs[{position}][{token}] is {found!r:.100} ({type(found).__name__}), "
                                "not a vLLM Logprob (with .logprob)")
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise TypeError(f"{where}.logprobs[{position}][{token}].logprob is {value!r:.100} "
                                f"({type(value).__name__}), not a number")
            values.append(value)
        return np.asarray(values, dtype=np.float64)
    starts = np.asarray(starts, dtype=np.int64)  # FlatLogprobs: the sampled token comes first at each position
    ends, count = np.asarray(logprobs.end_indices, dtype=np.int64), len(logprobs.token_ids)
    if starts.shape != tokens.shape or ends.shape != tokens.shape or (starts < 0).any() or (starts > ends).any() \
            or (ends > count).any() or len(logprobs.logprobs) != count:
        raise ValueError(f"{where}: FlatLogprobs' start_indices {starts.tolist()!r:.200} do not index its {count} "
                         f"token_ids ({len(logprobs.logprobs)} logprobs, end_indices {ends.tolist()!r:.200}, "
                         f"{len(tokens)} tokens)")
    empty = np.flatnonzero(ends <= starts)
    if empty.size:
        raise ValueError(f"{where}: position {int(empty[0])} has no logprob for its token")
    ids = np.asarray(logprobs.token_ids, dtype=np.int64)[starts]
    wrong = np.flatnonzero(ids != tokens)
    if wrong.size:
        k = int(wrong[0])
        raise ValueError(f"{where}: position {k} has a logprob for token {ids[k]}, not for its token {tokens[k]}")
    try:
        return np.asarray(logprobs.logprobs, dtype=np.float64)[starts]
    except (TypeError, ValueError):
        raise TypeError(f"{where}.logprobs holds values that are not numbers: {logprobs.logprobs!r:.200}") from None


def _padded_batch(
    prompts: list[Sequence[int]], completions: list[np.ndarray], logprobs: list[np.ndarray], counts: list[int],
    facts: SamplerFacts | None, policy_version: int | None, groups: Sequence[int] | None, pad_id: int,
    device: str | torch.device | None,
) -> dict[str, Any]:
    """Rows ``prompt + completion``, right-padded; the completion's tokens are the action tokens, and
    ``counts[i]`` rows (a group) belong to prompt i."""
    if facts is not None:
        check("facts", facts, SamplerFacts, "a SamplerFacts (engine_facts(llm, params))")
        refuse_logits(facts.logprobs_mode, "it with logprobs_mode='processed_logprobs' (or 'raw_logprobs')")
        _warn_if_other_distribution(facts)
    check_int("pad_id", pad_id, least=0)
    device = _device(device)
    group_per_prompt = range(len(counts)) if groups is None else [
        check_int(f"groups[{i}]", group, least=0) for i, group in enumerate(groups)]
    if len(group_per_prompt) != len(counts):
        raise ValueError(f"groups has {len(group_per_prompt)} ids for {len(counts)} prompts; give one int per prompt")
    lengths = np.array([len(p) + len(c) for p, c in zip(prompts, completions)], dtype=np.int64)
    first_actions = np.array([len(p) - 1 for p in prompts], dtype=np.int64)  # the position predicting token len(p)
    width = int(lengths.max(initial=1))
    tokens = np.full((len(lengths), width), pad_id, dtype=np.int64)
    tokens[np.arange(width) < lengths[:, None]] = np.concatenate([np.zeros(0, np.int64), *(
        np.concatenate([np.asarray(p, dtype=np.int64), c]) for p, c in zip(prompts, completions))])
    positions = np.arange(width - 1)
    mask = (positions >= first_actions[:, None]) & (positions < lengths[:, None] - 1)
    sampler = np.zeros(mask.shape, dtype=np.float32)
    sampler[mask] = np.concatenate([np.zeros(0), *logprobs])  # row by row, each row's positions in order
    batch: dict[str, Any] = {
        "input_ids": torch.from_numpy(tokens[:, :-1].copy()),
        "target_tokens": torch.from_numpy(tokens[:, 1:].copy()),
        "logprobs": torch.from_numpy(sampler),
        "mask": torch.from_numpy(mask.astype(np.float32)),
        "group": torch.from_numpy(np.repeat(np.asarray(group_per_prompt, dtype=np.int64), counts)),
        "sampler_prompt_ids": torch.from_numpy(_left_padded(prompts)),
    }
    version = policy_version if policy_version is not None else (facts.weight_version if facts else None)
    if version is not None:
        check_int("policy_version (the trainer's optimizer steps of the sampling weights)", version, least=0)
        batch["policy_version"] = torch.full((len(lengths),), version, dtype=torch.int64)
    if device is not None:
        batch = {key: value.to(device) for key, value in batch.items()}
    if facts is not None:
        batch["sampler_facts"] = facts
    return batch


def _left_padded(prompts: list[Sequence[int]]) -> np.ndarray:
    """Int64 ``[B, P]``: each row's prompt, padded on the left with -1 (the monitor's ``sampler_prompt_ids``)."""
    lengths = np.array([len(p) for p in prompts], dtype=np.int64)
    width = int(lengths.max(initial=0))
    ids = np.full((len(prompts), width), -1, dtype=np.int64)
    ids[np.arange(width) >= width - lengths[:, None]] = np.concatenate(
        [np.zeros(0, np.int64), *(np.asarray(p, dtype=np.int64) for p in prompts)])
    return ids


def _device(device: str | torch.device | None) -> torch.device | None:
    """``device`` as a ``torch.device`` that holds values (not ``meta``), or ``None``."""
    check("device", device, (str, torch.device), "a torch device (cpu, cuda, cuda:1, ...)", optional=True)
    if device is None:
        return None
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device={device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if resolved.type == "meta":
        raise ValueError(f"device={device!r} holds no values: pass where the batch's tensors go (cpu, cuda, ...)")
    return resolved


def _warn_if_other_distribution(facts: SamplerFacts) -> None:
    """One ``VLLMWarning`` per process and settings when the logprobs are not of the distribution sampled from."""
    if not facts.samples_other_than_reported:
        return
    settings = ", ".join(facts.sampling_settings)
    _SAID.warn(
        f"sampling:{facts.logprobs_mode}:{settings}",
        f"vLLM samples with {settings} but its logprobs_mode={facts.logprobs_mode!r} reports the model's distribution "
        "at temperature 1 before top-k / top-p: the sampler logprobs are not those of the distribution the tokens were "
        "drawn from, so the importance ratio is not the behaviour policy's. Build the engine with "
        "logprobs_mode='processed_logprobs' (LLM(..., logprobs_mode='processed_logprobs'); a server: --logprobs-mode "
        "processed_logprobs), or sample at temperature 1 without top-k / top-p",
        VLLMWarning,
    )
