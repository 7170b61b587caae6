"""The demo's chat tokenizer: a byte-level BPE of 512 ids with a ChatML-style template, shipped in
``configs/data/chat_tokenizer`` beside the chat preference pairs it was trained on
(``configs/data/make_chat_data.py`` made both, in code).

Examples:
    >>> tokenizer = build_chat_tokenizer()
    >>> len(tokenizer), tokenizer.eos_token
    (512, '<|im_end|>')
    >>> tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    '<|begin_of_text|><|im_start|>user\\nhi<|im_end|>\\n'
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loops_callbacks.optional import import_optional

CHAT_TOKENIZER = Path(__file__).resolve().parents[2] / "configs" / "data" / "chat_tokenizer"
"""The shipped tokenizer, in the checkout the package is installed from."""


def build_chat_tokenizer() -> Any:
    """The shipped chat tokenizer as a ``PreTrainedTokenizerFast`` (read from ``CHAT_TOKENIZER``, never downloaded)."""
    transformers = import_optional("transformers", "the demo chat tokenizer")
    if not (CHAT_TOKENIZER / "tokenizer.json").is_file():
        raise FileNotFoundError(f"the demo chat tokenizer is not at {CHAT_TOKENIZER}: it ships in the checkout's configs/")
    return transformers.PreTrainedTokenizerFast.from_pretrained(CHAT_TOKENIZER)
