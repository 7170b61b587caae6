"""Bridges to the engines that sample and score outside the trainer; each imports its engine only when used.

- ``vllm``: vLLM as the sampler (``LLM.generate`` outputs or a server's ``/v1/completions``
  answer into the monitor's padded batch, with the engine's ``SamplerFacts``), the in-place weight
  sync from the trainer, and ``VLLMSamplingClient``, a reference scorer on vLLM's prompt logprobs.

Examples:
    >>> from loops_callbacks.integrations import vllm
    >>> vllm.VLLM_INSTALL_HINT.startswith("pip install vllm")
    True
"""
