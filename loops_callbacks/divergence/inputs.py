"""``read_step``: one training step's batch and ``training_step`` output, read once into a ``FlatBatch``.

Each field is looked up under its key (``DATA_KEYS``, remappable with ``keys=``) in the step's
output first, then in the batch. Two contract forms: Loops / Tinker datums (the batch, or
``"data"``) with the trainer's ``training_logprobs`` or a ``forward_backward_output``; or padded
``[B, T]`` tensors. A broken contract is a ``ValueError`` naming the keys found in each place and
how to provide what is missing. The per-datum keys (``policy_version``, ``group``, one advantage
per datum) are read by ``per_datum``; what it cannot use is a warning, never an error.

Examples:
    >>> batch = {"logprobs": torch.tensor([[-1.0, -2.0]]), "mask": torch.ones(1, 2)}
    >>> flat = read_step({"training_logprobs": torch.tensor([[-1.5, -2.0]])}, batch, data_keys(None))
    >>> flat.diff.tolist()
    [-0.5, 0.0]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from loops_callbacks.divergence import per_datum
from loops_callbacks.divergence.evidence import SamplerFacts
from loops_callbacks.divergence.flat_batch import FlatBatch, flatten_datums, flatten_padded
from loops_callbacks.divergence.prompts import datum_prompts, prompt_starts, read_sampler_prompts, trainer_tokens
from loops_callbacks.run_warnings import RunWarnings
from loops_callbacks.validation import check

DATA_KEYS = (
    "data", "training_logprobs", "forward_backward_output", "logprobs", "mask", "advantages", "target_tokens",
    "input_ids", "policy_version", "group", "training_entropy", "training_varentropy", "sampler_facts",
    "sampler_prompt_ids", "sampler_server", "attention_mask",
)
"""The names ``keys=`` may remap; by default each is read under its own name."""


def data_keys(keys: Mapping[str, str] | None) -> dict[str, str]:
    """``keys`` over the defaults; ``ValueError`` naming an unknown name or an empty key, ``TypeError``
    for a non-string key (``validation.check``).

    Examples:
        >>> data_keys({"logprobs": "sampler_lp"})["logprobs"]
        'sampler_lp'
    """
    given = dict(keys or {})
    unknown = sorted(set(given) - set(DATA_KEYS))
    if unknown:
        raise ValueError(f"keys has unknown names {unknown}; the names are {list(DATA_KEYS)}")
    for name, key in given.items():
        check(f"keys[{name!r}]", key, str, "a non-empty string", bool)
    return {name: given.get(name, name) for name in DATA_KEYS}


def key_label(keys: Mapping[str, str], name: str) -> str:
    """The key of ``name`` as the user gave it, and which name it stands for when ``keys=`` renamed it.

    Examples:
        >>> key_label(data_keys({"advantages": "adv"}), "advantages"), key_label(data_keys(None), "mask")
        ("'adv' (the advantages key)", "'mask'")
    """
    key = keys[name]
    return f"{key!r}" if key == name else f"{key!r} (the {name} key)"


def read_step(
    outputs: Any,
    batch: Any,
    keys: Mapping[str, str],
    *,
    with_tokens: bool = False,
    diagnose: bool = True,
    optimizer_step: int | None = None,
    max_groups: int = per_datum.DEFAULT_MAX_GROUPS,
    datum_advantages: bool = False,
    warnings: RunWarnings | None = None,
    servers: list[str] | None = None,
) -> FlatBatch:
    """The step's positions, in either contract form (module docstring).

    ``keys`` maps every name of ``DATA_KEYS`` to its key (``data_keys``); ``with_tokens`` keeps the
    worst tokens' look-up, ``diagnose`` what the diagnosis needs (the predicted ids it groups by). With
    ``optimizer_step`` (the caller keeps strata) the policy versions become lags and the groups ids
    (``max_groups``: the index of ``group_other``); ``datum_advantages`` reads one advantage per datum
    (for a correction that needs them); ``servers`` the run's sampling servers, in the order first named, to which
    each datum's ``sampler_server`` is looked up (and appended; ``per_datum.servers``). What these per-datum keys hold that cannot be used is a
    warning through ``warnings`` (once per run and problem).
    """
    step = _Step(outputs, batch, keys, warnings)
    data = step.data
    if data is None and _is_empty_list(batch) and (step.get("logprobs") is None or step.get("mask") is None):
        raise ValueError(
            f"KLSampleTrainMonitor: the batch is an empty {type(batch).__name__}: it holds no datums, and "
            f"training_step's output (keys: {_keys(outputs)}) has no {keys['logprobs']!r} and {keys['mask']!r} "
            "either. Give a list of Datum (with the sampler's 'logprobs' and a 'mask' in each loss_fn_inputs) as the "
            "batch or under 'data', or [B, T] tensors of logprobs and mask"
        )
    if data is not None:
        entropies = [keys[name] for name in ("training_entropy", "training_varentropy") if step.get(name) is not None]
        if entropies:
            raise ValueError(
                f"KLSampleTrainMonitor: {entropies} are read with padded [B, T] tensors, not with a list of Datum; "
                "return the batch's sampler 'logprobs' and 'mask' as [B, T] tensors to check what was sampled"
            )
        flat = flatten_datums(data, step.trainer_logprobs(datums=True), with_tokens=with_tokens, diagnose=diagnose,
                              advantages_key=keys["advantages"])
    else:
        missing = [keys[name] for name in ("logprobs", "mask") if step.get(name) is None]
        if missing:
            raise ValueError(
                f"KLSampleTrainMonitor: neither training_step's output (keys: {_keys(outputs)}) nor the batch "
                f"(keys: {_keys(batch)}) has {missing}. Provide the sampler's per-token logprobs "
                f"{keys['logprobs']!r} and the action-token mask {keys['mask']!r} as [B, T] tensors "
                "(in the batch or in the dict training_step returns), or a list of Datum as the batch "
                "(or under 'data'); other key names can be set with keys={'logprobs': ..., 'mask': ...}."
            )
        flat = flatten_padded(
            sampler_logprobs=step.get("logprobs"), training_logprobs=step.trainer_logprobs(datums=False),
            mask=step.get("mask"), advantages=step.get("advantages"), target_tokens=step.get("target_tokens"),
            input_ids=step.get("input_ids"), with_tokens=with_tokens, training_entropy=step.get("training_entropy"),
            training_varentropy=step.get("training_varentropy"),
        )
    found: dict[str, Any] = {}
    prompts = step.get("sampler_prompt_ids") if diagnose else None
    if prompts is None and diagnose and data is not None:
        prompts = datum_prompts(data, keys["sampler_prompt_ids"])
    if prompts is not None:  # the prompt the sampler saw, against the trainer's (``prompts``)
        found["sampler_prompts"] = read_sampler_prompts(prompts, flat.n_datums, device=flat.device,
                                                        key=step.label("sampler_prompt_ids"))
        found["prompt_tokens"], found["first_tokens"] = trainer_tokens(
            data, None if data is not None else step.get("input_ids"),
            None if data is not None else step.get("target_tokens"), flat)
        found["prompt_starts"] = (torch.zeros(flat.n_datums, dtype=torch.int64, device=flat.device) if data is not None
                                  else prompt_starts(step.get("attention_mask"), flat, step.label("attention_mask")))
        if found["prompt_tokens"] is None and warnings is not None:
            warnings.warn("sampler_prompt_ids:no_tokens", f"KLSampleTrainMonitor: {step.label('sampler_prompt_ids')} "
                          "is given, but the batch has neither 'input_ids' nor 'target_tokens': the prompts are not "
                          "compared")
    if datum_advantages:
        found["datum_advantages"] = per_datum.advantages(step, flat)
    if diagnose and servers is not None:
        found["servers"] = per_datum.servers(step, flat, servers)
    if optimizer_step is not None:
        found["groups"] = per_datum.groups(step, flat, max_groups)
        found["lags"] = per_datum.lags(step, flat, optimizer_step)
    return dataclasses.replace(flat, **found) if found else flat


def read_sampler_facts(outputs: Any, batch: Any, keys: Mapping[str, str], warnings: RunWarnings) -> SamplerFacts | None:
    """The sampling engine's ``SamplerFacts`` under ``keys["sampler_facts"]`` (the output first, then the
    batch); anything else there is one warning per run and ``None``: facts never stop training.

    Examples:
        >>> facts = SamplerFacts(engine="vllm", logprobs_mode="processed_logprobs")
        >>> read_sampler_facts({"sampler_facts": facts}, {}, data_keys(None), RunWarnings()) is facts
        True
    """
    found = _Step(outputs, batch, keys).get("sampler_facts")
    if found is None or isinstance(found, SamplerFacts):
        return found
    key = keys["sampler_facts"]
    warnings.warn(
        f"sampler_facts:{key}",
        f"KLSampleTrainMonitor: {key!r} holds a {type(found).__name__}, not a "
        "loops_callbacks.divergence.evidence.SamplerFacts; it is not read",
    )
    return None


def trainer_logprobs_from_output(forward_backward_output: Any) -> list[Any]:
    """The per-datum ``"logprobs"`` of a ``ForwardBackwardOutput`` (ours, Loops' or Tinker's).

    Examples:
        >>> from loops_callbacks.types import ForwardBackwardOutput
        >>> trainer_logprobs_from_output(ForwardBackwardOutput(loss_fn_outputs=[{"logprobs": [0.0]}]))
        [[0.0]]
    """
    outputs = getattr(forward_backward_output, "loss_fn_outputs", None)
    if outputs is None:
        raise TypeError(
            f"forward_backward_output has no loss_fn_outputs (got {type(forward_backward_output).__name__}); "
            "pass training_logprobs= instead, or the output of a forward_backward call whose loss returns "
            "per-datum logprobs"
        )
    missing = [i for i, item in enumerate(outputs) if not isinstance(item, Mapping) or "logprobs" not in item]
    if missing:
        raise ValueError(
            f"forward_backward_output.loss_fn_outputs items {missing[:10]}{'...' if len(missing) > 10 else ''} "
            f"have no 'logprobs' (of {len(outputs)} items); the loss function must return per-datum "
            "logprobs, or pass training_logprobs= directly"
        )
    return [item["logprobs"] for item in outputs]


class _Step:
    """One step's output and batch, looked up by name: the output first, then the batch; its datums (``None``:
    padded tensors), and where its warnings go (``per_datum`` reads the per-datum keys from it)."""

    def __init__(self, outputs: Any, batch: Any, keys: Mapping[str, str], warnings: RunWarnings | None = None) -> None:
        self.outputs, self.batch, self.keys = outputs, batch, keys
        self.say = warnings if warnings is not None else RunWarnings()
        data = self.get("data")
        self.data = batch if data is None and _is_datum_list(batch) else data

    def get(self, name: str) -> Any:
        key = self.keys[name]
        for source in (self.outputs, self.batch):
            if isinstance(source, Mapping) and source.get(key) is not None:
                return source[key]
        return None

    def label(self, name: str) -> str:
        return key_label(self.keys, name)

    def given_as_none(self, name: str) -> str | None:
        """Where ``name``'s key holds None ("training_step's output", "the batch") when no place has a value."""
        key = self.keys[name]
        places = [place for place, source in (("training_step's output", self.outputs), ("the batch", self.batch))
                  if isinstance(source, Mapping) and key in source and source[key] is None]
        return " and ".join(places) if places and self.get(name) is None else None

    def trainer_logprobs(self, *, datums: bool) -> Any:
        logprobs = self.get("training_logprobs")
        if logprobs is not None:
            return logprobs
        output = self.get("forward_backward_output") if datums else None
        if output is not None:
            return trainer_logprobs_from_output(output)
        also = f" or {self.keys['forward_backward_output']!r}" if datums else ""
        raise ValueError(
            f"KLSampleTrainMonitor: training_step's output has no {self.keys['training_logprobs']!r}{also} "
            f"(keys: {_keys(self.outputs)}). Return the trainer's per-token logprobs of the target tokens, e.g. "
            f"`return {{'loss': loss, {self.keys['training_logprobs']!r}: logprobs}}` with logprobs [B, T] "
            "(position k = the token predicted at k), or set keys={'training_logprobs': <your key>}."
        )


def _is_datum_list(batch: Any) -> bool:
    return (
        isinstance(batch, Sequence) and not isinstance(batch, (str, bytes, torch.Tensor)) and len(batch) > 0
        and (hasattr(batch[0], "loss_fn_inputs") or (isinstance(batch[0], Mapping) and "loss_fn_inputs" in batch[0]))
    )


def _is_empty_list(batch: Any) -> bool:
    return isinstance(batch, Sequence) and not isinstance(batch, (str, bytes, torch.Tensor)) and len(batch) == 0


def _keys(value: Any) -> list[str] | str:
    return sorted(map(str, value)) if isinstance(value, Mapping) else type(value).__name__
