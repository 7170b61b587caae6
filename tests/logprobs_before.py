"""The three target-token log-probability implementations ``token_logprobs`` replaced, verbatim.

``policy_before``: the DPO policy's ``target_logprobs`` (``models/dpo.py``); ``reference_before``:
the reference scorer's chunked ``logits_logprobs`` (``reference/heads.py``); ``demo_before``: the
demo's ``token_logprobs`` (``demo/model.py``); ``head_before``: the output head's per-chunk
formula (``reference/heads.head_logprobs``). ``tests/test_token_logprobs.py`` and
``benchmarks/bench_token_logprobs.py`` compare the new function with them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loops_callbacks.reference.heads import LogitTransform


def policy_before(logits: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return torch.log_softmax(logits, dim=-1, dtype=dtype).gather(-1, target_tokens.long().unsqueeze(-1)).squeeze(-1)


def demo_before(logits: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
    logprobs = torch.log_softmax(logits.float() if logits.dtype != torch.float64 else logits, dim=-1)
    return logprobs.gather(-1, target_tokens.long().unsqueeze(-1)).squeeze(-1)


def reference_before(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    rows, width, vocab = logits.shape
    rows_per_chunk = max(1, (1 << 22) // max(1, width * vocab))
    parts = []
    for start in range(0, rows, rows_per_chunk):
        logprobs = torch.log_softmax(logits[start : start + rows_per_chunk], dim=-1, dtype=torch.float32)
        parts.append(logprobs.gather(-1, targets[start : start + rows_per_chunk, :, None]).squeeze(-1))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def head_before(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    transform: LogitTransform,
    *,
    rows_per_chunk: int,
) -> torch.Tensor:
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    identity = transform.scale is None and transform.softcap is None
    for start in range(0, hidden.shape[0], rows_per_chunk):
        stop = min(start + rows_per_chunk, hidden.shape[0])
        logits = F.linear(hidden[start:stop], weight, bias)
        if identity:
            logprobs = torch.log_softmax(logits, dim=1, dtype=torch.float32)
        else:
            logprobs = torch.log_softmax(transform(logits.to(torch.float32, copy=True)), dim=1)
        out[start:stop] = logprobs.gather(1, targets[start:stop, None]).squeeze(1)
    return out
