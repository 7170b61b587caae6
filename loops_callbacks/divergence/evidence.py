"""What the monitor can see for certain about the trainer, before any statistic: direct evidence.

``observe_training(trainer, pl_module)`` reads, once per logged step:

* dropout that is live in the LightningModule: every module in training mode that is a dropout
  layer (``torch.nn.Dropout`` and its siblings, or any class named ``*Dropout*`` with a float
  ``p``) with p > 0, and every module in training mode with a float dropout attribute > 0 that
  Hugging Face attention layers apply functionally (``attention_dropout`` of Llama, Mistral,
  Qwen2; ``dropout`` of BART-style layers). Counted by kind and p: "12 Dropout modules with
  p = 0.1". Dropout in the trainer's forward puts noise into its logprobs that no sampler has;
  TRL turns it off by default for RL for this reason.
* the trainer's precision (``trainer.precision``, e.g. ``"bf16-mixed"``).

A diagnosis ranks these observations above statistical guesses (``diagnosis``). They are what
the modules are at the end of the step: logprobs computed under ``model.eval()`` inside
``training_step`` would carry no dropout noise, which the facts say.

Examples:
    >>> import torch
    >>> module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1), torch.nn.Dropout(0.1))
    >>> print(observe_modules(module, precision="32-true").facts)
    2 Dropout modules with p = 0.1 are in training mode (the trainer's logprobs include dropout noise unless computed in eval mode); the trainer's precision is 32-true
    >>> observe_modules(module.eval(), precision=None).dropout_active
    False
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

__all__ = ["SamplerFacts"]

FUNCTIONAL_DROPOUT_ATTRIBUTES = ("attention_dropout", "attn_dropout", "dropout", "dropout_p", "hidden_dropout")
"""Float attributes that modules apply as ``F.dropout(..., p=value, training=self.training)``."""


@dataclass(frozen=True)
class DropoutSeen:
    """``count`` modules of one kind (``Dropout``, or ``LlamaAttention.attention_dropout``) with dropout ``p``."""

    kind: str
    p: float
    count: int

    @property
    def text(self) -> str:
        plural = "s" if self.count != 1 else ""
        owner, _, attribute = self.kind.partition(".")  # a functional dropout attribute, or a layer's p
        return f"{self.count} {owner} module{plural} with {attribute or 'p'} = {self.p:g}"


class SamplerFacts(NamedTuple):
    """What the sampling engine says about itself, handed to the monitor under the batch key ``sampler_facts``
    (``loops_callbacks.integrations.vllm`` fills it; any engine can): facts, not guesses. A named tuple, so
    that Lightning's batch transfer (``apply_to_collection``) carries it through unchanged.

    ``dtype`` the engine's weights (``"bfloat16"``); ``logprobs_mode`` what its logprobs are (vLLM's
    ``"raw_logprobs"``: the model's distribution at temperature 1, whatever was sampled from;
    ``"processed_logprobs"``: after temperature, top-k and top-p); ``temperature``, ``top_p``,
    ``top_k`` the sampling settings (``None``: not known; top-k 0 or -1: off); ``weight_version``
    the engine's weight version (the trainer's optimizer steps at its last sync); ``stale_prefix_cache``
    whether the engine's weights were reloaded after its prefix cache was last reset (KV computed
    with older weights can be served to prompts that share a prefix), ``None`` when not known;
    ``weights_unknown`` whether a weight push into the engine failed part way, so that it holds neither the old
    weights nor the new ones (the guard rail cannot trust a step sampled then).

    Examples:
        >>> facts = SamplerFacts(engine="vllm", dtype="bfloat16", logprobs_mode="raw_logprobs", temperature=0.7)
        >>> facts.samples_other_than_reported
        True
    """

    engine: str = ""
    dtype: str | None = None
    logprobs_mode: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    weight_version: int | None = None
    stale_prefix_cache: bool | None = None
    weights_unknown: bool = False

    @property
    def sampling_settings(self) -> list[str]:
        """The settings that move the sampled distribution off the model's at temperature 1, as text
        (``["temperature 0.7", "top-p 0.9"]``): a temperature other than 1, top-p below 1, top-k on."""
        settings = [f"temperature {self.temperature:g}" if self.temperature not in (None, 1.0) else "",
                    f"top-p {self.top_p:g}" if self.top_p is not None and self.top_p < 1.0 else "",
                    f"top-k {self.top_k}" if self.top_k is not None and self.top_k > 0 else ""]
        return [setting for setting in settings if setting]

    @property
    def samples_other_than_reported(self) -> bool:
        """Whether the tokens are drawn from another distribution than the reported logprobs describe: raw
        (temperature-1, untruncated) logprobs with any of the ``sampling_settings``."""
        return self.logprobs_mode in ("raw_logprobs", "raw_logits") and bool(self.sampling_settings)


@dataclass(frozen=True)
class DirectEvidence:
    """What the trainer is, seen directly: live dropout (``dropout``) and its precision (``precision``)."""

    dropout: tuple[DropoutSeen, ...] = ()
    precision: str | None = None

    @property
    def dropout_active(self) -> bool:
        """Whether any dropout with p > 0 is live in the LightningModule."""
        return bool(self.dropout)

    @property
    def dropout_modules(self) -> int:
        """How many modules apply dropout (layers and functional attributes together)."""
        return sum(seen.count for seen in self.dropout)

    @property
    def max_dropout_p(self) -> float:
        """The largest live dropout probability; 0.0 when none is live."""
        return max((seen.p for seen in self.dropout), default=0.0)

    @property
    def reduced_precision(self) -> bool:
        """Whether the trainer computes in 16-bit (``16``/``bf16`` in its precision): its logprobs carry rounding."""
        return self.precision is not None and "16" in self.precision

    @property
    def facts(self) -> str:
        """The observations as one clause list, for the diagnosis' message (empty when nothing was seen)."""
        parts = []
        if self.dropout:
            parts.append(
                ", ".join(seen.text for seen in self.dropout)
                + (" is" if self.dropout_modules == 1 else " are")
                + " in training mode (the trainer's logprobs include dropout noise unless computed in eval mode)"
            )
        if self.precision is not None:
            parts.append(f"the trainer's precision is {self.precision}")
        return "; ".join(parts)


def observe_modules(module: torch.nn.Module, *, precision: str | None) -> DirectEvidence:
    """The direct evidence of ``module`` (walked once) and a known ``precision``."""
    counts: collections.Counter[tuple[str, float]] = collections.Counter()
    for child in module.modules():
        if not child.training:
            continue
        layer = isinstance(child, torch.nn.modules.dropout._DropoutNd) or "Dropout" in type(child).__name__
        p = getattr(child, "p", None) if layer else None  # a dropout layer's probability
        if isinstance(p, (float, int)) and not isinstance(p, bool) and 0.0 < float(p) <= 1.0:
            counts[type(child).__name__, float(p)] += 1
            continue
        for attribute in FUNCTIONAL_DROPOUT_ATTRIBUTES:
            value = getattr(child, attribute, None)
            if isinstance(value, float) and 0.0 < value <= 1.0:
                counts[f"{type(child).__name__}.{attribute}", value] += 1
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))  # most modules first
    seen = tuple(DropoutSeen(kind, p, count) for (kind, p), count in ranked)
    return DirectEvidence(dropout=seen, precision=precision)


def observe_training(trainer: Any, pl_module: torch.nn.Module) -> DirectEvidence:
    """The direct evidence of a Lightning run: the LightningModule's live dropout and ``trainer.precision``.

    Never raises: monitoring never breaks training (an unreadable precision is ``None``).
    """
    try:
        precision = str(trainer.precision)
    except Exception:  # a trainer double without the attribute, or a strategy that cannot say
        precision = None
    return observe_modules(pl_module, precision=precision)

