"""A tiny causal transformer language model, and per-token logprobs from its logits.

The model is small enough to train on a CPU in a minute and has no dropout, so two copies with
the same weights and precision give the same logprobs (what the sampler/trainer gap is measured
against). Attention is causal, so right padding never changes the logits of earlier positions.

Example:
    >>> import torch
    >>> model = TinyCausalLM(vocab_size=14, d_model=32, n_layers=1, n_heads=2, max_seq_len=16)
    >>> input_ids = torch.tensor([[1, 4, 5, 13]])
    >>> model(input_ids).shape
    torch.Size([1, 4, 14])
    >>> token_logprobs(model(input_ids[:, :-1]), input_ids[:, 1:]).shape
    torch.Size([1, 3])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyCausalLM", "token_logprobs"]


def token_logprobs(logits: torch.Tensor, target_tokens: torch.Tensor) -> torch.Tensor:
    """``out[b, k] = log p(target_tokens[b, k])`` under ``logits[b, k]``, computed in float32.

    Args:
        logits: ``[B, T, V]`` in any floating dtype (bfloat16 under mixed precision).
        target_tokens: ``[B, T]`` token ids.

    Returns:
        ``[B, T]`` float32 logprobs (float64 if the logits are float64), differentiable.
    """
    if logits.shape[:-1] != target_tokens.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and target_tokens {tuple(target_tokens.shape)} "
            "do not share the [B, T] dimensions"
        )
    logprobs = torch.log_softmax(logits.float() if logits.dtype != torch.float64 else logits, dim=-1)
    return logprobs.gather(-1, target_tokens.long().unsqueeze(-1)).squeeze(-1)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(width, dim=-1)
        # [B, T, D] -> [B, heads, T, D / heads]
        q, k, v = (t.view(batch, length, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.mlp_norm(x))


class TinyCausalLM(nn.Module):
    """A GPT-style decoder: token + learned position embeddings, ``n_layers`` pre-norm blocks, a linear head.

    Args:
        vocab_size: number of token ids.
        d_model: width of the residual stream; a multiple of ``n_heads``.
        n_layers: number of transformer blocks.
        n_heads: attention heads per block.
        max_seq_len: longest sequence ``forward`` accepts.

    ``forward(input_ids [B, T]) -> logits [B, T, vocab_size]``; position k sees tokens 0..k only.

    Example:
        >>> import torch
        >>> model = TinyCausalLM(vocab_size=8, d_model=16, n_layers=1, n_heads=2, max_seq_len=8)
        >>> model(torch.zeros(2, 5, dtype=torch.long)).shape
        torch.Size([2, 5, 8])
    """

    def __init__(
        self, vocab_size: int, d_model: int = 64, n_layers: int = 2, n_heads: int = 4, max_seq_len: int = 32
    ) -> None:
        super().__init__()
        for name, value in (
            ("vocab_size", vocab_size),
            ("d_model", d_model),
            ("n_layers", n_layers),
            ("n_heads", n_heads),
            ("max_seq_len", max_seq_len),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TinyCausalLM {name} must be a positive int, got {value!r}")
        if d_model % n_heads:
            raise ValueError(f"TinyCausalLM d_model={d_model} is not a multiple of n_heads={n_heads}")
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
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

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, vocab_size]`` for ``input_ids [B, T]`` (in the model's parameter dtype)."""
        if input_ids.dim() != 2:
            raise ValueError(f"TinyCausalLM expects input_ids of shape [B, T], got {tuple(input_ids.shape)}")
        length = input_ids.shape[1]
        if length > self.max_seq_len:
            raise ValueError(f"TinyCausalLM got a sequence of length {length} > max_seq_len={self.max_seq_len}")
        positions = torch.arange(length, device=input_ids.device)
        x = self.token_embedding(input_ids) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))
