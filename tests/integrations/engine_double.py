"""A vLLM worker's model and runner, as ``VLLMWeightSync`` reaches them through ``collective_rpc`` (no vLLM)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class EngineModel(nn.Module):
    """What a vLLM worker's model offers: named parameters, and load_weights that loads as vLLM's loaders do (the
    shapes asserted, weight by weight, so a weight after a mis-shaped one is never reached), returning the names
    loaded. ``received`` records each weight's name and dtype; ``fail_at`` fails the engine at that weight, after
    the ones before it were written."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)
        self.head = nn.Linear(4, 16, bias=False)
        self.fail_at: str | None = None
        self.received: list[tuple[str, torch.dtype]] = []

    def load_weights(self, weights: Any) -> set[str]:
        params, loaded = dict(self.named_parameters()), set()
        for name, tensor in weights:
            self.received.append((name, tensor.dtype))
            param = params[name]  # a KeyError for a name the engine does not have
            assert param.size() == tensor.size(), f"Attempted to load weight ({tensor.size()}) into parameter ({param.size()})"
            param.data.copy_(tensor)
            loaded.add(name)
        return loaded


class Runner:
    """A worker's model runner: ``get_model`` and ``reload_weights``."""

    def __init__(self, model: EngineModel) -> None:
        self.model = model

    def get_model(self) -> EngineModel:
        return self.model

    def reload_weights(self, weights_iterator: Any) -> None:
        def failing(weights: Any) -> Any:
            for name, tensor in weights:
                if name == self.model.fail_at:
                    raise RuntimeError("the device went away")
                yield name, tensor

        self.model.load_weights(failing(weights_iterator))
