"""The trainer's weights pushed into a vLLM engine in place, under their checkpoint names; the prefix cache reset."""

from __future__ import annotations

import functools
import logging
import sys
import time
from typing import Any

import torch
from torch import nn

from loops_callbacks import run_warnings
from loops_callbacks.divergence.batch import SamplerFacts
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

    given: list[tuple[str, torch.Tensor]] = []  # the weight the engine was last given

    def giving() -> Any:
        for weight in weights:
            given[:] = [weight]
            yield weight

    model.load_weights = recording  # reload_weights calls it; its answer is the set of loaded names
    try:
        worker.model_runner.reload_weights(weights_iterator=giving())
    except Exception as error:
        last = f" (the last weight it was given: {given[0][0]!r} of shape {tuple(given[0][1].shape)})" if given else ""
        try:
            _abandon_reload(worker, model)
        except Exception as cleanup:  # noqa: BLE001 - the push's own error is the one to raise
            last += f"; putting vLLM's waiting layers back failed too ({_described(cleanup)}): rebuild the engine"
        raise _LoadFailed(f"{_described(error)}{last}") from error
    finally:
        del model.load_weights
    return sorted(expected - set(loaded[0])) if loaded and loaded[0] is not None else []


class _LoadFailed(RuntimeError):
    """A worker's reload failed part way; the message says how, and the last weight it was given."""


def _described(error: BaseException) -> str:
    """``AssertionError: the message``, or the type alone when the message is empty; the first line of it (a
    worker's ``_LoadFailed``: its message)."""
    if isinstance(error, _LoadFailed):
        return str(error)
    said = str(error).partition("\n")[0]  # without an assertion's rewritten details
    return f"{type(error).__name__}: {said}" if said else type(error).__name__


def _abandon_reload(worker: Any, model: nn.Module) -> None:
    """After a reload that failed part way: vLLM's layers still waiting for weights are put back as they were (the
    layers it finished hold the new ones), so that the engine runs, and a later push can load, again."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, finalize_layerwise_reload
    except ImportError:  # a vLLM without the layerwise reload leaves no such state
        return
    waiting = [info for info in map(LAYERWISE_INFO.get, model.modules()) if info is not None and info.can_load()]
    if not waiting:
        return
    for info in waiting:  # what it buffered is dropped: finalizing then puts the layer's own tensors back
        info.loaded_weights.clear()
        info.load_numel = 0
    logger = logging.getLogger(_RELOAD_LOGGER)
    logger.addFilter(_not_failed_to_load)  # each restored layer says so: the push's error says it once
    try:
        finalize_layerwise_reload(model, worker.model_runner.model_config)
    finally:
        logger.removeFilter(_not_failed_to_load)


def _not_failed_to_load(record: logging.LogRecord) -> bool:
    return not record.getMessage().endswith(": Failed to load weights")


def _check_push(worker: Any, specs: list[tuple[str, tuple[int, ...], torch.dtype]]) -> tuple[list[str], list[str]]:
    """On each vLLM worker, before anything is written: each pushed name and shape loaded by the engine's own
    loaders into meta tensors of its parameters in checkpoint format, as its in-place reload loads them (no
    storage: nothing is written). Returns what cannot be loaded (name, shapes, the engine's error) and the
    parameters no pushed weight reaches."""
    model = worker.model_runner.get_model()
    expected = {name.replace(".base_layer.", ".") for name, _ in model.named_parameters()}
    target: list[tuple[str, tuple[int, ...]]] = []  # the engine parameter the last loader was called on
    kept = [(module, module._parameters) for module in model.modules()]
    try:
        for (prefix, module), (_, parameters) in zip(model.named_modules(), kept):
            module._parameters = _loadable(module, parameters, prefix, target)
        refused: list[str] = []
        loaded: set[str] | None = set()
        for name, shape, dtype in specs:
            target.clear()
            try:
                reached = model.load_weights(iter([(name, torch.empty(shape, dtype=dtype, device="meta"))]))
            except Exception as error:  # noqa: BLE001 - whatever the engine's loader says, with the weight's name
                into = f" into the engine's {target[0][0]!r} of shape {target[0][1]}" if target else ""
                refused.append(f"{name!r} of shape {shape}{into} ({_described(error)})")
                continue
            loaded = None if reached is None or loaded is None else loaded | set(reached)
    finally:
        for module, parameters in kept:
            module._parameters = parameters
    return refused, sorted(expected - loaded) if loaded is not None and not refused else []


def _loadable(module: nn.Module, parameters: dict[str, Any], prefix: str,
              target: list[tuple[str, tuple[int, ...]]]) -> dict[str, Any]:
    """``module``'s parameters as meta tensors of their class, with their attributes (their weight loaders, which
    tell ``target`` the parameter they load into): those vLLM recorded in checkpoint format when it built the model
    (what its in-place reload loads into; a kernel may have replaced a parameter since), else the module's own."""
    loadable = {name: _meta_copy(param) for name, param in parameters.items() if param is not None}
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
    except ImportError:  # a vLLM without the layerwise reload: the parameters as they are
        recorded = {}
    else:
        info = LAYERWISE_INFO.get(module)
        recorded = {name: restore_layer_refs(_meta_copy(param), module)
                    for name, param in (info.restore_metadata[0] if info is not None else {}).items()}
    loadable |= recorded
    for name, meta in loadable.items():
        for key in ("weight_loader", "_weight_loader"):  # a plain parameter's, or the property's of vLLM's own
            loader = meta.__dict__.get(key)
            if callable(loader):
                meta.__dict__[key] = _telling(loader, f"{prefix}.{name}".lstrip("."), meta, target)
    return loadable


def _meta_copy(param: torch.Tensor) -> torch.Tensor:
    """``param`` on the meta device, of its class and with its attributes (its weight loader); a loader wrapped by
    an unfinished reload is unwrapped, so that nothing is queued for it."""
    meta = param.data.to("meta")
    meta.__class__ = param.__class__
    meta.__dict__ = dict(param.__dict__)
    for key in ("weight_loader", "_weight_loader"):
        loader = meta.__dict__.get(key)
        while getattr(loader, "__name__", "") == "online_process_loader":
            loader = loader.__wrapped__
        if key in meta.__dict__:
            meta.__dict__[key] = loader
    return meta


def _telling(loader: Any, name: str, param: torch.Tensor, target: list[tuple[str, tuple[int, ...]]]) -> Any:
    """``loader``, telling ``target`` the name and shape of the parameter it loads into (its error may not)."""

    @functools.wraps(loader)
    def telling(*args: Any, **kwargs: Any) -> Any:
        target[:] = [(name, tuple(param.shape))]
        return loader(*args, **kwargs)

    return telling


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
    ``model_runner.reload_weights``. Before anything is written, each worker loads the pushed names
    and shapes into meta tensors of its parameters with its own loaders: a weight it cannot load
    (another shape, a name it does not have) and an engine parameter no pushed weight reaches (a
    partial load) are a ``ValueError`` naming them, as is a module on the meta device; the engine
    then holds the weights it held. A push that fails after that, part way, is a ``RuntimeError``,
    and until a push succeeds ``weights_unknown`` says that the engine holds neither the old weights
    nor the new ones. Attributes:

    * ``version``: the version of the engine's weights: the ``version`` given to ``push``, else the
      trainer's ``global_step`` of a LightningModule attached to one, else one more than before
      (0 before any push: the engine's own checkpoint);
    * ``stale_prefix_cache``: whether weights were loaded since the prefix cache was last reset,
      with prefix caching on;
    * ``weights_unknown``: whether a push failed part way (since the last push that succeeded);
    * ``last_push_seconds``: the last push's time, cast, check, load and reset.

    ``facts(sampling_params)`` is the engine's ``SamplerFacts`` with these three (the monitor's guard
    rail treats a step sampled from unknown weights as one it cannot trust). The engine call::

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
        self.weights_unknown = False
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
        meta = [name for name, tensor in weights if tensor.is_meta]
        if meta:
            more = f" (and {len(meta) - 1} more)" if len(meta) > 1 else ""
            raise ValueError(f"{meta[0]!r}{more} is on the meta device: it holds no values to push; materialize the "
                             "module's weights first (to_empty() and load them, or build it on a real device)")
        self._check(weights)
        self.weights_unknown, self.stale_prefix_cache = True, self.prefix_caching  # from here on they change
        try:
            left = self.llm.collective_rpc(_reload_in_place, args=(weights,))  # per worker, what it did not reach
        except Exception as error:
            raise RuntimeError(
                f"the push failed part way ({_described(error)}): the engine's weights are unknown until a push "
                "succeeds (weights_unknown, and facts().weights_unknown for the monitor)"
            ) from error
        missing = sorted({name for names in left for name in names})
        if missing:
            raise ValueError(
                f"the push left {len(missing)} of the engine's parameters as they were (no pushed weight reached "
                f"them): {missing[:5]}{' ...' if len(missing) > 5 else ''}; the pushed names must be the checkpoint's "
                f"(checkpoint_weights(module) gave {sorted(name for name, _ in weights)[:3]} ...; pass prefix=)"
            )
        self.weights_unknown = False
        if self.reset_prefix_cache:
            self.clear_prefix_cache()
        trainer = getattr(module, "_trainer", None)
        if version is None:
            version = trainer.global_step if trainer is not None else self.version + 1
        self.version = version
        self.last_push_seconds = time.perf_counter() - start
        return self.version

    def _check(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """A ``ValueError`` naming what the engine cannot load (each worker's loaders on meta tensors), before
        anything is written."""
        specs = [(name, tuple(tensor.shape), tensor.dtype) for name, tensor in weights]
        answers = self.llm.collective_rpc(_check_push, args=(specs,))  # per worker: (refused, not reached)
        refused = list(dict.fromkeys(text for cannot, _ in answers for text in cannot))
        missing = sorted({name for _, names in answers for name in names})
        if refused:
            raise ValueError(
                f"the push was refused before anything was written: {len(refused)} of its {len(weights)} weights "
                f"cannot be loaded into the engine: {'; '.join(refused[:8])}{' ...' if len(refused) > 8 else ''}"
            )
        if missing:
            raise ValueError(
                f"the push was refused before anything was written: it would leave {len(missing)} of the engine's "
                f"parameters as they were (no pushed weight reaches them): {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}; the pushed names must be the checkpoint's "
                f"(checkpoint_weights(module) gave {sorted(name for name, _ in weights)[:3]} ...; pass prefix=)"
            )

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
        )._replace(weights_unknown=self.weights_unknown)
