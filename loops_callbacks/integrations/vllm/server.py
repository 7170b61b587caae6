"""A vLLM server's ``/v1/completions``: the request, the bounded POST, and its answer as the monitor's batch."""

from __future__ import annotations

import json
import math
import numbers
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from loops_callbacks.divergence.evidence import SamplerFacts
from loops_callbacks.integrations.vllm.rollouts import _padded_batch, prompt_token_ids
from loops_callbacks.validation import check, check_int, check_real

_TOKEN_ID_PREFIX = "token_id:"


def completions_request(
    prompts: Sequence[Any], *, max_tokens: int, n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
    top_k: int = -1, stop_token_ids: Sequence[int] | None = None, model: str | None = None, **options: Any,
) -> dict[str, Any]:
    """The JSON body of a ``/v1/completions`` request for ``prompts`` (token ids) whose answer ``completions_batch``
    reads: ``"logprobs": 0`` and ``"return_tokens_as_token_ids": true`` (tokens come back as ``"token_id:N"``).

    ``options`` go into the body as they are (``seed``, ``min_tokens``, ...); ``model`` may be left
    out when the server serves one model.

    Examples:
        >>> body = completions_request([[1, 2, 3]], max_tokens=8, n=4, stop_token_ids=[2])
        >>> body["prompt"], body["n"], body["logprobs"], body["return_tokens_as_token_ids"]
        ([[1, 2, 3]], 4, 0, True)
    """
    body: dict[str, Any] = {
        "prompt": prompt_token_ids(prompts),
        "max_tokens": check_int("max_tokens", max_tokens, least=1),
        "n": check_int("n", n, least=1),
        "temperature": check_real("temperature", temperature, least=0.0, what="a number >= 0"),
        "top_p": check_real("top_p", top_p, least=0.0, most=1.0, what="a number in [0, 1]"),
        "top_k": check_int("top_k", top_k, least=-1, what=" (-1 or 0: off)"),
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    if stop_token_ids is not None:
        body["stop_token_ids"] = [check_int(f"stop_token_ids[{i}]", t, least=0) for i, t in enumerate(stop_token_ids)]
    if model is not None:
        body["model"] = model
    return {**body, **options}


def post_completions(url: str, request: Mapping[str, Any], *, timeout: float = 60.0) -> dict[str, Any]:
    """POST ``request`` (``completions_request``) to the vLLM server at ``url`` (``http://host:port``, or its
    ``/v1/completions``) and return its JSON answer.

    Bounded: no socket operation waits longer than ``timeout`` seconds, and the whole answer must
    have arrived within ``timeout`` of the request (a ``TimeoutError`` otherwise). A server that
    answers with an error status is a ``RuntimeError`` with its message; one that cannot be reached
    a ``ConnectionError`` naming the address.
    """
    positive = "a positive, finite number of seconds"
    timeout = float(check("timeout", timeout, numbers.Real, positive, lambda seconds: 0 < seconds < math.inf))
    endpoint = url.rstrip("/").removesuffix("/v1/completions") + "/v1/completions"
    http = urllib.request.Request(
        endpoint, data=json.dumps(request).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    deadline = time.monotonic() + timeout
    try:
        with urllib.request.urlopen(http, timeout=timeout) as answer:
            chunks = []
            while chunk := answer.read(1 << 16):
                chunks.append(chunk)
                if time.monotonic() > deadline:
                    raise TimeoutError
    except urllib.error.HTTPError as error:
        detail = error.read(2000).decode(errors="replace")
        raise RuntimeError(f"the vLLM server at {endpoint} answered {error.code} {error.reason}: {detail}") from None
    except (TimeoutError, urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        if isinstance(error, TimeoutError) or isinstance(reason, TimeoutError):
            raise TimeoutError(f"the vLLM server at {endpoint} did not answer within {timeout:g} s") from None
        raise ConnectionError(f"cannot reach the vLLM server at {endpoint}: {reason}") from None
    return json.loads(b"".join(chunks))


def completions_batch(
    request: Mapping[str, Any], response: Mapping[str, Any], *, logprobs_mode: str = "raw_logprobs",
    dtype: str | None = None, weight_version: int | None = None, groups: Sequence[int] | None = None, pad_id: int = 0,
    device: str | torch.device | None = None,
) -> dict[str, Any]:
    """The monitor's padded batch (as ``rollout_batch``) from a ``/v1/completions`` ``response`` to ``request``.

    The server does not say how it was started: ``logprobs_mode`` (its ``--logprobs-mode``, vLLM's
    default ``"raw_logprobs"``), ``dtype`` and ``weight_version`` (the trainer's optimizer steps of
    the weights it serves) go into the ``SamplerFacts`` as given; the sampling settings come from
    ``request``. A completion is as many action tokens as its ``logprobs.tokens``.

    Examples:
        >>> request = completions_request([[1, 5]], max_tokens=2)
        >>> choice = {"index": 0, "logprobs": {"tokens": ["token_id:7", "token_id:2"], "token_logprobs": [-0.5, -0.25]}}
        >>> batch = completions_batch(request, {"choices": [choice]}, weight_version=0)
        >>> batch["target_tokens"].tolist(), batch["logprobs"].tolist(), batch["sampler_facts"].temperature
        ([[5, 7, 2]], [[0.0, -0.5, -0.25]], 1.0)
    """
    prompts = request.get("prompt") if isinstance(request, Mapping) else None
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, list) for p in prompts):
        raise ValueError("request must be a completions_request body: its 'prompt' is a list of token-id lists")
    if request.get("logprobs") is None or request.get("return_tokens_as_token_ids") is not True:
        raise ValueError(
            "the request must ask for \"logprobs\": 0 and \"return_tokens_as_token_ids\": true (completions_request "
            "does), or the tokens and their logprobs cannot be read"
        )
    n = request.get("n", 1)
    choices = response.get("choices") if isinstance(response, Mapping) else None
    if not isinstance(choices, list):
        said = response.get("message") or response.get("error") if isinstance(response, Mapping) else response
        raise ValueError(f"the server's answer has no list of choices: {str(said)[:500]}")
    if len(choices) != len(prompts) * n:
        raise ValueError(f"the answer has {len(choices)} choices for {len(prompts)} prompts x n={n}")
    ordered = sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c, Mapping) else 0)
    completions, logprobs = zip(*map(_choice_tokens, ordered)) if ordered else ((), ())
    facts = SamplerFacts(
        engine="vllm", dtype=dtype, logprobs_mode=logprobs_mode, temperature=request.get("temperature"),
        top_p=request.get("top_p"), top_k=request.get("top_k"), weight_version=weight_version,
    )
    rows = [prompt for prompt in prompts for _ in range(n)]
    counts = [n] * len(prompts)
    return _padded_batch(rows, list(completions), list(logprobs), counts, facts, None, groups, pad_id, device)


def _choice_tokens(choice: Any) -> tuple[np.ndarray, np.ndarray]:
    """A choice's sampled token ids (from ``"token_id:N"``) and their logprobs (``None`` read as NaN)."""
    where = f"choice {choice.get('index') if isinstance(choice, Mapping) else None}"
    logprobs = choice.get("logprobs") if isinstance(choice, Mapping) else None
    if not isinstance(logprobs, Mapping):
        raise ValueError(f"{where} has no logprobs: request with \"logprobs\": 0 (completions_request does)")
    tokens, values = logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []
    if len(tokens) != len(values):
        raise ValueError(f"{where} has {len(values)} logprobs for {len(tokens)} tokens; one per token is needed")
    bad = next((t for t in tokens if not (isinstance(t, str) and t.startswith(_TOKEN_ID_PREFIX))), None)
    if bad is not None:
        raise ValueError(
            f"{where} has the token {bad!r}, not 'token_id:N': request with \"return_tokens_as_token_ids\": true"
        )
    ids = np.fromiter((int(t[len(_TOKEN_ID_PREFIX) :]) for t in tokens), dtype=np.int64, count=len(tokens))
    return ids, np.asarray([math.nan if v is None else v for v in values], dtype=np.float64)
