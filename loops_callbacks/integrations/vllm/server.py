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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from loops_callbacks.divergence.batch import SamplerFacts
from loops_callbacks.integrations.vllm.rollouts import _padded_batch, prompt_token_ids, token_id_array
from loops_callbacks.validation import (
    check,
    check_choice,
    check_dtype,
    check_int,
    check_real,
    check_reference_logprobs,
)

_TOKEN_ID_PREFIX = "token_id:"


def completions_request(
    prompts: Sequence[Any], *, max_tokens: int, n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
    top_k: int = -1, stop_token_ids: Sequence[int] | None = None, model: str | None = None, **options: Any,
) -> dict[str, Any]:
    """The JSON body of a ``/v1/completions`` request for ``prompts`` (token ids) whose answer ``completions_batch``
    reads: ``"logprobs": 0`` and ``"return_tokens_as_token_ids": true`` (tokens come back as ``"token_id:N"``).

    ``options`` go into the body as they are (``seed``, ``min_tokens``, ``logprobs`` above 0 for top
    logprobs, ...), except those that change what the answer means: ``echo``, ``best_of`` other than
    ``n``, ``use_beam_search``, ``stream``, ``truncate_prompt_tokens``, ``prompt_embeds`` and
    ``return_tokens_as_token_ids`` other than true are a ``ValueError`` naming the option.
    ``model`` may be left out when the server serves one model.

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
    if check("model", model, str, "the served model's name (a str)", optional=True) is not None:
        body["model"] = model
    if "prompt" in options:
        raise ValueError(f"completions_request: prompt={options['prompt']!r:.200} in options; pass the prompts as the "
                         "first argument (their token ids are checked)")
    body = {**body, **options}
    _check_readable(body, "completions_request: ", "")
    return body


_CHANGES_THE_ANSWER: dict[str, tuple[Callable[[Any, int], bool], str]] = {
    # option: (whether its value (and n) changes what the answer means, what it would do)
    "echo": (lambda value, n: bool(value), "the answer's tokens would begin with the prompt's (its first without a "
                                           "logprob), read as sampled"),
    "best_of": (lambda value, n: value is not None and value != n,
                "the server would return the n most likely of best_of completions: not samples of the policy"),
    "use_beam_search": (lambda value, n: bool(value), "beams are not samples of the policy"),
    "stream": (lambda value, n: bool(value), "the answer would be server-sent events, not one JSON body"),
    "truncate_prompt_tokens": (lambda value, n: value is not None,
                               "the server would cut the prompt, and the rows would hold tokens it did not sample from"),
    "prompt_embeds": (lambda value, n: value is not None,
                      "the prompt would be embeddings, not the token ids the rows hold"),
    "return_tokens_as_token_ids": (lambda value, n: value is not True,
                                   "completions_batch reads the tokens as 'token_id:N' (true)"),
}


def _check_readable(body: Mapping[str, Any], prefix: str, name: str) -> int:
    """The body's ``n``, after a ``ValueError`` for an option that changes what the answer means (the
    ``_CHANGES_THE_ANSWER`` table, ``prefix`` before its name) and the checks of ``logprobs`` and ``n``
    (``name`` before theirs)."""
    n = check_int(f"{name}n", body.get("n", 1), least=1)
    check_int(f"{name}logprobs", body.get("logprobs"), least=0,
              what=" (the sampled token's logprob is read from token_logprobs)")
    for option, (changes, why) in _CHANGES_THE_ANSWER.items():
        if changes(body.get(option), n):
            shown = f"={body[option]!r:.200}" if option in body else " left out"
            raise ValueError(f"{prefix}{option}{shown} changes what the answer means: {why}")
    return n


def post_completions(url: str, request: Mapping[str, Any], *, timeout: float = 60.0) -> dict[str, Any]:
    """POST ``request`` (``completions_request``) to the vLLM server at ``url`` (``http://host:port``, or its
    ``/v1/completions``) and return its JSON answer.

    Bounded: ``timeout`` seconds is a deadline for the whole call (connecting, sending the request,
    every read of the answer), a ``TimeoutError`` past it, however slowly the server trickles bytes.
    A server that answers with an error status is a ``RuntimeError`` (a ``ServerHTTPError``) with its
    message; one that cannot be reached, or closes the connection before the whole answer, a
    ``ConnectionError`` naming the address; an answer that is not a JSON object a ``ValueError`` showing
    its start.
    """
    check("url", url, str, "the server's http://host:port (or https://, or its /v1/completions)",
          lambda text: text.startswith(("http://", "https://")))
    return server_json(url.rstrip("/").removesuffix("/v1/completions"), "/v1/completions", request, timeout=timeout)


class ServerHTTPError(RuntimeError):
    """A vLLM server answered an error status: ``status`` (404, 500, ...), ``endpoint`` and the server's ``detail``."""

    def __init__(self, endpoint: str, status: int, reason: str, detail: str) -> None:
        super().__init__(f"the vLLM server at {endpoint} answered {status} {reason}: {detail}")
        self.endpoint, self.status, self.detail = endpoint, status, detail


def server_json(
    url: str, path: str, body: Mapping[str, Any] | None = None, *, method: str = "POST", timeout: float = 60.0,
) -> dict[str, Any]:
    """The JSON object a vLLM server at ``url`` (``http://host:port``) answers to ``method path`` with ``body``
    (JSON; none for a GET). An empty 200 answer is ``{}``. Errors as ``post_completions``'.

    Examples:
        >>> server_json("localhost:8000", "/weight_info", method="GET")
        Traceback (most recent call last):
        ...
        ValueError: url must be the server's http://host:port (or https://), got 'localhost:8000'
    """
    positive = "a positive, finite number of seconds"
    timeout = float(check("timeout", timeout, numbers.Real, positive, lambda seconds: 0 < seconds < math.inf))
    check("url", url, str, "the server's http://host:port (or https://)", lambda text: text.startswith(("http://", "https://")))
    check_choice("method", method, ("GET", "POST"))
    endpoint = url.rstrip("/") + path
    data = None if body is None else json.dumps(body).encode()
    http = urllib.request.Request(endpoint, data=data, headers={"Content-Type": "application/json"}, method=method)
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
        raise ServerHTTPError(endpoint, error.code, error.reason, detail) from None
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
    if not data:
        return {}
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
    modes = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")  # vLLM's --logprobs-mode
    logprobs_mode = check_choice("logprobs_mode", logprobs_mode, modes)
    dtype = None if dtype is None else str(check_dtype("dtype", dtype)).removeprefix("torch.")
    rows, completions, logprobs, counts = completion_rows(request, response)
    facts = SamplerFacts(  # the settings the request gave (None: the server's default, not known here)
        engine="vllm", dtype=dtype, logprobs_mode=logprobs_mode, weight_version=weight_version,
        temperature=check_real("the request's temperature", request.get("temperature"), least=0.0,
                               what="a number >= 0", optional=True),
        top_p=check_real("the request's top_p", request.get("top_p"), least=0.0, most=1.0, what="a number in [0, 1]",
                         optional=True),
        top_k=check_int("the request's top_k", request.get("top_k"), least=-1, what=" (-1 or 0: off)", optional=True),
    )
    return _padded_batch(rows, completions, logprobs, counts, facts, None, groups, pad_id, device)


def completion_rows(
    request: Mapping[str, Any], response: Mapping[str, Any],
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray], list[int]]:
    """A ``/v1/completions`` ``response`` to ``request`` as rows: each choice's prompt, sampled tokens and their
    logprobs (prompt-major: the n choices of prompt i adjacent), and the choices per prompt; checked as
    ``completions_batch`` says.

    Examples:
        >>> request = completions_request([[1, 5]], max_tokens=1)
        >>> choice = {"index": 0, "logprobs": {"tokens": ["token_id:7"], "token_logprobs": [-0.5]}}
        >>> prompts, tokens, logprobs, counts = completion_rows(request, {"choices": [choice]})
        >>> prompts[0].tolist(), tokens[0].tolist(), logprobs[0].tolist(), counts
        ([1, 5], [7], [-0.5], [1])
    """
    prompts = request.get("prompt") if isinstance(request, Mapping) else None
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, list) for p in prompts):
        raise ValueError("request must be a completions_request body: its 'prompt' is a list of token-id lists")
    if request.get("logprobs") is None:
        raise ValueError(
            "the request must ask for \"logprobs\": 0 and \"return_tokens_as_token_ids\": true (completions_request "
            "does), or the tokens and their logprobs cannot be read"
        )
    n = _check_readable(request, "the request's ", "the request's ")
    rows = [token_id_array(prompt, f"the request's prompt {i}") for i, prompt in enumerate(prompts)]
    empty = next((i for i, row in enumerate(rows) if not row.size), None)
    if empty is not None:
        raise ValueError(f"the request's prompt {empty} is empty; vLLM needs at least one prompt token")
    choices = response.get("choices") if isinstance(response, Mapping) else None
    if not isinstance(choices, list):
        said = response.get("message") or response.get("error") if isinstance(response, Mapping) else response
        raise ValueError(f"the server's answer has no list of choices: {str(said)[:500]}")
    if len(choices) != len(prompts) * n:
        raise ValueError(f"the answer has {len(choices)} choices for {len(prompts)} prompts x n={n}")
    ordered = _by_index(choices)
    completions, logprobs = zip(*(_choice_tokens(choice, index) for index, choice in enumerate(ordered)))
    return [row for row in rows for _ in range(n)], list(completions), list(logprobs), [n] * len(prompts)


def _by_index(choices: list[Any]) -> list[Mapping[str, Any]]:
    """The answer's choices in the order of their ``index``: each an int in ``[0, len(choices))``, each once."""
    ordered: list[Any] = [None] * len(choices)
    given_at = [-1] * len(choices)
    expected = f"each choice's index is an int in [0, {len(choices)})"
    for position, choice in enumerate(choices):
        where = f"the answer's choices[{position}]"
        if not isinstance(choice, Mapping):
            raise ValueError(f"{where} is {choice!r:.100} ({type(choice).__name__}), not a choice (an object with index "
                             "and logprobs)")
        if "index" not in choice:
            raise ValueError(f"{where} has no index; {expected}")
        index = choice["index"]
        if not isinstance(index, int) or isinstance(index, bool):
            raise ValueError(f"{where} has index {index!r:.100} ({type(index).__name__}); {expected}")
        if not 0 <= index < len(choices):
            raise ValueError(f"{where} has index {index}; {expected}")
        if given_at[index] >= 0:
            raise ValueError(f"the answer's choices[{given_at[index]}] and choices[{position}] both have index {index}")
        ordered[index], given_at[index] = choice, position
    return ordered


def _choice_tokens(choice: Mapping[str, Any], index: int) -> tuple[np.ndarray, np.ndarray]:
    """A choice's sampled token ids (from ``"token_id:N"``) and their logprobs (``None``, a token the server
    gave no logprob, read as NaN), each checked: ids are decimal digits within int64, logprobs numbers that
    are finite and ``<= 0`` (up to rounding)."""
    where = f"choice {index}"
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, Mapping):
        raise ValueError(f"{where} has no logprobs: request with \"logprobs\": 0 (completions_request does)")
    tokens, values = logprobs.get("tokens"), logprobs.get("token_logprobs")
    if not isinstance(tokens, list) or not isinstance(values, list):
        raise ValueError(f"{where}'s logprobs has tokens={tokens!r:.100} and token_logprobs={values!r:.100}; lists "
                         "(one per sampled token) are needed")
    if len(tokens) != len(values):
        raise ValueError(f"{where} has {len(values)} logprobs for {len(tokens)} tokens; one per token is needed")
    if not tokens:
        raise ValueError(f"{where} has no tokens: a completion has at least one (max_tokens >= 1)")
    cut = len(_TOKEN_ID_PREFIX)
    digits = [t[cut:] if isinstance(t, str) and t.startswith(_TOKEN_ID_PREFIX) else None for t in tokens]
    bad = next((k for k, d in enumerate(digits) if d is None or not (d.isascii() and d.isdigit())), None)
    if bad is not None:
        needed = ": request with \"return_tokens_as_token_ids\": true" if digits[bad] is None else \
            " with N a token id (decimal digits)"
        raise ValueError(f"{where}: position {bad} has the token {tokens[bad]!r:.100}, not 'token_id:N'{needed}")
    long = next((k for k, d in enumerate(digits) if len(d) > 19), None)  # beyond int64, and int() of a million digits
    if long is not None:
        raise ValueError(f"{where} has token id {digits[long][:40]}{'...' if len(digits[long]) > 40 else ''} at "
                         f"position {long}; a token id is an int >= 0 (within int64)")
    ids = token_id_array(list(map(int, digits)), where)
    kinds = set(map(type, values))
    if not kinds <= {float, int, type(None)}:
        position, value = next((k, v) for k, v in enumerate(values) if type(v) not in (float, int, type(None)))
        raise ValueError(f"{where}: token_logprobs position {position} is {value!r:.100} ({type(value).__name__}), not a "
                         "logprob (a number, or null when the server gave none)")
    missing = np.fromiter((v is None for v in values), dtype=bool, count=len(values))
    try:
        read = np.array([math.nan if v is None else v for v in values], dtype=np.float64)
    except OverflowError:  # an int beyond any float
        position = next(k for k, v in enumerate(values) if isinstance(v, int) and abs(v) > 1e308)
        raise ValueError(f"{where}'s token_logprobs: position {position} is {values[position]!r:.40}..., not a logprob "
                         "(finite and <= 0)") from None
    check_reference_logprobs(np.where(missing, -1.0, read), where=f"{where}'s token_logprobs")
    return ids, read
