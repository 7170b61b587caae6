"""``VLLMServerFleet``'s inputs and its reading of vLLM's names, checksums and errors: no vLLM, no real server."""

from __future__ import annotations

import hashlib
import http.server
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from loops_callbacks.integrations.vllm import VLLMServerError, VLLMServerFleet
from loops_callbacks.integrations.vllm.fleet import engine_digests, engine_parameter_name
from tests.integrations.conftest import serving


def test_a_fleet_refuses_what_is_not_a_list_of_distinct_server_urls() -> None:
    with pytest.raises(ValueError, match="urls is empty: a fleet needs at least one vLLM server"):
        VLLMServerFleet([])
    with pytest.raises(ValueError, match=r"urls\[1\] must be a server's http://host:port, got 'node2:8000'"):
        VLLMServerFleet(["http://node1:8000", "node2:8000"])
    with pytest.raises(ValueError, match="urls names http://node1:8000 2 times; each server once"):
        VLLMServerFleet(["http://node1:8000", "http://node1:8000/"])
    with pytest.raises(ValueError, match=r"transport must be one of \['path', 'nccl'\], got 'ipc'"):
        VLLMServerFleet(["http://node1:8000"], transport="ipc")
    with pytest.raises(ValueError, match=r"on_server_error must be one of \['raise', 'drop'\], got 'ignore'"):
        VLLMServerFleet(["http://node1:8000"], on_server_error="ignore")
    with pytest.raises(ValueError, match=r"servers\[\.\.\.\]|not a server of the fleet"):
        VLLMServerFleet(["http://node1:8000"])._known("http://node9:8000")


def test_checkpoint_names_map_to_vllms_fused_parameters_and_their_checksums() -> None:
    assert engine_parameter_name("model.layers.3.self_attn.k_proj.weight") == "model.layers.3.self_attn.qkv_proj.weight"
    assert engine_parameter_name("model.layers.3.self_attn.o_proj.weight") == "model.layers.3.self_attn.o_proj.weight"
    q, k, v = torch.ones(4, 2), torch.zeros(2, 2), torch.full((2, 2), 2.0)
    digests = engine_digests({"a.self_attn.v_proj.weight": v, "a.self_attn.q_proj.weight": q,
                              "a.self_attn.k_proj.weight": k})
    fused = torch.cat([q, k, v]).numpy().tobytes()  # q, k, v in vLLM's order, whatever order they came in
    assert digests == {"a.self_attn.qkv_proj.weight": hashlib.sha256(fused).hexdigest()}


@pytest.fixture
def not_found_server() -> Iterator[str]:
    """A server that answers 404 on every route, as vLLM does without VLLM_SERVER_DEV_MODE on its weight routes."""

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"detail":"Not Found"}')

        do_POST = do_GET  # noqa: N815

        def log_message(self, *args: Any) -> None:
            pass

    with serving(NotFound) as url:
        yield url


def test_a_server_without_dev_mode_is_named_with_the_fix(not_found_server: str) -> None:
    url = not_found_server
    with pytest.raises(VLLMServerError, match=rf"vLLM server {url}, phase 'connect': {url}/server_info\?config_format="
                                              r"json answered 404 Not Found: the server has no weight routes: start it "
                                              r"with VLLM_SERVER_DEV_MODE=1"):
        VLLMServerFleet([url]).connect()
    with pytest.raises(ValueError, match=r"'weight' \(and 1 more\) is on the meta device"):
        VLLMServerFleet([url]).push(torch.nn.Linear(2, 2, device="meta"), version=1)


def test_a_head_tied_to_the_embeddings_is_found_as_a_copy() -> None:
    """vLLM has one parameter for tied weights (SmolLM2's head): the fleet sends the embeddings alone."""
    from loops_callbacks.integrations.vllm.fleet import _tied_copies

    embed, head = torch.nn.Embedding(4, 2), torch.nn.Linear(2, 4, bias=False)
    head.weight = embed.weight
    model = torch.nn.ModuleDict({"embed": embed, "head": head, "other": torch.nn.Linear(2, 4, bias=False)})
    assert _tied_copies({name: t.detach() for name, t in model.state_dict(keep_vars=True).items()}) == {
        "head.weight": "embed.weight"}


def test_under_fsdp2_rank_0_alone_holds_the_gathered_weights(tmp_path: Any) -> None:
    """Every rank takes part in gathering an FSDP2-sharded model (``full_tensor``, a collective); rank 0 keeps the
    full weights, equal to the unsharded model's, the other ranks nothing (two gloo ranks on the CPU)."""
    import json
    import socket

    from tests.integrations.fleet_ranks import gather_fsdp2_on_each_rank

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    torch.multiprocessing.spawn(gather_fsdp2_on_each_rank, args=(port, str(tmp_path)), nprocs=2)
    first, second = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert first["local_shapes"]["0.weight"] == [3, 4]  # sharded: half the rows on each rank
    assert first["names"] == ["0.bias", "0.weight", "1.bias", "1.weight"] and first["equal"] and first["plain"]
    assert second["names"] == []
