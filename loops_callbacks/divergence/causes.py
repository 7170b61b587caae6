"""The causes the diagnosis can name: a step's ``Diagnosis``, its message and its logged metrics.

A ``Diagnosis`` holds the cause, a confidence (0 to 1) and the numbers behind it (signature numbers,
``signatures``); its ``message`` says what the cause is, its numbers and what to check. The rules
that pick the cause are in ``diagnosis``.

Examples:
    >>> found = Diagnosis("temperature", 0.8, {"temperature": 0.71})
    >>> print(found.message)
    likely cause: a temperature is applied on one side only (slope of trainer on sampler logprobs 0.71) (temperature 0.71); check that the sampler's logprobs are at temperature 1, or divide the trainer's logits by the same temperature
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from loops_callbacks.divergence.metrics import SAMPLING_METRICS, SCALAR_METRICS

IMPOSSIBLE_INPUTS = "impossible_inputs"  # the inputs are not logprobs at all: no statistical cause is judged then
DROPOUT = "dropout"  # dropout seen live in the trainer: an observation, not a guess
SAMPLING = "sampling"  # the tokens were drawn from another distribution than the logprobs describe
PREFIX_CACHE = "prefix_cache"  # the engine says its prefix cache outlived a weight reload (``SamplerFacts``)
PRECISION_BITS = "precision_bits"  # a precision diagnosis' number, not shown: 16 (a side known 16-bit), 32 (neither)
FULL_PRECISION_GAP = "full_precision_gap"  # an unrelated diagnosis' number, not shown: 1 where both sides are at full
# precision (the gap says the two sides compute different functions: weights or inputs)
PROMPT = "prompt"  # the sampler's prompt ids (``sampler_prompt_ids``) differ from the trainer's: an observation
CAUSES = (
    IMPOSSIBLE_INPUTS, "none", DROPOUT, PROMPT, "shift", SAMPLING, PREFIX_CACHE, "unrelated", "truncation", "temperature",
    "precision", "stale", "unclear",
)
"""Every cause a step can be given, in the order they are checked (``unclear`` last)."""

_TEXTS = {  # cause (and "unclear" with a context fade or too few tokens, truncation to p = 1): (what, what to check)
    IMPOSSIBLE_INPUTS: ("the inputs are not valid logprobs", "fix the inputs first (position k must hold log p of the "
                        "token predicted at k, a number <= 0); no other cause can be judged on them"),
    "none": ("no mismatch", ""),
    DROPOUT: ("observed: the trainer's logprobs include dropout noise", "compute the trainer's logprobs without dropout "
              "(model.eval() for the scoring forward, or dropout 0 in the model's config, as TRL does for RL); the "
              "sampler never applies dropout"),
    PROMPT: ("the sampler's prompt differs from the trainer's", "render the prompt once and give both sides the "
             "same ids: check the chat template, the system prompt, BOS and special tokens (added twice, or dropped) "
             "and the tokenizer on each side; every completion is scored in another context than it was sampled in"),
    "unrelated": ("sampler and trainer score unrelated distributions", "check the chat template, BOS and special "
                  "tokens and the tokenizer on both sides, and that the sampler loaded the trainer's weights at all"),
    "truncation": ("the sampler truncates (top-k / top-p) and reports renormalized logprobs", "check that the "
                   "sampler reports logprobs of the full distribution (not of the top-k / top-p renormalized one), "
                   "or apply the same truncation in the trainer"),
    "all_zero": ("every sampler logprob is exactly 0.0: a greedy (top-1) sampler's renormalized logprobs, or "
                 "logprobs never filled in", "fill in the sampler's logprob of each drawn token, of the full "
                 "distribution (a greedy sampler's raw logprobs, not its processed ones)"),
    "temperature": ("a temperature is applied on one side only", "check that the sampler's logprobs are at "
                    "temperature 1, or divide the trainer's logits by the same temperature"),
    "stale": ("the sampler's weights are out of date", "check that the sampler receives the trainer's weights every "
              "step (sync frequency, failed or partial weight loads)"),
    FULL_PRECISION_GAP: ("sampler and trainer compute different distributions: both at full precision, whose "
                         "rounding leaves relative gaps near 1e-12, and the gap is far beyond that with no temperature, "
                         "truncation or shift fitting it, so their weights or their inputs differ", "check that the "
                         "sampler's last weight load succeeded and loaded every tensor (a load that failed while "
                         "policy_version still counted, a sampler started from another checkpoint), then the prompts "
                         "both sides score (chat template, BOS and special tokens, the tokenizer: sampler_prompt_ids "
                         "says which) and the forward's inputs (attention_mask, position_ids on left-padded prompts)"),
    "precision": ("numerical precision (the engines' dtypes, kernels or reduction order differ)", "check the "
                  "sampler's dtype and kernels; a gap at this level is usually harmless"),
    "precision_16": ("numerical precision (16-bit rounding, e.g. bf16 kernels)", "check the sampler's dtype and "
                     "kernels; a gap at this level is usually harmless"),
    "precision_32": ("numerical precision (kernels and reduction order differ between the engines)", "check the "
                     "sampler's kernels; a gap at this level is usually harmless"),
    SAMPLING: ("the tokens were not drawn from the distribution the sampler's logprobs describe", "check the "
               "sampler's logprobs mode (vLLM: logprobs_mode='processed_logprobs') or the sampling settings: the "
               "importance ratio of every correction is not the behaviour policy's"),
    PREFIX_CACHE: ("the sampler's prefix cache holds KV computed with older weights", "reset the prefix cache after "
                   "every weight update (vLLM: llm.reset_prefix_cache()) or salt it per weight version"),
    "unclear": ("unclear", "no single cause's signature fits; look at the worst tokens (the worst_tokens table in W&B "
                "or TensorBoard; with any logger, KLSampleTrainMonitor.last_worst_tokens)"),
    "too_few": ("unclear: too few action tokens on this step to judge", "a logged step is judged on its own "
                "micro-batches: a larger batch or gradient accumulation gives it more; a token whose advantage is 0 "
                "is not trained on, so a group whose rewards are all equal adds none"),
    "context_fade": ("unclear: the gap sits on each completion's first tokens and fades after them", "a difference "
                     "in the prompt both sides score (chat template, BOS and special tokens, system prompt) or a "
                     "sampler's prefix / KV cache kept across a weight update leaves this; so can an engine whose "
                     "rounding grows where the first tokens' logits are larger, so check the prompts and the cache first"),
}

_SAMPLING_FIELDS = (
    "; or, where the sampler reports what it draws, that 'training_entropy' and 'training_varentropy' are of the "
    "distribution 'training_logprobs' come from (token_logprobs(..., with_entropy=True) on the same logits, at "
    "temperature 1): entropies of other logits read the same"
)


@dataclass(frozen=True)
class Diagnosis:
    """The likely cause of one logged step, how sure the rule is (0 to 1), and the numbers behind it.

    ``problems`` says what is impossible about the inputs (cause ``impossible_inputs`` only);
    ``observed`` what was seen directly about the trainer or the engine when it is the cause;
    ``beyond`` a finding that the observed dropout cannot explain (a gap that grows over the steps
    or with the policy lag, an offset), said after the observation.
    """

    cause: str
    confidence: float
    numbers: dict[str, float] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    observed: str = ""
    beyond: Diagnosis | None = None

    @classmethod
    def impossible_inputs(cls, problems: Iterable[str]) -> Diagnosis:
        """The diagnosis of a step whose inputs are not logprobs (``guard_rail.impossible_inputs``' texts).

        Examples:
            >>> print(Diagnosis.impossible_inputs(["3 of 4 sampler logprobs are > 0"]).message)
            likely cause: the inputs are not valid logprobs: 3 of 4 sampler logprobs are > 0; fix the inputs first (position k must hold log p of the token predicted at k, a number <= 0); no other cause can be judged on them
        """
        return cls(IMPOSSIBLE_INPUTS, 1.0, problems=tuple(problems))

    @property
    def is_observation(self) -> bool:
        """Whether the cause was seen directly (impossible inputs, live dropout, the engine's own account of its
        prefix cache or sampling settings), not inferred from statistics."""
        return self.cause in (IMPOSSIBLE_INPUTS, DROPOUT) or bool(self.observed)

    @property
    def label(self) -> str:
        """The cause, with the finding beyond it: ``"dropout + stale"`` (the run summary counts these)."""
        return f"{self.cause} + {self.beyond.cause}" if self.beyond is not None else self.cause

    @property
    def message(self) -> str:
        """One sentence for logs and the guard rail: the cause, its numbers, what to check."""
        if self.cause == "none":
            return f"no mismatch ({_format(self.numbers)})"
        if self.cause == IMPOSSIBLE_INPUTS:
            what, check = _TEXTS[self.cause]
            return f"likely cause: {what}: {'; '.join(self.problems)}; {check}"
        beyond = f"; and beyond what dropout explains: {self.beyond._finding}" if self.beyond is not None else ""
        return f"likely cause: {self._finding}{beyond}"

    @property
    def _finding(self) -> str:
        """The cause, its numbers and what to check."""
        key = self.cause
        if self.cause == "unclear" and ("context_fade" in self.numbers or "n_action_tokens" in self.numbers):
            key = "context_fade" if "context_fade" in self.numbers else "too_few"
        if key == "truncation" and self.numbers.get("sampler_all_zero") == 1.0:
            key = "all_zero"
        if key == "precision" and self.numbers.get(PRECISION_BITS) in (16.0, 32.0):  # a side known 16-bit, or none
            key = f"precision_{int(self.numbers[PRECISION_BITS])}"
        if key == "unrelated" and self.numbers.get(FULL_PRECISION_GAP) == 1.0:
            key = FULL_PRECISION_GAP
        what, check = _shift_texts(self.numbers) if key == "shift" else _TEXTS[key]
        if self.cause == "temperature":
            what += f" (slope of trainer on sampler logprobs {self.numbers['temperature']:.2f})"
        if self.cause == SAMPLING and math.isfinite(self.numbers.get("sampling_z", math.nan)):
            side = "sharper" if self.numbers["sampling_z"] > 0 else "flatter"
            temperature = self.numbers.get("sampling_temperature", math.nan)
            estimate = f": effective temperature ≈ {temperature:.1f}" if 0.2 <= temperature <= 5.0 else ""
            what += f" (drawn {side}{estimate})"
        if self.observed:
            what += f": {self.observed}"
        elif self.cause == SAMPLING:  # inferred from the trainer's entropies, which no check can tell from the draws
            check += _SAMPLING_FIELDS
        numbers = f" ({_format(self.numbers)})" if self.numbers else ""
        return f"{what}{numbers}; {check}"


def diagnosis_metrics(diagnosis: Diagnosis, signatures: Mapping[str, float], *, prefix: str) -> dict[str, float]:
    """Scalars to log: ``diagnosis/<cause>`` (1.0 for the named cause and the finding beyond it, else 0), the
    confidence and the signature numbers.

    A signature number that is also a scalar metric (``is_ratio_mean``, ``kl_sample_train_k3``) is left
    out: it is logged once, under the scalar's key.

    Examples:
        >>> d = Diagnosis("stale", 0.75, {"token_eta2": 0.2})
        >>> m = diagnosis_metrics(d, {"temperature": 1.0}, prefix="div/")
        >>> m["div/diagnosis/stale"], m["div/diagnosis/none"], m["div/diagnosis/confidence"], m["div/signature/temperature"]
        (1.0, 0.0, 0.75, 1.0)
    """
    named = {diagnosis.cause, diagnosis.beyond.cause if diagnosis.beyond is not None else diagnosis.cause}
    metrics = {f"{prefix}diagnosis/{cause}": float(cause in named) for cause in CAUSES}
    metrics[f"{prefix}diagnosis/confidence"] = float(diagnosis.confidence)
    metrics.update({f"{prefix}signature/{name}": float(value) for name, value in signatures.items()
                    if name not in SCALAR_METRICS and name not in SAMPLING_METRICS})
    return metrics


def _shift_texts(numbers: Mapping[str, float]) -> tuple[str, str]:
    """What a shift is and what to check, with its size and direction."""
    if "left_aligned_ratio" in numbers:
        return (
            "completion-only sampler logprobs are left-aligned at position 0 instead of at the completion",
            "place the sampler's logprobs at the completion's positions (position k must hold the logprob of the "
            "token predicted at k; here the trainer's value at k matches the sampler's at k − the row's first "
            "action position)",
        )
    offset = int(round(numbers.get("offset", numbers.get("shift_direction", 1.0))))
    size = abs(offset)
    what = f"sampler logprobs are shifted by {'one position' if size == 1 else f'{size} positions'}"
    sign = "+" if offset > 0 else "−"
    check = (
        "check the alignment of logprobs with target tokens (position k must hold the logprob of the token "
        f"predicted at k; here the trainer's value at k matches the sampler's at k{sign}{size})"
    )
    return what, check


def _format(numbers: Mapping[str, float]) -> str:
    shown = {name: value for name, value in numbers.items() if name not in ("shift_direction", "offset", PRECISION_BITS,
                                                                             FULL_PRECISION_GAP)}
    return ", ".join(f"{name.replace('_', ' ')} {value:.3g}" for name, value in shown.items())
