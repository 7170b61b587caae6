"""Test-wide settings: W&B never touches the network and writes under a temporary directory."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_DIR", tempfile.mkdtemp(prefix="loops-callbacks-wandb-"))
