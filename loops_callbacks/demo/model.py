"""A tiny causal transformer language model (``token_logprobs``, re-exported here, reads its logits).

The model is small enough to train on a CPU in a minute and has no dropout, so two copies with
the same weights and precision give the same logprobs (what the sampler/trainer gap is measured
against). Attention is causal, so right padding never changes the logits of earlier positions.

Two things serve the RL demo's sampler:

- ``KVCache``: ``model(new_ids, cache=cache)`` processes only the new tokens and attends to the
  keys and values of the earlier ones, so sampling n tokens costs one prompt pass and n - 1
  one-token passes instead of n passes over the whole sequence.
- ``compute_dtype``: a model whose parameters are bfloat16 but whose ``compute_dtype`` is float32
  computes like a bf16 inference engine without needing bf16 kernels (which CPUs without native
  bf16 emulate, several times slower than float32). Every tensor an engine would store in bf16
  is rounded to bf16 (weights, and the output of every embedding sum, layer norm, linear layer,
  GELU, residual add and attention; the logits), and every kernel runs in float32, as bf16
  kernels accumulate. Attention follows the flash-attention algorithm of PyTorch's bf16 kernels:
  float32 scores and softmax statistics, unnormalised probabilities rounded to bf16 before they
  multiply the values, normalised in float32. On this model the result agrees with PyTorch's
  native bf16 forward to within summation order (``tests/demo/test_demo_model.py`` checks it).

Examples:
    >>> import torch
    >>> model = TinyCausalLM(vocab_size=14, d_model=32, n_layers=1, n_heads=2, max_seq_len=16)
    >>> input_ids = torch.tensor([[1, 4, 5, 13]])
    >>> model(input_ids).shape
    torch.Size([1, 4, 14])
    >>> token_logprobs(model(input_ids[:, :-1]), input_ids[:, 1:]).shape
    torch.Size([1, 3])
    >>> cache = KVCache()
    >>> first, last = model(input_ids[:, :3], cache=cache), model(input_ids[:, 3:], cache=cache)
    >>> torch.allclose(last[:, -1], model(input_ids)[:, -1], atol=1e-5), cache.length
    (True, 4)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from loops_callbacks.logprobs import token_logprobs  # noqa: F401  (the demo's models read their logits with it)
from loops_callbacks.validation import check_int


class KVCache:
    """Per-layer attention keys and values of the tokens a ``TinyCausalLM`` has already seen.

    Pass the same (initially empty) cache to successive calls: the first gets the prompt, each
    later one only the tokens that follow. ``length`` is the number of positions cached.

    Examples:
        >>> import torch
        >>> model, cache = TinyCausalLM(vocab_size=8, d_model=16, n_layers=2, n_heads=2), KVCache()
        >>> _ = model(torch.zeros(3, 5, dtype=torch.long), cache=cache)
        >>> cache.length, len(cache.layers), tuple(cache.layers[0][0].shape)
        (5, 2, (3, 2, 5, 8))
    """

    def __init__(self) -> None:
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[2] if self.layers else 0

    def repeat_interleave(self, repeats: int) -> None:
        """Give each cached row ``repeats`` adjacent copies: several samples continuing one prompt
        share the prompt's keys and values, as an engine's prefix cache does."""
        self.layers = [(k.repeat_interleave(repeats, 0), v.repeat_interleave(repeats, 0)) for k, v in self.layers]


class _Numerics:
    """How one forward computes: ``storage`` = the dtype every stored tensor is rounded to (the
    parameters' dtype), ``compute`` = the dtype the kernels run in. Equal dtypes: the functional calls of the
    modules' own forwards, unrounded, so autocast (mixed precision) applies as usual."""

    def __init__(self, storage: torch.dtype, compute: torch.dtype) -> None:
        self.storage = storage
        self.compute = compute
        self.exact = storage == compute

    def round(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as the engine would store it: rounded to ``storage``, held in ``compute``."""
        return x if self.exact else x.to(self.storage).to(self.compute)

    def weight(self, parameter: torch.Tensor | None) -> torch.Tensor | None:
        return parameter if parameter is None or self.exact else parameter.to(self.compute)

    def linear(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return self.round(F.linear(x, self.weight(layer.weight), self.weight(layer.bias)))

    def layer_norm(self, norm: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight(norm.weight), self.weight(norm.bias)
        return self.round(F.layer_norm(x, norm.normalized_shape, weight, bias, norm.eps))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of the last ``Tq`` positions over all ``Tk`` keys (the earlier ones cached); ``[B, H, Tq, Dh]``."""
        queries, keys = q.shape[2], k.shape[2]
        offset = keys - queries  # the queries' first position
        causal = None
        if queries > 1:  # a query sees the keys up to its own position
            causal = torch.ones(queries, keys, dtype=torch.bool, device=q.device).tril(diagonal=offset)
        if self.exact:
            if causal is not None and offset == 0:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
        # A bf16 flash-attention kernel: float32 scores and row statistics, unnormalised
        # probabilities rounded to bf16 for the product with the values, float32 normalisation.
        scores = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
        if causal is not None:
            scores = scores.masked_fill(~causal, float("-inf"))
        unnormalised = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        total = unnormalised.sum(dim=-1, keepdim=True)
        return self.round((self.round(unnormalised) @ v) / total)


class _Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x MLP, each with a residual."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.attn_norm = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.attn_out = nn.Linear(d_model, d_model)
        self.mlp_norm = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(
        self, x: torch.Tensor, numerics: _Numerics, cache: KVCache | None = None, layer: int = 0
    ) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = numerics.linear(self.qkv, numerics.layer_norm(self.attn_norm, x)).split(width, dim=-1)
        # [B, T, D] -> [B, heads, T, D / heads]
        q, k, v = (t.view(batch, length, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            if layer < len(cache.layers):
                past_k, past_v = cache.layers[layer]
                k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
                cache.layers[layer] = (k, v)
            else:
                cache.layers.append((k, v))
        attended = numerics.attention(q, k, v).transpose(1, 2).reshape(batch, length, width)
        x = numerics.round(x + numerics.linear(self.attn_out, attended))
        hidden = numerics.round(self.mlp[1](numerics.linear(self.mlp[0], numerics.layer_norm(self.mlp_norm, x))))
        return numerics.round(x + numerics.linear(self.mlp[2], hidden))


class TinyCausalLM(nn.Module):
    """A GPT-style decoder: token + learned position embeddings, ``n_layers`` pre-norm blocks, a linear head.

    Args:
        vocab_size: number of token ids.
        d_model: width of the residual stream; a multiple of ``n_heads``.
        n_layers: number of transformer blocks.
        n_heads: attention heads per block.
        max_seq_len: longest sequence ``forward`` accepts.
        compute_dtype: dtype the kernels run in; ``None`` = the parameters' dtype. With bfloat16
            parameters and ``torch.float32``, the forward pass rounds every stored tensor to
            bfloat16 and computes in float32: a bf16 engine's numerics with float32 kernels (see
            the module docstring). An attribute, so a copy can be switched after ``.to(dtype)``.

    ``forward(input_ids [B, T], cache=None) -> logits [B, T, vocab_size]``; position k sees
    tokens 0..k only. With a ``KVCache`` the ids continue the cached sequence.

    Examples:
        >>> import torch
        >>> model = TinyCausalLM(vocab_size=8, d_model=16, n_layers=1, n_heads=2, max_seq_len=8)
        >>> model(torch.zeros(2, 5, dtype=torch.long)).shape
        torch.Size([2, 5, 8])
        >>> sampler = TinyCausalLM(vocab_size=8, d_model=16, n_heads=2, compute_dtype=torch.float32)
        >>> sampler = sampler.to(torch.bfloat16)  # bf16 weights, float32 kernels, bf16 rounding
        >>> logits = sampler(torch.zeros(2, 5, dtype=torch.long))
        >>> logits.dtype, torch.equal(logits, logits.bfloat16().float())
        (torch.float32, True)
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        max_seq_len: int = 32,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        sizes = {"vocab_size": vocab_size, "d_model": d_model, "n_layers": n_layers, "n_heads": n_heads,
                 "max_seq_len": max_seq_len}
        for name, value in sizes.items():
            check_int(f"TinyCausalLM {name}", value, least=1)
        if d_model % n_heads:
            raise ValueError(f"TinyCausalLM d_model={d_model} is not a multiple of n_heads={n_heads}")
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.compute_dtype = compute_dtype
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(max_seq_len, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, n_heads) for _ in range(n_layers))
        self.final_norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # Small weights: the untrained model's next-token distribution is close to uniform.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Logits ``[B, T, vocab_size]`` for ``input_ids [B, T]``, in ``compute_dtype`` (default:
        the parameters' dtype); with ``cache``, ``input_ids`` follow the cached positions."""
        if input_ids.dim() != 2:
            raise ValueError(f"TinyCausalLM expects input_ids of shape [B, T], got {tuple(input_ids.shape)}")
        start = cache.length if cache is not None else 0
        end = start + input_ids.shape[1]
        if end > self.max_seq_len:
            raise ValueError(f"TinyCausalLM got a sequence of length {end} > max_seq_len={self.max_seq_len}")
        storage = self.head.weight.dtype
        numerics = _Numerics(storage, self.compute_dtype or storage)
        positions = torch.arange(start, end, device=input_ids.device)
        tokens = F.embedding(input_ids, numerics.weight(self.token_embedding.weight))
        x = numerics.round(tokens + F.embedding(positions, numerics.weight(self.position_embedding.weight)))
        for layer, block in enumerate(self.blocks):
            x = block(x, numerics, cache, layer)
        return numerics.linear(self.head, numerics.layer_norm(self.final_norm, x))
