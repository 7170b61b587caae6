"""The policy as its own reference under FSDP2 and FSDP (1), on two CPU ranks (gloo), outside Lightning.

Lightning refuses FSDP on the CPU, so the strategies' wrapping is done by hand here, as Lightning
does it (FSDP (1) around the whole module with ``use_orig_params=True``; FSDP2 ``fully_shard`` on
each decoder layer and the root). A tiny Hugging Face Llama, so the output-head path runs inside
the sharded forward. Checked against one unsharded process: the same fingerprint, the same
values; and ranks with more batches than others (or none at all) do not hang, because every rank
runs the same number of forward passes.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np
import pytest
import torch

from loops_callbacks.reference.across_ranks import _shard_bounds, score_across_ranks
from loops_callbacks.reference.config import ReferenceConfig
from loops_callbacks.reference.policy import PolicyReference
from tests.helpers import free_port, run_two_ranks

transformers = pytest.importorskip("transformers", reason="the model is a tiny Hugging Face Llama")

VOCAB = 64
# one 60-token sequence, then many short ones: rank 0 gets the long one (one batch), rank 1 the
# rest (one batch each at a 24-token budget); the last case leaves rank 1 with nothing at all
SEQUENCES = [list(range(1, 61)), *[[(7 * i + j) % VOCAB for j in range(12)] for i in range(1, 6)]]
BUDGET = 24


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM(config)


def score(reference: Any, sequences: list[list[int]]) -> tuple[str, np.ndarray]:
    values, _ = score_across_ranks(sequences, reference, ReferenceConfig(progress=False))
    return reference.fingerprint(), values


def _worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        model = tiny_llama()
        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        reference = PolicyReference(model, device="cpu", max_tokens_per_batch=BUDGET)
        results["fsdp2"] = score(reference, SEQUENCES)
        results["fsdp2_path"] = reference.path
        results["fsdp2_sharded"] = type(next(model.parameters())).__name__
        results["fsdp2_one_sequence"] = score(reference, SEQUENCES[1:2])  # rank 1 scores nothing

        inner = tiny_llama()
        layer_class = type(inner.model.layers[0])
        root = FullyShardedDataParallel(
            inner,
            auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer_class}),
            use_orig_params=True,
            device_id=torch.device("cpu"),
        )
        reference = PolicyReference(inner, forward_module=root, device="cpu", max_tokens_per_batch=BUDGET)
        results["fsdp1"] = score(reference, SEQUENCES)
        results["fsdp1_path"] = reference.path
        full = sum(p.numel() for p in tiny_llama().parameters())
        results["fsdp1_sharded"] = sum(p.numel() for p in root.parameters()) < full  # this rank's shards only
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        torch.distributed.destroy_process_group()


def test_fsdp2_and_fsdp1_ranks_score_in_lockstep_and_agree_with_one_process(tmp_path: Any) -> None:
    lengths = np.array([len(s) for s in SEQUENCES])
    assert _shard_bounds(lengths, 1, 2) == [0, 1, 6]  # one batch on rank 0, five on rank 1

    ranks = run_two_ranks(_worker, (2, free_port(), str(tmp_path)), tmp_path, "the sharded forwards were not in lock-step")

    single = PolicyReference(tiny_llama(), max_tokens_per_batch=BUDGET)
    fingerprint, values = score(single, SEQUENCES)
    _, one = score(single, SEQUENCES[1:2])
    assert single.path == "output_head"
    for result in ranks:
        assert result["fsdp2_sharded"] == "DTensor" and result["fsdp1_sharded"]
        assert result["fsdp2_path"] == result["fsdp1_path"] == "output_head"
        for mode in ("fsdp2", "fsdp1"):
            got_fingerprint, got = result[mode]
            assert got_fingerprint == fingerprint, mode  # whatever the sharding, the same weights' key
            np.testing.assert_allclose(got, values, atol=1e-5, err_msg=mode)
        np.testing.assert_allclose(result["fsdp2_one_sequence"][1], one, atol=1e-5)
