"""Write ``trl_dpo_golden.json``: the token ids TRL's ``DPOTrainer`` trains on, for ``tests/data/test_tokenization_trl.py``.

Run with TRL installed (not a dependency of this package), from the repository root::

    python -m venv /tmp/trl-venv && /tmp/trl-venv/bin/pip install torch==2.13.0 trl
    /tmp/trl-venv/bin/python tests/golden/make_trl_dpo_golden.py

For each case (the shipped conversational pairs, and standard, implicit-prompt and
trailing-space variants of the first ones) it builds a ``DPOTrainer`` with the shipped tokenizer
and a tiny random model (``__init__`` tokenizes the data set), then runs the trainer's collator
on each kept example: the unpadded ``input_ids`` and where ``completion_mask`` starts, for the
chosen and the rejected sequence. Only this file imports TRL (inside the functions, so that the
test suite's doctest collection can import it without TRL); the test reads its output.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import sys
import tempfile
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "configs", "data", "chat_preferences.jsonl")
TOKENIZER = os.path.join(ROOT, "configs", "data", "chat_tokenizer")
OUT = os.path.join(ROOT, "tests", "golden", "trl_dpo_golden.json")
NUM_VARIANT = 24  # records per derived variant
NUM_SHOWN = 8  # records whose ids are written out in clear (all are in the digest)


def variants(records: list[dict]) -> dict[str, list[dict]]:
    """Format variants of the first records: the same pairs as text, implicit prompts, a trailing space."""
    head = records[:NUM_VARIANT]
    question = [r["prompt"][-1]["content"] for r in head]
    chosen = [r["chosen"][0]["content"] for r in head]
    rejected = [r["rejected"][0]["content"] for r in head]
    return {
        "standard": [
            {"prompt": f"Question: {q}\nAnswer:", "chosen": f" {c}", "rejected": f" {r}"}
            for q, c, r in zip(question, chosen, rejected)
        ],
        "standard_trailing_space": [  # the prompt's trailing space merges with the completion's first word
            {"prompt": f"Question: {q}\nAnswer: {c.split()[0]} ", "chosen": c.split(" ", 1)[1], "rejected": r}
            for q, c, r in zip(question, chosen, rejected)
        ],
        "implicit_standard": [
            {"chosen": f"Question: {q}\nAnswer: {c}", "rejected": f"Question: {q}\nAnswer: {r}"}
            for q, c, r in zip(question, chosen, rejected)
        ],
        "implicit_conversational": [
            {"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]} for r in head
        ],
    }


def trl_sequences(records: list[dict], tokenizer: Any, max_length: int | None) -> list[list]:
    """``[index, chosen_ids, rejected_ids, chosen_start, rejected_start]`` of every example TRL keeps."""
    import torch
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    dataset = Dataset.from_list([{**r, "index": i} for i, r in enumerate(records)])
    config = AutoConfig.for_model("llama", vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    model = AutoModelForCausalLM.from_config(config)
    with tempfile.TemporaryDirectory() as output_dir:
        args = DPOConfig(output_dir=output_dir, max_length=max_length, report_to=[], use_cpu=True, bf16=False)
        trainer = DPOTrainer(
            model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=dataset, processing_class=tokenizer
        )
        rows = []
        for example in trainer.train_dataset:
            batch = trainer.data_collator([example])
            sequences = []
            for row in (0, 1):  # chosen, rejected
                length = int(batch["attention_mask"][row].sum())
                ids = batch["input_ids"][row, :length].tolist()
                start = int(torch.nonzero(batch["completion_mask"][row])[0, 0])
                sequences.append((ids, start))
            rows.append([example["index"], sequences[0][0], sequences[1][0], sequences[0][1], sequences[1][1]])
    return rows


def digest(rows: list[list]) -> str:
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def main() -> None:
    import transformers
    import trl
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    with open(DATA, encoding="utf-8") as file:
        records = [json.loads(line) for line in file if line.strip()]
    cases = {"conversational": (None, None, None), "conversational_max_length_40": (None, 40, None)}
    for name, variant in variants(records).items():
        cases[name] = (variant, None, None)
    cases["standard_max_length_18"] = (variants(records)["standard"], 18, None)
    golden = {
        "how": "tests/golden/make_trl_dpo_golden.py",
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0]},
        "cases": {},
    }
    for name, (variant, max_length, _) in cases.items():
        rows = trl_sequences(records if variant is None else variant, tokenizer, max_length)
        golden["cases"][name] = {
            "records": variant,  # None: the shipped file
            "max_length": max_length,
            "num_kept": len(rows),
            "sha256": digest(rows),
            "first": rows[:NUM_SHOWN],
        }
        print(f"{name}: {len(rows)} kept, sha256 {golden['cases'][name]['sha256'][:12]}")
    with open(OUT, "w", encoding="utf-8") as file:  # one line per case
        file.write("{\n")
        file.write(f' "how": {json.dumps(golden["how"])},\n "versions": {json.dumps(golden["versions"])},\n "cases": {{\n')
        file.write(",\n".join(f"  {json.dumps(name)}: {json.dumps(case)}" for name, case in golden["cases"].items()))
        file.write("\n }\n}\n")


if __name__ == "__main__":
    main()
