"""A second, independent fault generator for the divergence diagnosis: the held-out sets.

The tuning set (``bench_diagnosis.py``) seeds faults into the package's own RL demo. This one
shares no code with it: a random-init Hugging Face GPT-2 built from a small config (never
downloaded), another task (continuing a Markov chain), another checkpoint, Hugging Face
``generate(do_sample=True, ...)`` as the sampler, and fault settings that ``bench_diagnosis.py``
does not use. A ``HeldoutSet`` (``SETS``) holds everything a set varies: its seed, the chain's
vocabulary and successors, the prompt and completion lengths, the GPT-2's size, the trainer's
learning rate and the faults. Set 1 (``"original"``) has been looked at while the diagnosis'
rules were designed; set 2 (``"fresh"``), which differs in every one of these, was held out for
one rule change and looked at after it; set 3 (``"third"``), different again, nobody tunes on.

Two model variants per set: ``flat`` (trained on a chain where each token has
``flat_successors`` equally likely successors: no token has p > 0.5) and ``peaked`` (one successor
has p = ``peak``). Then the trainer model takes one Adam step per monitor step towards a changed
chain (its weights move as a policy's do in RL); the sampler loads the trainer's weights as the
fault says (synced, k steps behind, per-datum lags).

The sampler's logprobs are taken both ways Hugging Face users take them: ``processed``
(``compute_transition_scores(normalize_logits=True)``: after temperature / top-k / top-p) and
``raw`` (log-softmax of ``output_logits``: the model's own distribution). The trainer's logprobs are
the trainer model's full forward over the sampled sequences (fp32; in train mode when the fault
leaves dropout on).

Each monitor step is a batch of ``batch`` sequences (prompt length drawn per step from the set's
``prompt_lengths``; ``completion`` sampled tokens), stored as right-padded ``[B, T]`` tensors in
the monitor's data contract: ``logprobs`` (sampler), ``training_logprobs``, ``mask`` (1 on the
completion positions), ``input_ids``, ``target_tokens`` (position k holds the logprob of
``target_tokens[k]``) and ``policy_version`` (each datum's sampler weight version: the trainer's
optimizer step whose weights sampled it), ``truth`` (the step's true cause: ``"none"`` on a stale
fault's first step, when the sampler still has the trainer's weights), plus the trainer's direct
evidence (``trainer_training``: whether its model was in train mode, ``dropout_p``,
``sampler_dtype``).

Example (tiny: two steps of one fault of set 1, a few seconds on a CPU):
    >>> original, fault = SETS[1], SETS[1].fault("offset +2")
    >>> steps = generate_fault_steps(original, "peaked", fault, steps=2, batch=8, pretrain_steps=5)
    >>> len(steps), steps[0]["logprobs"].shape == steps[0]["training_logprobs"].shape, steps[0]["mask"].sum().item()
    (2, True, 192.0)
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import inspect
import json
import os
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "FAULTS", "FAULTS_BY_NAME", "SETS", "VARIANTS", "Fault", "HeldoutSet", "cache_key", "cached_fault_steps",
    "generate_fault_steps", "new_model", "trainer_trajectory",
]

BOS = 0
N_POSITIONS = 64
"""GPT-2's context: the longest sequence is a training sequence (``TRAIN_LENGTH``) or a prompt plus its completion."""
TRAIN_LENGTH = 36
PRETRAIN_LR = 3e-3
"""Adam's learning rate while training the checkpoint (every set)."""
VARIANTS = ("flat", "peaked")
GENERATOR_VERSION = 2
"""Bump when the generated numbers change: it is part of the cache key."""


@dataclass(frozen=True)
class Fault:
    """One sampler / trainer setting; ``cause`` is the true cause of its mismatch.

    ``logprobs``: ``"raw"`` or ``"processed"`` (module docstring). ``lag``: the sampler's weights are
    that many optimizer steps old; ``lags``: each datum's lag drawn from these (asynchronous RL).
    ``offset``: the sampler's values sit that many positions late (negative: early) in the row;
    ``left_aligned``: completion-only logprobs written from position 0. ``template``, on the
    sampler's prompt only: ``"extra_bos"`` (a second BOS first), ``"other_first_token"`` (BOS
    replaced by ``template_token``) or ``"inserted_token"`` (``template_token`` inserted right after
    BOS, like a system-prompt marker); ``template_token`` ``None`` is the set's last token.
    ``stale_prefix``: the prompt's KV cache was computed under weights that many steps old.
    ``trainer_dropout``: the trainer scores in train mode; ``sampler_dropout``: so does the
    sampler; ``dropout``: the p of both models' configs (GPT-2's default 0.1).
    """

    name: str
    cause: str
    logprobs: str = "raw"
    sampler_dtype: str = "float32"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    lag: int = 0
    lags: tuple[int, ...] = ()
    offset: int = 0
    left_aligned: bool = False
    template: str = ""
    stale_prefix: int = 0
    trainer_dropout: bool = False
    sampler_dropout: bool = False
    dropout: float = 0.1
    template_token: int | None = None


ORIGINAL_FAULT_FIELDS = (
    "name", "cause", "logprobs", "sampler_dtype", "temperature", "top_k", "top_p", "lag", "lags", "offset",
    "left_aligned", "template", "stale_prefix", "trainer_dropout", "sampler_dropout",
)
"""The fields ``Fault`` had when set 1 was first cached: its cache key is made of these alone
(``cache_key``), so later fields, at their defaults on every set-1 fault, leave its files valid."""
TEMPLATES = ("", "extra_bos", "other_first_token", "inserted_token")


@dataclass(frozen=True)
class HeldoutSet:
    """Everything one held-out set varies (module docstring).

    ``flat_successors``: equally likely successors per token of the ``flat`` chain; ``peak``: the
    probability of the one likely successor of the ``peaked`` chain. ``n_layer``, ``n_embd``,
    ``n_head``: the GPT-2's size. ``lr``: the trainer's Adam learning rate while it moves during
    the monitor steps. ``monitor_steps``: the monitor steps per fault a benchmark runs by default.
    """

    name: str
    seed: int
    vocab: int
    completion: int
    prompt_lengths: tuple[int, ...]
    flat_successors: int
    peak: float
    n_layer: int
    n_embd: int
    n_head: int
    lr: float
    monitor_steps: int
    faults: tuple[Fault, ...]

    def __post_init__(self) -> None:
        longest = 1 + max(self.prompt_lengths) + self.completion  # with a template's extra token
        if min(self.prompt_lengths) < 2 or longest > N_POSITIONS:
            raise ValueError(
                f"set {self.name!r}: prompt lengths {self.prompt_lengths} must be >= 2 (BOS and a token) and a "
                f"prompt plus {self.completion} completion tokens and a template token must fit {N_POSITIONS} positions"
            )
        if not 1 <= self.flat_successors < self.vocab or self.n_embd % self.n_head:
            raise ValueError(
                f"set {self.name!r}: flat_successors {self.flat_successors} must be in [1, vocab {self.vocab}) "
                f"and n_embd {self.n_embd} divisible by n_head {self.n_head}"
            )
        names = [fault.name for fault in self.faults]
        if len(set(names)) != len(names):
            raise ValueError(f"set {self.name!r}: fault names repeat: {names}")
        for fault in self.faults:
            token = fault.template_token
            if fault.template not in TEMPLATES or (token is not None and not 0 <= token < self.vocab):
                raise ValueError(
                    f"set {self.name!r}: fault {fault.name!r}: template {fault.template!r} must be one of {TEMPLATES} "
                    f"and template_token {token} in [0, vocab {self.vocab})"
                )

    def successors(self, variant: str) -> int:
        """Likely successors per token of ``variant``'s chain."""
        return self.flat_successors if variant == "flat" else 1

    def fault(self, name: str) -> Fault:
        """The fault named ``name``."""
        for fault in self.faults:
            if fault.name == name:
                return fault
        raise ValueError(f"set {self.name!r} has no fault {name!r}; its faults: {[f.name for f in self.faults]}")

    def summary(self) -> str:
        """The set in words, e.g. for a table's heading."""
        return (
            f"Hugging Face GPT-2 ({self.n_layer} layers x {self.n_embd}, {self.n_head} heads), a Markov chain over "
            f"{self.vocab} tokens, flat ({self.flat_successors} successors) and peaked (p = {self.peak}), seed "
            f"{self.seed}, trainer lr {self.lr:g}, prompts of {', '.join(map(str, self.prompt_lengths))} tokens, "
            f"{self.completion} sampled"
        )

    def generation_settings(self) -> dict[str, Any]:
        """The settings that shape the generated numbers, besides the seed and the faults."""
        skip = {"name", "seed", "monitor_steps", "faults"}
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}


ORIGINAL_FAULTS: tuple[Fault, ...] = (
    Fault("fp32 generate, raw", "none"),
    Fault("fp32 generate, T 0.7, raw", "none", temperature=0.7),
    Fault("bf16 sampler, raw", "precision", sampler_dtype="bfloat16"),
    Fault("bf16 sampler, processed", "precision", sampler_dtype="bfloat16", logprobs="processed"),
    Fault("temperature 0.7, processed", "temperature", temperature=0.7, logprobs="processed"),
    Fault("temperature 1.3, processed", "temperature", temperature=1.3, logprobs="processed"),
    Fault("bf16 + temperature 1.3", "temperature", temperature=1.3, logprobs="processed", sampler_dtype="bfloat16"),
    Fault("top-k 8, processed", "truncation", top_k=8, logprobs="processed"),
    Fault("top-p 0.8, processed", "truncation", top_p=0.8, logprobs="processed"),
    Fault("offset +1", "shift", offset=1),
    Fault("offset -1", "shift", offset=-1),
    Fault("offset +2", "shift", offset=2),
    Fault("offset -2", "shift", offset=-2),
    Fault("offset +3", "shift", offset=3),
    Fault("offset -3", "shift", offset=-3),
    Fault("completion-only, left-aligned", "shift", left_aligned=True),
    Fault("bf16 + offset +2", "shift", offset=2, sampler_dtype="bfloat16"),
    Fault("template: extra BOS", "template", template="extra_bos"),
    Fault("template: another first token", "template", template="other_first_token"),
    Fault("stale: 2 steps behind", "stale", lag=2),
    Fault("stale: 6 steps behind", "stale", lag=6),
    Fault("stale: per-datum lags 0-4", "stale", lags=(0, 1, 2, 3, 4)),
    Fault("stale prefix KV cache (4 steps)", "stale", stale_prefix=4),
    Fault("dropout 0.1 in the trainer", "dropout", trainer_dropout=True),
    Fault(
        "dropout in both, bf16 sampler", "dropout", trainer_dropout=True, sampler_dropout=True, sampler_dtype="bfloat16"
    ),
)
"""Set 1's faults: settings not in ``bench_diagnosis.py`` (see the module docstring)."""

FRESH_VOCAB = 128
FRESH_FAULTS: tuple[Fault, ...] = (
    Fault("fp32 generate, raw", "none"),
    Fault("fp32 generate, T 1.2, raw", "none", temperature=1.2),  # raw logprobs ignore the temperature
    Fault("bf16 sampler, processed", "precision", sampler_dtype="bfloat16", logprobs="processed"),
    Fault("bf16 sampler, T 0.9, raw", "precision", sampler_dtype="bfloat16", temperature=0.9),
    Fault("temperature 0.8, processed", "temperature", temperature=0.8, logprobs="processed"),
    Fault("temperature 1.2, processed", "temperature", temperature=1.2, logprobs="processed"),
    Fault("bf16 + temperature 0.8", "temperature", temperature=0.8, logprobs="processed", sampler_dtype="bfloat16"),
    Fault("top-k 5, processed", "truncation", top_k=5, logprobs="processed"),
    Fault("top-p 0.9, processed", "truncation", top_p=0.9, logprobs="processed"),
    Fault("bf16 + top-p 0.95", "truncation", top_p=0.95, logprobs="processed", sampler_dtype="bfloat16"),
    Fault("bf16 + offset +1", "shift", offset=1, sampler_dtype="bfloat16"),
    Fault("offset -1", "shift", offset=-1),
    Fault("offset +4", "shift", offset=4),
    Fault("offset -4", "shift", offset=-4),
    Fault("offset +5", "shift", offset=5),
    Fault("bf16 + completion-only, left-aligned", "shift", left_aligned=True, sampler_dtype="bfloat16"),
    Fault("template: extra BOS", "template", template="extra_bos"),
    Fault("template: another first token", "template", template="other_first_token", template_token=FRESH_VOCAB // 2),
    Fault("template: a token inserted after BOS", "template", template="inserted_token"),
    Fault("stale: 3 steps behind", "stale", lag=3),
    Fault("stale: 10 steps behind", "stale", lag=10),  # clipped at the checkpoint on the first 10 steps
    Fault("stale: per-datum lags 0-6", "stale", lags=(0, 1, 2, 3, 4, 5, 6)),
    Fault("stale: lags 1-2, every datum", "stale", lags=(1, 2)),
    Fault("stale prefix KV cache (2 steps)", "stale", stale_prefix=2),
    Fault("dropout 0.1 in the trainer, bf16 sampler", "dropout", trainer_dropout=True, sampler_dtype="bfloat16"),
    Fault("dropout 0.05 in the trainer", "dropout", trainer_dropout=True, dropout=0.05),
)
"""Set 2's faults: settings in neither set 1 nor ``bench_diagnosis.py`` (its healthy engines aside)."""

THIRD_VOCAB = 80
THIRD_FAULTS: tuple[Fault, ...] = (
    Fault("fp32 generate, raw", "none"),
    Fault("fp32 generate, T 0.75, raw", "none", temperature=0.75),  # raw logprobs ignore the temperature
    Fault("bf16 sampler, raw", "precision", sampler_dtype="bfloat16"),
    Fault("bf16 sampler, top-p 0.97, raw", "precision", sampler_dtype="bfloat16", top_p=0.97),
    Fault("temperature 0.75, processed", "temperature", temperature=0.75, logprobs="processed"),
    Fault("temperature 1.4, processed", "temperature", temperature=1.4, logprobs="processed"),
    Fault("bf16 + temperature 1.15", "temperature", temperature=1.15, logprobs="processed", sampler_dtype="bfloat16"),
    Fault("top-k 10, processed", "truncation", top_k=10, logprobs="processed"),
    Fault("top-p 0.85, processed", "truncation", top_p=0.85, logprobs="processed"),
    Fault("bf16 + top-k 20", "truncation", top_k=20, logprobs="processed", sampler_dtype="bfloat16"),
    Fault("bf16 + offset +2", "shift", offset=2, sampler_dtype="bfloat16"),
    Fault("offset -3", "shift", offset=-3),
    Fault("offset +6", "shift", offset=6),
    Fault("offset -5", "shift", offset=-5),
    Fault("completion-only, left-aligned", "shift", left_aligned=True),
    Fault("template: extra BOS", "template", template="extra_bos"),
    Fault("template: another first token", "template", template="other_first_token", template_token=7),
    Fault("template: a token inserted after BOS", "template", template="inserted_token", template_token=3),
    Fault("stale: 4 steps behind", "stale", lag=4),
    Fault("stale: 8 steps behind", "stale", lag=8),
    Fault("stale: per-datum lags 0-3", "stale", lags=(0, 1, 2, 3)),
    Fault("stale: lags 2-3, every datum", "stale", lags=(2, 3)),
    Fault("stale prefix KV cache (3 steps)", "stale", stale_prefix=3),
    Fault("dropout 0.1 in the trainer", "dropout", trainer_dropout=True),
    Fault("dropout 0.2 in the trainer, bf16 sampler", "dropout", trainer_dropout=True, dropout=0.2,
          sampler_dtype="bfloat16"),
    Fault("dropout 0.1 in both", "dropout", trainer_dropout=True, sampler_dropout=True),
)
"""Set 3's faults, made after sets 1 and 2 had been looked at: mostly other sizes of the same kinds
of fault (five settings of set 1 come back, on another model, chain and seed)."""


SETS: dict[int, HeldoutSet] = {
    1: HeldoutSet(
        name="original", seed=0, vocab=96, completion=24, prompt_lengths=(6, 8, 10, 12), flat_successors=12,
        peak=0.85, n_layer=2, n_embd=64, n_head=4, lr=1e-3, monitor_steps=12, faults=ORIGINAL_FAULTS,
    ),
    2: HeldoutSet(
        name="fresh", seed=7, vocab=FRESH_VOCAB, completion=32, prompt_lengths=(5, 7, 9, 11, 13), flat_successors=8,
        peak=0.9, n_layer=3, n_embd=96, n_head=4, lr=2e-3, monitor_steps=16, faults=FRESH_FAULTS,
    ),
    3: HeldoutSet(
        name="third", seed=23, vocab=THIRD_VOCAB, completion=40, prompt_lengths=(4, 6, 8), flat_successors=16,
        peak=0.8, n_layer=4, n_embd=48, n_head=4, lr=1.5e-3, monitor_steps=14, faults=THIRD_FAULTS,
    ),
}
"""The held-out sets by number: 1 was looked at while the rules were designed, 2 was held out for
one rule change and then looked at (its failures shaped the next), 3 never was."""
FAULTS = SETS[1].faults
FAULTS_BY_NAME = {fault.name: fault for fault in FAULTS}
"""Set 1's faults by name."""


def model_config(heldout_set: HeldoutSet, dropout: float = 0.1) -> Any:
    """The set's small GPT-2 config both sides use (GPT-2's default dropout, 0.1)."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=heldout_set.vocab, n_positions=N_POSITIONS, n_embd=heldout_set.n_embd,
        n_layer=heldout_set.n_layer, n_head=heldout_set.n_head, bos_token_id=BOS, eos_token_id=BOS,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )


def new_model(heldout_set: HeldoutSet, dropout: float = 0.1) -> Any:
    """A random-init GPT-2 (``model_config``) in eval mode, generating without an end token."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(model_config(heldout_set, dropout)).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = BOS
    return model


def chain(heldout_set: HeldoutSet, variant: str, seed: int) -> torch.Tensor:
    """The task: ``[vocab, vocab]`` transition probabilities of a Markov chain (module docstring)."""
    vocab, successors = heldout_set.vocab, heldout_set.successors(variant)
    gen = torch.Generator().manual_seed(seed)
    probs = torch.zeros(vocab, vocab)
    for token in range(vocab):
        likely = torch.randperm(vocab - 1, generator=gen)[:successors] + 1  # never BOS
        if variant == "peaked":
            probs[token] = (1 - heldout_set.peak) / (vocab - 1)
            probs[token, BOS] = 0.0
            probs[token, likely] = heldout_set.peak
        else:
            probs[token, likely] = 1.0 / successors
    return probs / probs.sum(-1, keepdim=True)


def chain_sequences(probs: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch, length]`` sequences of the chain, each starting with BOS."""
    rows = [torch.full((batch,), BOS, dtype=torch.long)]
    rows.append(torch.randint(1, probs.shape[0], (batch,), generator=gen))
    for _ in range(length - 2):
        rows.append(torch.multinomial(probs[rows[-1]], 1, generator=gen)[:, 0])
    return torch.stack(rows, 1)


def train(
    model: Any, probs: torch.Tensor, steps: int, gen: torch.Generator, lr: float
) -> list[dict[str, torch.Tensor]]:
    """``steps`` Adam steps of next-token loss on the chain (``model`` in train mode, so with GPT-2's
    dropout, as a user trains it); the weights after each step, and ``model`` left in eval mode."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    history = []
    for _ in range(steps):
        x = chain_sequences(probs, 32, TRAIN_LENGTH, gen)
        loss = model(x, labels=x).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    model.eval()
    return history


def trainer_trajectory(
    heldout_set: HeldoutSet, variant: str, steps: int, pretrain_steps: int
) -> list[dict[str, torch.Tensor]]:
    """The checkpoint (``pretrain_steps`` on the chain), then the trainer's weights at each of
    ``steps`` monitor steps, one Adam step (``heldout_set.lr``) apart, towards a changed chain."""
    seed = heldout_set.seed
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = new_model(heldout_set)
    checkpoint = train(model.train(), chain(heldout_set, variant, seed), pretrain_steps, gen, lr=PRETRAIN_LR)
    start = checkpoint[-1] if checkpoint else {k: v.clone() for k, v in model.state_dict().items()}
    moved = train(model.train(), chain(heldout_set, variant, seed + 1), steps, gen, lr=heldout_set.lr)
    return [start, *moved]  # the weights before monitor step i are entry i


def generate_fault_steps(
    heldout_set: HeldoutSet, variant: str, fault: Fault, *, steps: int, batch: int, pretrain_steps: int = 300,
    trajectory: list[dict[str, torch.Tensor]] | None = None,
) -> list[dict[str, Any]]:
    """The ``steps`` monitor steps of ``fault`` on ``variant`` of ``heldout_set`` (module docstring for the keys)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if steps < 1 or batch < 1:
        raise ValueError(f"steps and batch must be >= 1, got steps={steps}, batch={batch}")
    weights = trajectory if trajectory is not None else trainer_trajectory(heldout_set, variant, steps, pretrain_steps)
    if len(weights) < steps:
        raise ValueError(f"the trajectory has {len(weights)} checkpoints, fewer than steps = {steps}")
    trainer_model, sampler_model, old_model = (new_model(heldout_set, fault.dropout) for _ in range(3))
    gen = torch.Generator().manual_seed(heldout_set.seed + zlib.crc32(fault.name.encode()))
    lengths, completion = heldout_set.prompt_lengths, heldout_set.completion
    out = []
    for step in range(steps):
        prompt_length = lengths[int(torch.randint(len(lengths), (1,), generator=gen))]
        prompts = chain_sequences(chain(heldout_set, variant, heldout_set.seed), batch, prompt_length, gen)
        lags = _lags(fault, batch, gen)
        torch.manual_seed(int(torch.randint(2**31 - 1, (1,), generator=gen)))
        sequences, sampler_rows = [], []
        for lag in sorted(set(lags.tolist())):
            rows = (lags == lag).nonzero()[:, 0]
            sampler_model.load_state_dict(weights[max(step - lag, 0)])
            old = None
            if fault.stale_prefix:
                old_model.load_state_dict(weights[max(step - fault.stale_prefix, 0)])
                old = old_model
            seq, logprobs = _sample(heldout_set, sampler_model, prompts[rows], fault, old)
            sequences.append((rows, seq))
            sampler_rows.append((rows, logprobs))
        sequence = torch.empty(batch, prompt_length + completion, dtype=torch.long)
        completion_logprobs = torch.empty(batch, completion)
        for (rows, seq), (_, logprobs) in zip(sequences, sampler_rows):
            sequence[rows] = seq
            completion_logprobs[rows] = logprobs
        trainer_model.load_state_dict(weights[step])
        trainer_model.train(fault.trainer_dropout)
        with torch.no_grad():
            logits = trainer_model(sequence[:, :-1]).logits.float()
        trainer_model.eval()
        targets = sequence[:, 1:]
        training = logits.log_softmax(-1).gather(-1, targets[..., None])[..., 0]
        width = targets.shape[1]
        first = prompt_length - 1  # the position that predicts the first sampled token
        mask = torch.zeros(batch, width)
        mask[:, first:] = 1.0
        sampler = torch.zeros(batch, width)
        sampler[:, first:] = completion_logprobs
        sampler = _misalign(sampler, fault, first)
        out.append(
            {
                "logprobs": sampler,
                "training_logprobs": training,
                "mask": mask,
                "input_ids": sequence[:, :-1],
                "target_tokens": targets,
                "policy_version": (step - lags).clamp(min=0),
                "truth": _truth(fault, step, lags),
                "trainer_training": fault.trainer_dropout,
                "dropout_p": fault.dropout,
                "sampler_dtype": fault.sampler_dtype,
            }
        )
    return out


def cache_key(
    heldout_set: HeldoutSet, variant: str, *, steps: int, batch: int, pretrain_steps: int,
    faults: tuple[Fault, ...] | None = None,
) -> str:
    """The text ``cached_fault_steps`` hashes: every setting of the steps. Set 1's is the original
    generator's (its files stay valid); a set's settings that differ from set 1's, and a fault's
    fields added since (``ORIGINAL_FAULT_FIELDS``) off their defaults, are appended."""
    faults = heldout_set.faults if faults is None else faults
    parts: list[Any] = [
        GENERATOR_VERSION, variant, steps, batch, pretrain_steps, heldout_set.seed, [_fault_key(f) for f in faults],
        torch.__version__,
    ]
    original = SETS[1].generation_settings()
    changed = {k: v for k, v in heldout_set.generation_settings().items() if v != original[k]}
    if changed:
        parts.append(changed)
    return json.dumps(parts, sort_keys=True)


def cached_fault_steps(
    heldout_set: HeldoutSet, variant: str, *, steps: int, batch: int,
    cache_dir: str | os.PathLike[str] | None = None, pretrain_steps: int = 300, faults: tuple[Fault, ...] | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Every fault's steps (default: the set's faults) on ``variant``, by fault name, read from (or
    written to) one ``.pt`` file in ``cache_dir`` (default: a folder in the system's temp dir) keyed
    by every setting (``cache_key``)."""
    faults = heldout_set.faults if faults is None else faults
    key = cache_key(heldout_set, variant, steps=steps, batch=batch, pretrain_steps=pretrain_steps, faults=faults)
    folder = Path(cache_dir) if cache_dir is not None else Path(tempfile.gettempdir()) / "loops_callbacks_heldout"
    path = folder / f"heldout-{variant}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"
    if path.exists():
        return torch.load(path, weights_only=False)
    trajectory = trainer_trajectory(heldout_set, variant, steps, pretrain_steps)
    data = {
        fault.name: generate_fault_steps(heldout_set, variant, fault, steps=steps, batch=batch, trajectory=trajectory)
        for fault in faults
    }
    folder.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    torch.save(data, partial)
    partial.replace(path)
    return data


def _fault_key(fault: Fault) -> list[Any]:
    """``fault``'s part of the cache key: its original fields, then any later one off its default."""
    values: list[Any] = [getattr(fault, name) for name in ORIGINAL_FAULT_FIELDS]
    later = {
        f.name: getattr(fault, f.name) for f in dataclasses.fields(Fault)
        if f.name not in ORIGINAL_FAULT_FIELDS and getattr(fault, f.name) != f.default
    }
    return [*values, later] if later else values


def _truth(fault: Fault, step: int, lags: torch.Tensor) -> str:
    """The step's true cause: ``"none"`` for a stale fault whose sampler still had the trainer's
    weights (its lag is clipped at the first checkpoint), else the fault's cause."""
    behind = max(int(lags.max()), fault.stale_prefix)
    if fault.cause == "stale" and min(step, behind) == 0:
        return "none"
    return fault.cause


def _lags(fault: Fault, batch: int, gen: torch.Generator) -> torch.Tensor:
    if fault.lags:
        choices = torch.tensor(fault.lags)
        return choices[torch.randint(len(choices), (batch,), generator=gen)]
    return torch.full((batch,), fault.lag, dtype=torch.long)


def sampler_prompt(heldout_set: HeldoutSet, prompts: torch.Tensor, fault: Fault) -> torch.Tensor:
    """The prompts as the fault's template leaves them on the sampler's side (``Fault``); the
    trainer scores ``prompts`` as they are."""
    token = heldout_set.vocab - 1 if fault.template_token is None else fault.template_token
    if fault.template == "extra_bos":
        return torch.cat([torch.full_like(prompts[:, :1], BOS), prompts], 1)
    if fault.template == "other_first_token":
        prompt = prompts.clone()
        prompt[:, 0] = token
        return prompt
    if fault.template == "inserted_token":
        return torch.cat([prompts[:, :1], torch.full_like(prompts[:, :1], token), prompts[:, 1:]], 1)
    return prompts


@torch.no_grad()
def _sample(
    heldout_set: HeldoutSet, model: Any, prompts: torch.Tensor, fault: Fault, old: Any | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face ``generate`` with the fault's sampler: the sequences and the sampled tokens' logprobs."""
    sampler = model
    if fault.sampler_dtype != "float32":
        sampler = copy.deepcopy(model).to(getattr(torch, fault.sampler_dtype))
    sampler.train(fault.sampler_dropout)
    prompt = sampler_prompt(heldout_set, prompts, fault)
    options: dict[str, Any] = {}
    if old is not None:  # the prompt's KV cache from old weights; generate runs only the last prompt token
        from transformers import DynamicCache

        cache = DynamicCache()
        name = _cache_argument(old)
        old.to(sampler.dtype)(prompt[:, :-1], use_cache=True, **{name: cache})
        old.float()
        options[name] = cache
    out = sampler.generate(
        input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
        max_new_tokens=heldout_set.completion, temperature=fault.temperature, top_k=fault.top_k, top_p=fault.top_p,
        output_scores=True, output_logits=True, return_dict_in_generate=True, **options,
    )
    sampler.eval()
    completion = out.sequences[:, prompt.shape[1] :]
    if fault.logprobs == "processed":
        logprobs = sampler.compute_transition_scores(out.sequences, out.scores, normalize_logits=True).float()
    else:
        logprobs = torch.stack(out.logits, 1).float().log_softmax(-1).gather(-1, completion[..., None])[..., 0]
    return torch.cat([prompts, completion], 1), logprobs


def _cache_argument(model: Any) -> str:
    """The keyword that passes a KV cache: ``cache`` in recent transformers, ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _misalign(sampler: torch.Tensor, fault: Fault, first: int) -> torch.Tensor:
    """The sampler row as the fault's alignment bug leaves it (vacated places hold 0.0, as in a zero-padded tensor)."""
    if fault.left_aligned:
        moved = torch.zeros_like(sampler)
        completion = sampler.shape[1] - first
        moved[:, :completion] = sampler[:, first:]
        return moved
    if fault.offset == 0:
        return sampler
    moved = torch.zeros_like(sampler)
    o = fault.offset
    if o > 0:  # values sit o positions late: position k holds the value of k - o
        moved[:, o:] = sampler[:, :-o]
    else:
        moved[:, :o] = sampler[:, -o:]
    return moved
