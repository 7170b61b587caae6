"""How ``configs/data/`` was made: a small chat preference data set and a chat tokenizer for it, in code.

``make_chat_preferences`` writes conversational preference pairs (TRL's ``prompt`` / ``chosen`` /
``rejected`` lists of messages): a user asks a short question (sums, capitals, colours,
opposites, words spelled backwards), sometimes after a system message or an earlier exchange;
the chosen reply answers it, the rejected one is unhelpful (a refusal, a rude or evasive
reply) or, in half of the pairs, answers wrongly in the same words.

``build_chat_tokenizer`` trains a byte-level BPE (512 ids, 4 of them special) on that data and
wraps it in ``PreTrainedTokenizerFast`` with a ChatML-style chat template that starts with the
BOS token, as Llama 3's does. ``configs/data/`` ships both (``loops_callbacks.demo.chat_tokenizer()``
loads the tokenizer), made, byte for byte, by::

    python configs/data/make_chat_data.py configs/data
"""

from __future__ import annotations

import json
import os
import random
import sys
from typing import Any

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML turns after a BOS token; the generation prompt opens an assistant turn."""

SPECIAL_TOKENS = ("<|pad|>", "<|begin_of_text|>", "<|im_start|>", "<|im_end|>")
VOCAB_SIZE = 512

_CAPITALS = {
    "France": "Paris", "Spain": "Madrid", "Italy": "Rome", "Germany": "Berlin", "Japan": "Tokyo",
    "Egypt": "Cairo", "Canada": "Ottawa", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo",
    "Greece": "Athens", "Chile": "Santiago", "Cuba": "Havana", "Poland": "Warsaw", "Ireland": "Dublin",
    "Austria": "Vienna", "Portugal": "Lisbon", "Sweden": "Stockholm", "Russia": "Moscow", "China": "Beijing",
}
_COLOURS = {
    "the sky": "blue", "grass": "green", "snow": "white", "a banana": "yellow", "coal": "black",
    "a tomato": "red", "an orange": "orange", "a plum": "purple", "chocolate": "brown", "milk": "white",
}
_OPPOSITES = {
    "hot": "cold", "big": "small", "up": "down", "fast": "slow", "early": "late", "happy": "sad",
    "light": "dark", "open": "closed", "full": "empty", "old": "new", "near": "far", "wet": "dry",
}
_WORDS = ["cat", "dog", "star", "lamp", "river", "stone", "apple", "cloud", "horse", "table", "green", "music"]
_UNHELPFUL = [
    "I don't know.",
    "Why would I tell you that?",
    "Figure it out yourself.",
    "That is a boring question.",
    "No.",
    "Ask someone else.",
    "I would rather not say.",
    "Whatever.",
]
_SYSTEM = "You are a helpful assistant. Answer in one short sentence."


def _pair(rng: random.Random, table: dict[str, str]) -> tuple[str, str, str]:
    """A key of ``table``, its value, and another of its values (drawn in that order)."""
    key = rng.choice(sorted(table))
    return key, table[key], rng.choice(sorted(set(table.values()) - {table[key]}))


def _question(rng: random.Random) -> tuple[str, str, str]:
    """(question, right answer, wrong answer in the same words)."""
    kind = rng.randrange(5)
    if kind == 0:
        a, b = rng.randrange(1, 20), rng.randrange(1, 20)
        wrong = a + b + rng.choice([-2, -1, 1, 2])
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.", f"{a} plus {b} is {wrong}."
    if kind == 1:
        country, right, other = _pair(rng, _CAPITALS)
        answer = "The capital of {} is {}."
        return f"What is the capital of {country}?", answer.format(country, right), answer.format(country, other)
    if kind == 2:
        thing, right, other = _pair(rng, _COLOURS)
        subject = thing[0].upper() + thing[1:]
        return f"What colour is {thing}?", f"{subject} is {right}.", f"{subject} is {other}."
    if kind == 3:
        word, right, other = _pair(rng, _OPPOSITES)
        answer = "The opposite of {} is {}."
        return f"What is the opposite of {word}?", answer.format(word, right), answer.format(word, other)
    word = rng.choice(_WORDS)
    scrambled = list(word)
    while "".join(scrambled) in (word, word[::-1]):
        rng.shuffle(scrambled)
    return f"Spell {word} backwards.", f"{word} backwards is {word[::-1]}.", f"{word} backwards is {''.join(scrambled)}."


def make_chat_preferences(num_pairs: int, *, seed: int = 0, wrong_fraction: float = 0.5) -> list[dict[str, Any]]:
    """Conversational preference records ``{"prompt": [...], "chosen": [...], "rejected": [...]}``.

    A third of the prompts start with a system message and a fifth carry an earlier exchange;
    ``wrong_fraction`` of the rejected replies are wrong answers, the rest unhelpful ones.
    """
    rng = random.Random(seed)
    records = []
    for _ in range(num_pairs):
        prompt: list[dict[str, str]] = []
        if rng.random() < 1 / 3:
            prompt.append({"role": "system", "content": _SYSTEM})
        if rng.random() < 1 / 5:
            question, answer, _ = _question(rng)
            prompt += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        question, answer, wrong = _question(rng)
        prompt.append({"role": "user", "content": question})
        rejected = wrong if rng.random() < wrong_fraction else rng.choice(_UNHELPFUL)
        records.append(
            {
                "prompt": prompt,
                "chosen": [{"role": "assistant", "content": answer}],
                "rejected": [{"role": "assistant", "content": rejected}],
            }
        )
    return records


def write_chat_preferences(path: str | os.PathLike[str], records: list[dict[str, Any]]) -> None:
    """One JSON record per line."""
    with open(path, "w", encoding="utf-8") as file:
        for record in records:
            file.write(json.dumps(record) + "\n")


def build_chat_tokenizer(corpus: list[dict[str, Any]] | None = None) -> Any:
    """A ``PreTrainedTokenizerFast``: byte-level BPE trained on ``corpus`` (default: 2,048 pairs of ours).

    Plain text gets a BOS token in front (as Llama's tokenizers do); the chat template writes its
    own, so chat turns are tokenized without adding another. EOS is ``<|im_end|>``.
    """
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    records = corpus if corpus is not None else make_chat_preferences(2048, seed=1)
    texts = [
        f"{message['role']}\n{message['content']}"
        for record in records
        for key in ("prompt", "chosen", "rejected")
        for message in record[key]
    ]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    bos = "<|begin_of_text|>"
    bpe.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bpe.token_to_id(bos))]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=bos,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def save_portable(tokenizer: Any, directory: str) -> None:
    """``save_pretrained``, with the chat template inside ``tokenizer_config.json`` and the class named
    ``PreTrainedTokenizerFast``, so that transformers 4.x loads it as well as 5.x."""
    tokenizer.save_pretrained(directory)
    config_path = os.path.join(directory, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as file:
        config = json.load(file)
    config.pop("backend", None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["chat_template"] = tokenizer.chat_template
    if "extra_special_tokens" in config:
        config["additional_special_tokens"] = config.pop("extra_special_tokens")
    with open(config_path, "w", encoding="utf-8") as file:
        json.dump(config, file, indent=2, sort_keys=True)
        file.write("\n")
    template_path = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(template_path):
        os.remove(template_path)


def main(directory: str) -> None:
    """Write ``chat_preferences.jsonl`` (512 pairs) and the tokenizer (``chat_tokenizer/``) under ``directory``."""
    os.makedirs(directory, exist_ok=True)
    write_chat_preferences(os.path.join(directory, "chat_preferences.jsonl"), make_chat_preferences(512, seed=0))
    save_portable(build_chat_tokenizer(), os.path.join(directory, "chat_tokenizer"))


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1] if len(sys.argv) > 1 else "configs/data")
