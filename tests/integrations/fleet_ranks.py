"""One rank of the fleet's DDP test (spawned twice, gloo): every rank pushes, rank 0 alone talks to the servers."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def push_on_each_rank(rank: int, urls: list[str], model_dir: str, weights_dir: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    from loops_callbacks.integrations.vllm import fleet as fleet_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["FLEET_TEST_PORT"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        called: list[str] = []
        talk = fleet_module.server_json

        def recorded(url: str, path: str, *args: Any, **kwargs: Any) -> Any:
            called.append(f"{url}{path}")
            return talk(url, path, *args, **kwargs)

        fleet_module.server_json = recorded
        model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        fleet = fleet_module.VLLMServerFleet(urls, weights_dir=weights_dir)
        version = fleet.push(model, version=7)
        pushed_calls = list(called)
        batch = fleet.rollouts([[5, 6, 7 + rank]], max_tokens=2)  # each rank samples its own prompts
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
            "version": version, "fleet_version": fleet.version,
            "server_versions": {url: state.version for url, state in fleet.servers.items()},
            "calls_during_push": pushed_calls, "policy_version": batch["policy_version"].tolist(),
            "synced": None if fleet.last_sync is None else sorted(fleet.last_sync.servers),
        }))
    finally:
        dist.destroy_process_group()
