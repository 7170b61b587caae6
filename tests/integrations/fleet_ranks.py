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


def gather_fsdp2_on_each_rank(rank: int, port: int, out_dir: str) -> None:
    """A model sharded by FSDP2 (``fully_shard``, gloo, CPU): the weights the fleet would push, on each rank."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from loops_callbacks.integrations.vllm.fleet import VLLMServerFleet

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
        whole = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        mesh = init_device_mesh("cpu", (2,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        sharded = {name: tuple(p.to_local().shape) for name, p in model.named_parameters()}
        gathered = VLLMServerFleet(["http://127.0.0.1:9"])._gathered(model, sender=rank == 0)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
            "names": sorted(gathered), "equal": all(torch.equal(gathered[k], whole[k]) for k in gathered),
            "plain": all(type(t) is torch.Tensor for t in gathered.values()), "local_shapes": sharded,
        }))
    finally:
        dist.destroy_process_group()
