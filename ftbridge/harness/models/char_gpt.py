"""A small GPT-style character language model.

Architecture: the decoder-only Transformer of Vaswani et al., "Attention Is
All You Need" (2017), in the pre-LayerNorm GPT-2 arrangement, following
Karpathy's nanoGPT (``model.py``): token and learned position embeddings,
``n_layer`` blocks of causal self-attention and a 4x GELU MLP, a final
LayerNorm and a linear head. Attention uses
:func:`torch.nn.functional.scaled_dot_product_attention` with
``is_causal=True``.

Differences from nanoGPT, for ZeRO and for exact equivalence tests:

* no weight tying between the token embedding and the head, so no parameter
  is shared by two modules (DeepSpeed ZeRO-3 handles shared parameters poorly);
* no dropout by default, so two runs with the same seed and data are
  bit-identical on the same hardware;
* the head has no bias.

With the defaults (4 layers, ``d_model`` 128, context 128) and the 89-character
Shakespeare vocabulary the model has 832,512 parameters
(``809,728 + 256 * vocab_size``).

Example::

    cfg = GPTConfig(vocab_size=89)
    model = build_model(cfg, seed=0)
    logits, loss = model(x, y)     # x, y: int64 (batch, T), T <= cfg.context
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(kw_only=True)
class GPTConfig:
    """Shape of a :class:`CharGPT`."""

    vocab_size: int
    """Number of token ids (characters), ``>= 1``."""

    context: int = 128
    """Longest sequence the model accepts (size of the position embedding)."""

    n_layer: int = 4
    """Number of Transformer blocks."""

    n_head: int = 4
    """Attention heads per block; must divide ``d_model``."""

    d_model: int = 128
    """Width of the residual stream; the MLP is ``4 * d_model`` wide."""

    dropout: float = 0.0
    """Dropout probability on attention, residual and embedding outputs; 0 keeps runs deterministic."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r} must be an int >= 1")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig.d_model={self.d_model} is not divisible by "
                             f"n_head={self.n_head}; pick n_head dividing d_model")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout!r} must be in [0, 1)")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: ``(B, T, C) -> (B, T, C)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, C // n_head)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: ``d_model -> 4 * d_model -> GELU -> d_model``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN Transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """GPT-style character language model (nanoGPT; Vaswani et al., 2017).

    Parameters are initialised from the global torch RNG as in nanoGPT
    (normal(0, 0.02), residual projections scaled by ``1 / sqrt(2 * n_layer)``,
    zero biases); use :func:`build_model` for a seeded, reproducible model.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.context, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for block in self.blocks:
            assert isinstance(block, Block)  # nn.ModuleList types its items as Module
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=resid_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=resid_std)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        """Next-token logits and, given targets, the mean cross-entropy.

        Args:
            idx: ``torch.int64`` token ids, shape ``(B, T)`` with ``1 <= T <= cfg.context``.
            targets: ``torch.int64`` next-token ids, shape ``(B, T)``, or ``None``.

        Returns:
            ``(logits, loss)``: logits of shape ``(B, T, vocab_size)`` in the
            parameters' dtype; loss a float32 scalar (computed in float32), or
            ``None`` without targets.

        Raises:
            ValueError: ``idx`` is not 2-D or longer than ``cfg.context``.
        """
        if idx.dim() != 2 or not 1 <= idx.shape[1] <= self.cfg.context:
            raise ValueError(f"idx has shape {tuple(idx.shape)}; expected (batch, T) with "
                             f"1 <= T <= context={self.cfg.context}")
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

    def param_count(self) -> int:
        """Number of parameters (full sizes, also under ZeRO-3 partitioning)."""
        return param_count(self)


def param_count(model: nn.Module) -> int:
    """Total number of parameters of ``model``.

    Under DeepSpeed ZeRO-3 a partitioned parameter's ``numel()`` is 0; its
    full size is in ``ds_numel``, which is used when present.
    """
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())


def build_model(cfg: GPTConfig, seed: int) -> CharGPT:
    """A :class:`CharGPT` whose parameters depend only on ``cfg`` and ``seed``.

    The same seed gives bit-identical parameters (float32, CPU); the global
    torch RNG state of the caller is restored afterwards.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return CharGPT(cfg)
