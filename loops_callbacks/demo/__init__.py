"""Tiny models, a tokenizer, a toy task and data for the shipped demo experiments.

Importing this package makes the demo classes available to LightningCLI by their short names
(``class_path: RLPolicyModule``).

- ``CharTokenizer`` (``tokenizer.py``): character-level ids over ``0-9`` and ``=``.
- ``TinyCausalLM``, ``token_logprobs`` (``model.py``): a small causal transformer.
- ``ReverseDigitsTask`` (``tasks.py``): reverse a digit string; partial-credit reward in [0, 1].
- ``PromptDataModule``, ``ReversePairsDataModule``, ``make_preference_pairs``, ``write_preference_jsonl``
  (``data.py``): RL prompts, DPO pairs.
- ``RLPolicyModule`` (``rl.py``): GRPO-style RL with a separate, syncable sampler.
- ``DPOPolicyModule``, ``dpo_loss`` (``dpo.py``): DPO against attached reference logprobs.
"""

from loops_callbacks.demo.data import (
    PromptDataModule,
    ReversePairsDataModule,
    make_preference_pairs,
    write_preference_jsonl,
)
from loops_callbacks.demo.dpo import DPOPolicyModule, dpo_loss
from loops_callbacks.demo.model import TinyCausalLM, token_logprobs
from loops_callbacks.demo.rl import RLPolicyModule
from loops_callbacks.demo.tasks import ReverseDigitsTask
from loops_callbacks.demo.tokenizer import CharTokenizer

__all__ = [
    "CharTokenizer",
    "DPOPolicyModule",
    "PromptDataModule",
    "RLPolicyModule",
    "ReversePairsDataModule",
    "ReverseDigitsTask",
    "TinyCausalLM",
    "dpo_loss",
    "make_preference_pairs",
    "token_logprobs",
    "write_preference_jsonl",
]
