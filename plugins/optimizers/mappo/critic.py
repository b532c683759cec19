"""The ``mappo`` optimiser's centralised critic: a small causal transformer with a value head.

It reads ``[prefix tokens ; completion tokens]`` and gives a value for every completion token (the state that
predicts token ``t``, as :meth:`palestra.models.policy.CausalLMPolicy.score` aligns the policy's value head). The prefix
is the joint state text (MAPPO) or the agent's own prompt (IPPO), tokenised by the policy's tokenizer.

Why a separate network rather than a value head on the policy: the critic's input (the joint state) is not any
actor's input, so a head on the actors' trunk would need a second forward over other text anyway; and a
separate critic keeps value-loss gradients out of the layers the agents share (MAPPO, Yu et al. 2022, uses
separate actor and critic networks for the same reason). It is tiny (two blocks of width 64 by default), so
it costs a fraction of the policy's compute; the blocks are the ``tiny`` policy's (RoPE, RMSNorm, SwiGLU).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from palestra.models.policy import left_pad
from palestra.plugins.policies._tiny_model import (
    Block,
    RMSNorm,
    attention_mask_4d,
    rope_table,
)


class StateCritic(nn.Module):
    """Values ``[B, T]`` for completion tokens given a left-padded prefix (see the module docstring)."""

    def __init__(
        self,
        vocab: int,
        *,
        d_model: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        d_ff: int = 128,
        max_len: int = 512,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.max_len, self.head_dim, self.rope_base = max_len, d_model // n_heads, 10000.0
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, d_ff) for _ in range(n_layers))
        self.norm = RMSNorm(d_model)
        self.value_head = nn.Linear(d_model, 1)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    nn.init.ones_(p)
                elif name.startswith("value_head"):
                    nn.init.zeros_(p)  # V = 0 at the start: the first advantages are the plain (normalised) returns
                elif name.endswith(("attn.out.weight", "mlp.down.weight")):
                    nn.init.normal_(p, 0.0, init_std / math.sqrt(2 * n_layers))
                else:
                    nn.init.normal_(p, 0.0, init_std)
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(
        self,
        prefix_ids: torch.Tensor,
        prefix_mask: torch.Tensor,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
    ) -> torch.Tensor:
        p, t = prefix_ids.shape[1], completion_ids.shape[1]
        if p + t > self.max_len:
            raise ValueError(f"StateCritic: {p} prefix + {t} completion tokens exceed critic_max_len={self.max_len}")
        ids = torch.cat([prefix_ids, completion_ids], dim=1)
        mask = torch.cat([prefix_mask, completion_mask], dim=1)
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
        table = self._tables.get(ids.device)
        if table is None:
            table = self._tables[ids.device] = rope_table(self.max_len, self.head_dim, self.rope_base, ids.device)
        x = self.embed(ids)
        cos, sin = (tab[positions][:, None].to(x.dtype) for tab in table)
        attn = attention_mask_4d(mask, ids.shape[1])
        for block in self.blocks:
            x, _ = block(x, cos, sin, attn)
        states = self.norm(x)[:, p - 1 : p + t - 1]  # the state before each completion token
        return self.value_head(states).squeeze(-1).float() * completion_mask


def encode_prefixes(tokenizer, texts: list[str], room: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and mask of ``texts`` (BOS first when the tokenizer has one), each cut to its last
    ``room`` tokens: the most recent part of a long joint state is what the next value depends on most."""
    bos = tokenizer.bos_token_id
    rows = []
    for text in texts:
        ids = tokenizer.encode(text)
        ids = ([bos] if bos is not None else []) + ids
        rows.append(ids[-room:] if room > 0 else ids[-1:])
    return left_pad([r or [tokenizer.pad_token_id] for r in rows], tokenizer.pad_token_id, device)


__all__ = ["StateCritic", "encode_prefixes"]
