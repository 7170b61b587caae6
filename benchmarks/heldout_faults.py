"""A second, independent fault generator for the divergence diagnosis: the held-out set.

The tuning set (``bench_diagnosis.py``) seeds faults into the package's own RL demo. This one
shares no code with it: a random-init Hugging Face GPT-2 built from a small config (never
downloaded), another task (continuing a Markov chain over a 96-token vocabulary), another
checkpoint, Hugging Face ``generate(do_sample=True, ...)`` as the sampler, and fault settings that
``bench_diagnosis.py`` does not use. The diagnosis' thresholds are never set on these numbers.

Two model variants: ``flat`` (trained on a chain where each token has 12 equally likely successors:
no token has p > 0.5) and ``peaked`` (one successor has p = 0.85). Then the trainer model takes one
Adam step per monitor step towards a changed chain (its weights move as a policy's do in RL); the
sampler loads the trainer's weights as the fault says (synced, k steps behind, per-datum lags).

The sampler's logprobs are taken both ways Hugging Face users take them: ``processed``
(``compute_transition_scores(normalize_logits=True)``: after temperature / top-k / top-p) and
``raw`` (log-softmax of ``output_logits``: the model's own distribution). The trainer's logprobs are
the trainer model's full forward over the sampled sequences (fp32; in train mode when the fault
leaves dropout on).

Each monitor step is a batch of ``batch`` sequences (prompt length drawn per step from 6, 8, 10,
12; 24 sampled tokens), stored as right-padded ``[B, T]`` tensors in the monitor's data contract:
``logprobs`` (sampler), ``training_logprobs``, ``mask`` (1 on the 24 completion positions),
``input_ids``, ``target_tokens`` (position k holds the logprob of ``target_tokens[k]``) and
``policy_version`` (each datum's sampler weight version: the trainer's optimizer step whose
weights sampled it), ``truth`` (the step's true cause: ``"none"`` on a stale fault's first step,
when the sampler still has the trainer's weights), plus the trainer's direct evidence
(``trainer_training``: whether its model was in train mode, ``dropout_p``, ``sampler_dtype``).

Example (tiny: two steps of one fault, a few seconds on a CPU):
    >>> steps = generate_fault_steps("peaked", FAULTS_BY_NAME["offset +2"], steps=2, batch=8, pretrain_steps=5)
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

__all__ = ["FAULTS", "FAULTS_BY_NAME", "Fault", "VARIANTS", "cached_fault_steps", "generate_fault_steps"]

VOCAB = 96
BOS = 0
COMPLETION = 24
PROMPT_LENGTHS = (6, 8, 10, 12)
SUCCESSORS = {"flat": 12, "peaked": 1}
"""Likely successors per token of the chain: 12 equally likely (flat), or one with p = 0.85 (peaked)."""
PEAK = 0.85
VARIANTS = tuple(SUCCESSORS)
GENERATOR_VERSION = 2
"""Bump when the generated numbers change: it is part of the cache key."""


@dataclass(frozen=True)
class Fault:
    """One sampler / trainer setting; ``cause`` is the true cause of its mismatch.

    ``logprobs``: ``"raw"`` or ``"processed"`` (module docstring). ``lag``: the sampler's weights are
    that many optimizer steps old; ``lags``: each datum's lag drawn from these (asynchronous RL).
    ``offset``: the sampler's values sit that many positions late (negative: early) in the row;
    ``left_aligned``: completion-only logprobs written from position 0. ``template``:
    ``"extra_bos"`` or ``"other_first_token"`` on the sampler's prompt only. ``stale_prefix``: the
    prompt's KV cache was computed under weights that many steps old. ``trainer_dropout``: the
    trainer scores in train mode (dropout 0.1); ``sampler_dropout``: so does the sampler.
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


FAULTS: tuple[Fault, ...] = (
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
"""The held-out faults: settings not in ``bench_diagnosis.py`` (see the module docstring)."""
FAULTS_BY_NAME = {fault.name: fault for fault in FAULTS}


def model_config(dropout: float = 0.1) -> Any:
    """The small GPT-2 config both sides use (GPT-2's default dropout, 0.1)."""
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=BOS, eos_token_id=BOS,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    )


def new_model() -> Any:
    """A random-init GPT-2 (``model_config``) in eval mode, generating without an end token."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(model_config()).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = BOS
    return model


def chain(variant: str, seed: int) -> torch.Tensor:
    """The task: ``[VOCAB, VOCAB]`` transition probabilities of a Markov chain (module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.zeros(VOCAB, VOCAB)
    for token in range(VOCAB):
        successors = torch.randperm(VOCAB - 1, generator=gen)[: SUCCESSORS[variant]] + 1  # never BOS
        if variant == "peaked":
            probs[token] = (1 - PEAK) / (VOCAB - 1)
            probs[token, BOS] = 0.0
            probs[token, successors] = PEAK
        else:
            probs[token, successors] = 1.0 / SUCCESSORS[variant]
    return probs / probs.sum(-1, keepdim=True)


def chain_sequences(probs: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """``[batch, length]`` sequences of the chain, each starting with BOS."""
    rows = [torch.full((batch,), BOS, dtype=torch.long)]
    rows.append(torch.randint(1, VOCAB, (batch,), generator=gen))
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
        x = chain_sequences(probs, 32, 36, gen)
        loss = model(x, labels=x).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    model.eval()
    return history


def trainer_trajectory(variant: str, steps: int, pretrain_steps: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """The checkpoint (``pretrain_steps`` on the chain), then the trainer's weights at each of
    ``steps`` monitor steps, one Adam step apart, towards a changed chain."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = new_model()
    checkpoint = train(model.train(), chain(variant, seed), pretrain_steps, gen, lr=3e-3)
    start = checkpoint[-1] if checkpoint else {k: v.clone() for k, v in model.state_dict().items()}
    moved = train(model.train(), chain(variant, seed + 1), steps, gen, lr=1e-3)
    return [start, *moved]  # the weights before monitor step i are entry i


def generate_fault_steps(
    variant: str, fault: Fault, *, steps: int, batch: int, pretrain_steps: int = 300, seed: int = 0,
    trajectory: list[dict[str, torch.Tensor]] | None = None,
) -> list[dict[str, Any]]:
    """The ``steps`` monitor steps of ``fault`` on ``variant`` (module docstring for the keys)."""
    if variant not in SUCCESSORS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if steps < 1 or batch < 1:
        raise ValueError(f"steps and batch must be >= 1, got steps={steps}, batch={batch}")
    weights = trajectory if trajectory is not None else trainer_trajectory(variant, steps, pretrain_steps, seed)
    if len(weights) < steps:
        raise ValueError(f"the trajectory has {len(weights)} checkpoints, fewer than steps = {steps}")
    trainer_model, sampler_model, old_model = new_model(), new_model(), new_model()
    gen = torch.Generator().manual_seed(seed + zlib.crc32(fault.name.encode()))
    out = []
    for step in range(steps):
        prompt_length = PROMPT_LENGTHS[int(torch.randint(len(PROMPT_LENGTHS), (1,), generator=gen))]
        prompts = chain_sequences(chain(variant, seed), batch, prompt_length, gen)
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
            seq, logprobs = _sample(sampler_model, prompts[rows], fault, old)
            sequences.append((rows, seq))
            sampler_rows.append((rows, logprobs))
        sequence = torch.empty(batch, prompt_length + COMPLETION, dtype=torch.long)
        completion_logprobs = torch.empty(batch, COMPLETION)
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
                "dropout_p": 0.1,
                "sampler_dtype": fault.sampler_dtype,
            }
        )
    return out


def cached_fault_steps(
    variant: str, *, steps: int, batch: int, cache_dir: str | os.PathLike[str] | None = None,
    pretrain_steps: int = 300, seed: int = 0, faults: tuple[Fault, ...] = FAULTS,
) -> dict[str, list[dict[str, Any]]]:
    """Every fault's steps on ``variant``, by fault name, read from (or written to) one ``.pt`` file
    in ``cache_dir`` (default: a folder in the system's temp dir) keyed by every setting."""
    key = json.dumps(
        [GENERATOR_VERSION, variant, steps, batch, pretrain_steps, seed, [dataclasses.astuple(f) for f in faults],
         torch.__version__],
        sort_keys=True,
    )
    folder = Path(cache_dir) if cache_dir is not None else Path(tempfile.gettempdir()) / "loops_callbacks_heldout"
    path = folder / f"heldout-{variant}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"
    if path.exists():
        return torch.load(path, weights_only=False)
    trajectory = trainer_trajectory(variant, steps, pretrain_steps, seed)
    data = {
        fault.name: generate_fault_steps(variant, fault, steps=steps, batch=batch, seed=seed, trajectory=trajectory)
        for fault in faults
    }
    folder.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    torch.save(data, partial)
    partial.replace(path)
    return data


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


@torch.no_grad()
def _sample(model: Any, prompts: torch.Tensor, fault: Fault, old: Any | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face ``generate`` with the fault's sampler: the sequences and the sampled tokens' logprobs."""
    sampler = model
    if fault.sampler_dtype != "float32":
        sampler = copy.deepcopy(model).to(getattr(torch, fault.sampler_dtype))
    sampler.train(fault.sampler_dropout)
    prompt = prompts
    if fault.template == "extra_bos":
        prompt = torch.cat([torch.full_like(prompts[:, :1], BOS), prompts], 1)
    elif fault.template == "other_first_token":
        prompt = prompts.clone()
        prompt[:, 0] = VOCAB - 1
    options: dict[str, Any] = {}
    if old is not None:  # the prompt's KV cache from old weights; generate runs only the last prompt token
        from transformers import DynamicCache

        cache = DynamicCache()
        name = _cache_argument(old)
        old.to(sampler.dtype)(prompt[:, :-1], use_cache=True, **{name: cache})
        old.float()
        options[name] = cache
    out = sampler.generate(
        input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True, max_new_tokens=COMPLETION,
        temperature=fault.temperature, top_k=fault.top_k, top_p=fault.top_p, output_scores=True, output_logits=True,
        return_dict_in_generate=True, **options,
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
