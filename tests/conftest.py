"""Test-wide settings: W&B never touches the network and writes under a temporary directory."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_DIR", tempfile.mkdtemp(prefix="loops-callbacks-wandb-"))


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and on a shared CPU they cost a lot."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
