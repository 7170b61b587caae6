"""Detection power of the check of what was sampled on a real LLM: how many action tokens a step needs.

SmolLM2-135M-Instruct (``real_model.build``, float32) answers the chat prompts of ``real_model`` (the tuning and
held-out questions, left-padded) with Hugging Face ``generate(do_sample=True, top_k=0)`` at each setting, up to
``--max-new-tokens`` tokens, each completion's mask cut after its first ``<|im_end|>`` (kept). The sampler reports
raw logprobs (the model's own at temperature 1), so they equal the trainer's and only the check of what was
sampled can see a setting other than temperature 1: ``token_logprobs(..., with_entropy=True)`` of the same float32
model's temperature-1 logits gives each position's logprob, entropy and varentropy, and the monitor's own
statistics (``flatten_padded``, ``DivergenceStats``, ``metrics.sampling_metrics``) give ``sampling_z`` and
``sampling_z_trimmed``; a cell reads ``held_sampling_z`` (the one the diagnosis and the guard rail judge: the
smaller of the two in size when they agree in sign).

The trainer's numbers are read from the logits ``generate`` returns (``output_logits``: the unprocessed,
temperature-1 logits of the same weights, the ones each token was drawn after); the first batch is also scored
by a trainer's own forward over prompt and completion (attention mask and position ids as ``RealGRPO``'s), and
the largest difference is printed.

Completions are generated once per setting (until ``--draws`` x the largest step's tokens are pooled), shuffled,
and dealt into ``--draws`` disjoint groups; a step of N tokens is the first N action tokens of a group (its last
completion cut), so the draws of a column are independent. Each cell: the median |z| over the draws and how many
reach ``SAMPLING_Z`` (5), the threshold from which the diagnosis names ``sampling``::

    OMP_NUM_THREADS=2 python benchmarks/real_model_power.py --cache-dir /tmp/rm_cache
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import cpu_name  # noqa: E402
from real_model import HELD_OUT_QUESTIONS, QUESTIONS, build, chat_prompts, default_cache_dir, left_padded  # noqa: E402

from loops_callbacks import token_logprobs  # noqa: E402
from loops_callbacks.divergence.diagnosis import SAMPLING_Z  # noqa: E402
from loops_callbacks.divergence.batch import flatten_padded  # noqa: E402
from loops_callbacks.divergence.statistics import held_sampling_z, sampling_metrics  # noqa: E402
from loops_callbacks.divergence.statistics import DivergenceStats  # noqa: E402

SETTINGS: dict[str, tuple[str, dict[str, float]]] = {
    # name: (row label, generate's options besides do_sample=True, top_k=0)
    "T1.0": ("temperature 1.0 (honest)", {"temperature": 1.0, "top_p": 1.0}),
    "T0.9": ("temperature 0.9, raw logprobs", {"temperature": 0.9, "top_p": 1.0}),
    "T0.7": ("temperature 0.7, raw logprobs", {"temperature": 0.7, "top_p": 1.0}),
    "top_p0.95": ("top-p 0.95, raw logprobs", {"temperature": 1.0, "top_p": 0.95}),
    "top_p0.9": ("top-p 0.9, raw logprobs", {"temperature": 1.0, "top_p": 0.9}),
}


@dataclass
class Completion:
    """One completion's action tokens as the trainer scores them: logprob, entropy and varentropy, ``[n]`` each."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    varentropy: torch.Tensor

    def __len__(self) -> int:
        return len(self.logprobs)


class Sampler:
    """The model, its tokenizer and the chat prompts, cycled through in batches of ``batch``."""

    def __init__(self, model_dir: Any, batch: int, max_new_tokens: int) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos
        self.prompts = chat_prompts(self.tokenizer, QUESTIONS + HELD_OUT_QUESTIONS)
        self.batch, self.max_new_tokens, self.calls = batch, max_new_tokens, 0
        self.trainer_check: dict[str, float] | None = None

    @torch.no_grad()
    def draw(self, options: dict[str, float]) -> list[Completion]:
        """One ``generate`` call's completions, scored at temperature 1 (the first call's also by a forward)."""
        start = self.calls * self.batch
        rows = [self.prompts[(start + i) % len(self.prompts)] for i in range(self.batch)]
        self.calls += 1
        ids, attention = left_padded(rows, self.pad)
        out = self.model.generate(ids, attention_mask=attention, do_sample=True, top_k=0, **options,
                                  max_new_tokens=self.max_new_tokens, pad_token_id=self.pad, eos_token_id=self.eos,
                                  output_logits=True, return_dict_in_generate=True)
        completion = out.sequences[:, ids.shape[1]:]
        ended = (completion == self.eos).long().cumsum(1)
        valid = (ended - (completion == self.eos).long()) == 0  # up to and including the first end of turn
        # one generate step at a time: [B, V] logits each, never all [B, L, V] at once
        steps = [token_logprobs(logits, completion[:, k], with_entropy=True) for k, logits in enumerate(out.logits)]
        fields = [torch.stack([getattr(step, name) for step in steps], 1)
                  for name in ("logprobs", "entropy", "varentropy")]
        if self.trainer_check is None:
            self.trainer_check = self._trainer_forward(ids, attention, completion, valid, fields)
        lengths = valid.sum(1).tolist()
        return [Completion(*(field[row, :n] for field in fields)) for row, n in enumerate(lengths)]

    def _trainer_forward(self, ids: torch.Tensor, attention: torch.Tensor, completion: torch.Tensor,
                         valid: torch.Tensor, fields: list[torch.Tensor]) -> dict[str, float]:
        """The largest difference between the generate logits' numbers and a trainer's forward of the sequences."""
        sequences = torch.cat([ids, completion], 1)
        attention = torch.cat([attention, valid.long()], 1)
        positions = (attention.cumsum(1) - 1).clamp(min=0)
        width = completion.shape[1]
        logits = self.model(sequences[:, :-1], attention_mask=attention[:, :-1], position_ids=positions[:, :-1],
                            logits_to_keep=width).logits  # the positions that predict the completion
        trainer = token_logprobs(logits, completion, with_entropy=True)
        return {name: float((getattr(trainer, name) - field)[valid].abs().max())
                for name, field in zip(("logprobs", "entropy", "varentropy"), fields)}


def held_z(step: list[Completion]) -> float:
    """``held_sampling_z`` of one step's completions, through the monitor's own statistics."""
    pad = torch.nn.utils.rnn.pad_sequence
    logprobs = pad([c.logprobs for c in step], batch_first=True)
    mask = pad([torch.ones(len(c)) for c in step], batch_first=True)
    batch = flatten_padded(sampler_logprobs=logprobs.clone(),  # raw logprobs: the trainer's own
                           training_logprobs=logprobs, mask=mask,
                           training_entropy=pad([c.entropy for c in step], batch_first=True),
                           training_varentropy=pad([c.varentropy for c in step], batch_first=True))
    host = DivergenceStats.from_batch(batch).to_host()
    return held_sampling_z(sampling_metrics(host.totals, host.extrema))


def first_tokens(group: list[Completion], n: int) -> list[Completion]:
    """The first ``n`` action tokens of ``group``: whole completions, the last one cut."""
    step, left = [], n
    for completion in group:
        take = min(left, len(completion))
        step.append(Completion(completion.logprobs[:take], completion.entropy[:take], completion.varentropy[:take]))
        left -= take
        if left == 0:
            return step
    raise ValueError(f"a group holds {n - left} action tokens, fewer than the {n} asked for")


def deal(pool: list[Completion], draws: int, tokens: int, generator: torch.Generator) -> list[list[Completion]]:
    """``draws`` disjoint groups of at least ``tokens`` action tokens each, from the shuffled pool."""
    order = torch.randperm(len(pool), generator=generator).tolist()
    groups: list[list[Completion]] = [[]]
    for i in order:
        if sum(map(len, groups[-1])) >= tokens:
            if len(groups) == draws:
                break
            groups.append([])
        groups[-1].append(pool[i])
    if len(groups) < draws or sum(map(len, groups[-1])) < tokens:
        raise ValueError(f"{sum(map(len, pool))} pooled action tokens do not make {draws} groups of {tokens}")
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default=None,
                        help=f"where real_model builds the checkpoint (default: {default_cache_dir()})")
    parser.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {list(SETTINGS)}")
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 128, 256, 512, 1024],
                        help="action tokens per step, a column each")
    parser.add_argument("--draws", type=int, default=5, help="independent steps per cell")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=48, help="completions per generate call")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    names = args.settings.split(",")
    unknown = [name for name in names if name not in SETTINGS]
    if unknown:
        parser.error(f"--settings: {unknown} not among {list(SETTINGS)}")
    if min(args.tokens) < 1 or args.draws < 1 or args.batch < 1 or args.max_new_tokens < 1:
        parser.error("--tokens, --draws, --batch and --max-new-tokens must be at least 1")

    began = time.perf_counter()
    print(f"CPU: {cpu_name()}, torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}")
    sampler = Sampler(build(args.cache_dir), args.batch, args.max_new_tokens)
    need = args.draws * (max(args.tokens) + args.max_new_tokens)  # the last completion of a group overshoots
    cells: dict[str, list[str]] = {}
    pools: dict[str, str] = {}
    for index, name in enumerate(names):
        torch.manual_seed(args.seed * 1000 + index)
        pool: list[Completion] = []
        while sum(map(len, pool)) < need:
            pool.extend(sampler.draw(SETTINGS[name][1]))
        tokens = sum(map(len, pool))
        groups = deal(pool, args.draws, max(args.tokens), torch.Generator().manual_seed(args.seed * 1000 + index))
        row = []
        for n in args.tokens:
            zs = [abs(held_z(first_tokens(group, n))) for group in groups]
            row.append(f"{statistics.median(zs):.1f} ({sum(z >= SAMPLING_Z for z in zs)}/{len(zs)})")
        cells[name] = row
        entropy = float(sum(c.entropy.sum() for c in pool)) / tokens
        pools[name] = (f"| {SETTINGS[name][0]} | {len(pool)} | {tokens:,} | {tokens / len(pool):.1f} | "
                       f"{entropy:.2f} | {held_z(pool):.1f} |")
        print(f"  {name}: {len(pool)} completions, {tokens:,} action tokens, "
              f"{time.perf_counter() - began:.0f} s so far", flush=True)

    check = sampler.trainer_check or {}
    print(f"\nA trainer's forward of the first batch against the generate logits' numbers, largest |difference|: "
          f"logprob {check['logprobs']:.1e}, entropy {check['entropy']:.1e}, varentropy {check['varentropy']:.1e}")
    print(f"\nmedian |held_sampling_z| over {args.draws} independent steps (steps with |z| >= {SAMPLING_Z:g}), "
          f"by action tokens per step; completions of up to {args.max_new_tokens} tokens:\n")
    print("| sampler | " + " | ".join(f"{n:,}" for n in args.tokens) + " |")
    print("|---|" + "---:|" * len(args.tokens))
    for name in names:
        print(f"| {SETTINGS[name][0]} | " + " | ".join(cells[name]) + " |")
    print("\nEach pool as one step:\n")
    print("| sampler | completions | action tokens | tokens per completion | mean entropy (nats) | z |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in names:
        print(pools[name])
    print(f"\ntotal {time.perf_counter() - began:.0f} s, load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
