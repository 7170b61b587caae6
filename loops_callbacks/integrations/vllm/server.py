"""A vLLM server's ``/v1/completions``: the request, the bounded POST, and its answer as the monitor's batch."""

from __future__ import annotations

import http.client as http_client
import io
import json
import math
import numbers
import socket
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

    Bounded: ``timeout`` seconds is a deadline for the whole call (connecting, sending the request,
    every read of the answer), a ``TimeoutError`` past it, however slowly the server trickles bytes.
    A server that answers with an error status is a ``RuntimeError`` with its message; one that cannot
    be reached, or closes the connection before the whole answer, a ``ConnectionError`` naming the
    address; an answer that is not a JSON object a ``ValueError`` showing its start.
    """
    positive = "a positive, finite number of seconds"
    timeout = float(check("timeout", timeout, numbers.Real, positive, lambda seconds: 0 < seconds < math.inf))
    endpoint = url.rstrip("/").removesuffix("/v1/completions") + "/v1/completions"
    http = urllib.request.Request(
        endpoint, data=json.dumps(request).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    deadline = _Deadline(timeout)
    opener = urllib.request.build_opener(_DeadlineHTTPHandler(deadline), _DeadlineHTTPSHandler(deadline))
    try:
        with opener.open(http, timeout=deadline.left()) as answer:
            kind = answer.headers.get_content_type()
            data = answer.read()
    except urllib.error.HTTPError as error:
        try:
            detail = error.read(2000).decode(errors="replace")
        except (OSError, http_client.HTTPException):
            detail = "(its message did not arrive)"
        raise RuntimeError(f"the vLLM server at {endpoint} answered {error.code} {error.reason}: {detail}") from None
    except http_client.IncompleteRead as error:
        got, expected = len(error.partial), len(error.partial) + (error.expected or 0)
        raise ConnectionError(f"the vLLM server at {endpoint} closed the connection after {got} of the {expected} "
                              "bytes its Content-Length announced") from None
    except http_client.HTTPException as error:
        raise ConnectionError(f"the vLLM server at {endpoint} did not answer in HTTP: {error!r}") from None
    except (TimeoutError, urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        if isinstance(error, TimeoutError) or isinstance(reason, TimeoutError):
            raise TimeoutError(f"the vLLM server at {endpoint} did not answer within {timeout:g} s") from None
        raise ConnectionError(f"cannot reach the vLLM server at {endpoint}: {reason}") from None
    try:
        answer = json.loads(data)
    except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
        raise ValueError(f"the vLLM server at {endpoint} answered 200 with a body that is not JSON ({kind}, "
                         f"{len(data)} bytes): {data[:300].decode(errors='replace')!r}") from None
    if not isinstance(answer, dict):
        raise ValueError(f"the vLLM server at {endpoint} answered 200 with JSON that is not an object: "
                         f"{json.dumps(answer)[:300]}")
    return answer


class _Deadline:
    """The end of a call: ``left()`` is the time that remains, a ``TimeoutError`` once there is none."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        remaining = self.end - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the deadline passed")
        return remaining


class _DeadlineReader(io.RawIOBase):
    """A socket's reads, each waiting at most until the deadline (a buffered ``readline`` or ``read(n)`` reads
    many times: a per-read timeout alone lets a server that trickles bytes hold the call for ever)."""

    def __init__(self, sock: socket.socket, deadline: _Deadline) -> None:
        super().__init__()
        self._sock, self._raw, self._deadline = sock, sock.makefile("rb", buffering=0), deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        self._sock.settimeout(self._deadline.left())
        return self._raw.readinto(buffer)

    def close(self) -> None:
        self._raw.close()
        super().close()


class _DeadlineSocket:
    """A connected socket whose sends and reads (through ``makefile``, as ``http.client`` reads) end by the
    deadline; anything else goes to the socket."""

    def __init__(self, sock: socket.socket, deadline: _Deadline) -> None:
        self._sock, self._deadline = sock, deadline

    def sendall(self, data: Any) -> None:
        self._sock.settimeout(self._deadline.left())  # sendall's timeout bounds the whole send
        self._sock.sendall(data)

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def _deadline_connection(base: type[http_client.HTTPConnection], deadline: _Deadline) -> Any:
    """A ``base`` connection class whose socket, once connected, ends every send and read by ``deadline``."""

    class Connection(base):  # type: ignore[misc, valid-type]
        def connect(self) -> None:
            self.timeout = deadline.left()
            super().connect()
            self.sock = _DeadlineSocket(self.sock, deadline)

    return Connection


class _DeadlineHandler(urllib.request.AbstractHTTPHandler):
    """urllib's HTTP(S) handler with connections bounded by a deadline (proxies and redirects as urllib does)."""

    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self._deadline = deadline

    def do_open(self, http_class: Any, req: urllib.request.Request, **kwargs: Any) -> Any:
        return super().do_open(_deadline_connection(http_class, self._deadline), req, **kwargs)


class _DeadlineHTTPHandler(_DeadlineHandler, urllib.request.HTTPHandler):
    pass


class _DeadlineHTTPSHandler(_DeadlineHandler, urllib.request.HTTPSHandler):
    pass


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
