"""A fingerprint of a model's weights that is the same however they are placed or sharded.

``weights_fingerprint`` is the sha256 of the model's class, a ``tag`` (e.g. the scoring dtype)
and, sorted by name, every parameter's and buffer's name, dtype, shape and the sha256 of its
bytes. Names are taken without the wrappers' prefixes (FSDP's ``_fsdp_wrapped_module.``,
activation checkpointing's, ``torch.compile``'s ``_orig_mod.``), so a model gets the same
fingerprint in one process, replicated under DDP, or sharded under FSDP / FSDP2 on any number of
ranks, and a cache written by one run is found by the others.

Across ranks each tensor is hashed by one rank (tensor i by rank i % world_size) and the digests
are gathered, so the work is shared. Sharded weights are never gathered whole on one rank: an
FSDP2 ``DTensor`` is gathered one parameter at a time (``full_tensor()``), an FSDP (1) unit with
``use_orig_params=True`` one unit at a time (``summon_full_params(recurse=False)``); weights
sharded any other way (FSDP with flat parameters) are hashed shard by shard, a fingerprint that
then also depends on the layout.

Examples:
    >>> import torch
    >>> a = torch.nn.Linear(2, 2)
    >>> b = torch.nn.Linear(2, 2)
    >>> b.load_state_dict(a.state_dict())
    <All keys matched successfully>
    >>> weights_fingerprint(a) == weights_fingerprint(b), len(weights_fingerprint(a))
    (True, 64)
"""

from __future__ import annotations

import hashlib
import importlib
import re

import torch
from torch import nn

from loops_callbacks.distributed import ProcessGroup

__all__ = ["clean_name", "fsdp_classes", "weights_fingerprint"]

_WRAPPER_PREFIXES = re.compile(r"(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.")


def clean_name(name: str) -> str:
    """A parameter's name without wrapper prefixes.

    Examples:
        >>> clean_name("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.w")
        'layers.0.w'
    """
    return _WRAPPER_PREFIXES.sub("", name)


_DIGEST_CHUNK_BYTES = 64 << 20


def _digest(tensor: torch.Tensor) -> str:
    """sha256 of the tensor's bytes, copied to the host 64 MiB at a time.

    A copy, never a numpy view of the tensor's own memory: that would pin its storage (FSDP frees
    and regrows the storage of the weights it gathers).
    """
    flat = tensor.detach().contiguous().reshape(-1)
    digest = hashlib.sha256()
    step = max(1, _DIGEST_CHUNK_BYTES // max(1, flat.element_size()))
    for start in range(0, flat.numel(), step):
        chunk = flat[start : start + step].to("cpu", copy=True)
        digest.update(memoryview(chunk.view(torch.uint8).numpy()))
    return digest.hexdigest()


def _add(entries: dict[str, str], name: str, tensor: torch.Tensor) -> None:
    """``entries[name]``: the tensor's name, dtype, shape and digest, one line of the fingerprint."""
    entries[name] = f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|{_digest(tensor)}"


def fsdp_classes() -> tuple[type | None, type | None]:
    """FSDP (1)'s wrapper class and FSDP2's module class (of every module ``fully_shard`` has sharded); ``None`` for
    one that this torch lacks (no distributed, or older than FSDP2)."""
    try:
        fsdp = importlib.import_module("torch.distributed.fsdp")
    except ImportError:  # pragma: no cover - torch without distributed
        return None, None
    return fsdp.FullyShardedDataParallel, getattr(fsdp, "FSDPModule", None)


def weights_fingerprint(module: nn.Module, *, tag: str = "", group: ProcessGroup | None = None) -> str:
    """sha256 hex digest of ``module``'s weights and ``tag``; see the module docstring.

    Call it on every rank of the group at once when the weights are distributed (it gathers).
    ``module`` is the outermost module that holds the weights (for FSDP (1), the root wrapper).
    """
    group = group or ProcessGroup()
    entries = _entries(module, group)
    if group.world_size > 1:
        merged: dict[str, str] = {}
        for part in group.all_gather_objects(entries):
            merged.update(part)
        entries = merged
    model_class = _model_class(module)
    digest = hashlib.sha256(f"{model_class.__module__}.{model_class.__qualname__}|{tag}\n".encode())
    for name in sorted(entries):
        digest.update(f"{entries[name]}\n".encode())
    return digest.hexdigest()


def _model_class(module: nn.Module) -> type:
    """The model's own class: inside an FSDP (1) wrapper, and not FSDP2's dynamic ``FSDP<Class>`` subclass."""
    fsdp, fsdp2 = fsdp_classes()
    while fsdp is not None and isinstance(module, fsdp):
        module = module.module
    return next(c for c in type(module).__mro__ if fsdp2 is None or not issubclass(c, fsdp2))


def _entries(module: nn.Module, group: ProcessGroup) -> dict[str, str]:
    """This rank's share of the ``name -> entry`` lines."""
    fsdp, _ = fsdp_classes()
    if fsdp is not None and any(isinstance(m, fsdp) for m in module.modules()):
        return _fsdp1_entries(module, fsdp, group)
    entries: dict[str, str] = {}
    named = [*module.named_parameters(), *module.named_buffers()]
    for index, (name, tensor) in enumerate(named):
        if type(tensor).__name__ == "DTensor" and callable(getattr(tensor, "full_tensor", None)):  # FSDP2's
            tensor = tensor.full_tensor()  # a collective: every rank, every DTensor, in the same order
        if index % group.world_size == group.rank:
            _add(entries, clean_name(name), tensor)
    return entries


def _fsdp1_entries(module: nn.Module, fsdp: type, group: ProcessGroup) -> dict[str, str]:
    """FSDP (1): one unit's weights gathered at a time; flat parameters are hashed shard by shard."""
    entries: dict[str, str] = {}
    names = [name for name, _ in module.named_parameters()]
    if any("_flat_param" in name for name in names):
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            _add(entries, f"rank{group.rank}/{group.world_size}:{clean_name(name)}", tensor)
        return entries
    index = 0
    for unit_name, unit in module.named_modules():
        if not isinstance(unit, fsdp):
            continue
        nested = [f"{clean_name(n)}." for n, m in unit.named_modules() if isinstance(m, fsdp) and m is not unit]
        prefix = f"{clean_name(unit_name)}." if clean_name(unit_name) else ""
        with fsdp.summon_full_params(unit, recurse=False, writeback=False):
            for name, tensor in unit.named_parameters():
                local = clean_name(name)
                if any(local.startswith(p) for p in nested):
                    continue  # another unit's (still sharded) weight
                if index % group.world_size == group.rank:
                    _add(entries, prefix + local, tensor)
                index += 1
    for name, tensor in module.named_buffers():  # FSDP does not shard buffers
        if index % group.world_size == group.rank:
            _add(entries, clean_name(name), tensor)
        index += 1
    return entries
