"""The trainer's weights pushed into a vLLM engine in place, under their checkpoint names; the prefix cache reset."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import torch
from torch import nn

from loops_callbacks import run_warnings
from loops_callbacks.divergence.evidence import SamplerFacts
from loops_callbacks.integrations.vllm.engine import VLLMWarning, engine_config, engine_facts, import_vllm
from loops_callbacks.reference.fingerprint import clean_name
from loops_callbacks.validation import check, check_bool, check_int

_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def checkpoint_weights(module: nn.Module, *, prefix: str | None = None) -> dict[str, torch.Tensor]:
    """``module``'s weights (detached, not copied) under the names of its Hugging Face checkpoint.

    A Hugging Face model: its ``state_dict()``. Another module holding one Hugging Face model (a
    LightningModule with ``self.policy = AutoModelForCausalLM.from_pretrained(...)``): that model's,
    without the attribute's prefix. ``prefix="policy."``: the entries under that prefix, without it.
    Any other module: its ``state_dict()`` as it is. Wrappers' prefixes (``torch.compile``'s
    ``_orig_mod.``, FSDP's) are dropped first.

    Examples:
        >>> holder = nn.ModuleDict({"policy": nn.Linear(2, 2), "value_head": nn.Linear(2, 1)})
        >>> sorted(checkpoint_weights(holder, prefix="policy."))
        ['bias', 'weight']
    """
    check("module", module, nn.Module, "a torch.nn.Module (a LightningModule, a model)")
    if prefix is None:
        models = _outermost_hf_models(module)
        if len(models) > 1:
            raise ValueError(
                f"{type(module).__name__} holds {len(models)} Hugging Face models ({', '.join(models)}); say which to "
                f"push with prefix={models[0] + '.'!r}"
            )
        prefix = models[0] + "." if models else ""
    weights = {clean_name(name): tensor.detach() for name, tensor in module.state_dict(keep_vars=True).items()}
    chosen = {name[len(prefix) :]: tensor for name, tensor in weights.items() if name.startswith(prefix)}
    if not chosen:
        heads = sorted({name.split(".", 1)[0] + "." for name in weights})[:8]
        name = type(module).__name__
        raise ValueError(f"no weight of {name} starts with prefix {prefix!r}; its names start with {heads}")
    return chosen


def _outermost_hf_models(module: nn.Module) -> list[str]:
    """Names of the Hugging Face models inside ``module`` that are not inside another one ([]: ``module`` is one)."""
    transformers = sys.modules.get("transformers")  # a Hugging Face model cannot exist without it imported
    if transformers is None:
        return []
    found: list[str] = []
    for name, child in module.named_modules():
        if isinstance(child, transformers.PreTrainedModel) and not any(name.startswith(f + ".") for f in found):
            if not name:
                return []  # module is one: its own names are the checkpoint's
            found.append(clean_name(name + ".")[:-1])
    return found


def _reload_in_place(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> list[str]:
    """On each vLLM worker: reload ``weights`` in place; returns the engine parameters the load did not reach."""
    model = worker.model_runner.get_model()
    expected = {name.replace(".base_layer.", ".") for name, _ in model.named_parameters()}
    loaded: list[Any] = []
    load_weights = model.load_weights

    def recording(items: Any) -> Any:
        loaded.append(load_weights(items))
        return loaded[-1]

    model.load_weights = recording  # reload_weights calls it; its answer is the set of loaded names
    try:
        worker.model_runner.reload_weights(weights_iterator=iter(weights))
    finally:
        del model.load_weights
    return sorted(expected - set(loaded[0])) if loaded and loaded[0] is not None else []


def _not_the_rotary_false_alarm(record: logging.LogRecord) -> bool:
    """Drops vLLM's "RotaryEmbedding: Failed to load weights", logged at every in-place reload: the layer has no
    weights in a checkpoint and its cos/sin cache is put back as it was (the push checks every parameter)."""
    return record.getMessage() != "RotaryEmbedding: Failed to load weights"


class VLLMWeightSync:
    """Pushes a trainer's weights into a vLLM engine in place, resets its prefix cache and counts versions.

    Args:
        llm: the ``vllm.LLM`` to update (its workers reached by ``collective_rpc``).
        reset_prefix_cache: reset the engine's prefix cache after every push (the default).
            ``False`` exists only to show the fault: prompts sharing a prefix of full KV blocks are
            then served KV computed with the older weights (``stale_prefix_cache`` says so).
        prefix: where the model's weights are in the module pushed (``"policy."``); found by
            default (``checkpoint_weights``).

    ``push(module)`` sends ``checkpoint_weights(module)`` cast to the engine's dtype (the
    module's own tensors are never changed) through ``llm.collective_rpc`` into each worker's
    ``model_runner.reload_weights``. An engine parameter the pushed weights do not reach is a
    ``ValueError`` naming it (a partial load). Attributes:

    * ``version``: the version of the engine's weights: the ``version`` given to ``push``, else the
      trainer's ``global_step`` of a LightningModule attached to one, else one more than before
      (0 before any push: the engine's own checkpoint);
    * ``stale_prefix_cache``: whether weights were loaded since the prefix cache was last reset,
      with prefix caching on;
    * ``last_push_seconds``: the last push's time, cast, load and reset.

    ``facts(sampling_params)`` is the engine's ``SamplerFacts`` with both. The engine call::

        sync = VLLMWeightSync(llm)
        sync.push(pl_module)  # e.g. in on_train_batch_start
    """

    def __init__(self, llm: Any, *, reset_prefix_cache: bool = True, prefix: str | None = None) -> None:
        import_vllm("VLLMWeightSync")
        config = engine_config(llm)
        self.llm = llm
        self.reset_prefix_cache = check_bool("reset_prefix_cache", reset_prefix_cache)
        self.prefix = prefix if prefix is None else check("prefix", prefix, str, "a str such as 'policy.'")
        self.dtype: torch.dtype = config.model_config.dtype
        self.prefix_caching = bool(config.cache_config.enable_prefix_caching)
        self.version = 0
        self.stale_prefix_cache = False
        self.last_push_seconds: float | None = None
        logging.getLogger(_RELOAD_LOGGER).addFilter(_not_the_rotary_false_alarm)  # once: addFilter skips a known one

    def push(self, module: nn.Module, *, version: int | None = None) -> int:
        """Load ``module``'s weights into the engine in place; returns the new ``version``."""
        check_int("version (the trainer's optimizer steps of these weights)", version, least=0, optional=True)
        start = time.perf_counter()
        weights = [
            (name, tensor.to(self.dtype) if tensor.is_floating_point() else tensor)
            for name, tensor in checkpoint_weights(module, prefix=self.prefix).items()
        ]
        left = self.llm.collective_rpc(_reload_in_place, args=(weights,))  # per worker, what the load did not reach
        missing = sorted({name for names in left for name in names})
        self.stale_prefix_cache = self.prefix_caching
        if missing:
            raise ValueError(
                f"the push left {len(missing)} of the engine's parameters as they were (no pushed weight reached "
                f"them): {missing[:5]}{' ...' if len(missing) > 5 else ''}; the pushed names must be the checkpoint's "
                f"(checkpoint_weights(module) gave {sorted(name for name, _ in weights)[:3]} ...; pass prefix=)"
            )
        if self.reset_prefix_cache:
            self.clear_prefix_cache()
        trainer = getattr(module, "_trainer", None)
        if version is None:
            version = trainer.global_step if trainer is not None else self.version + 1
        self.version = version
        self.last_push_seconds = time.perf_counter() - start
        return self.version

    def clear_prefix_cache(self) -> bool:
        """Reset the engine's prefix cache (``llm.reset_prefix_cache()``); whether it was reset (a warning if not)."""
        reset = bool(self.llm.reset_prefix_cache())
        if reset:
            self.stale_prefix_cache = False
        else:
            run_warnings.warn(
                "vLLM did not reset its prefix cache (requests were running?): prompts sharing a prefix may be served "
                "KV computed with older weights until it is reset",
                VLLMWarning,
            )
        return reset

    def facts(self, sampling_params: Any) -> SamplerFacts:
        """The engine's ``SamplerFacts`` sampling with ``sampling_params``, with this sync's version and cache state."""
        return engine_facts(
            self.llm, sampling_params, weight_version=self.version, stale_prefix_cache=self.stale_prefix_cache
        )
