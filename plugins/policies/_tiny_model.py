"""The model behind the ``tiny`` policy (options and registration: :mod:`palestra.plugins.policies.tiny`).

A pre-norm decoder-only transformer: token embedding; blocks of RMSNorm -> causal multi-head
self-attention with rotary position embeddings (RoPE) -> residual, RMSNorm -> SwiGLU MLP -> residual;
a final RMSNorm; a linear head (tied to the embedding by default). Attention goes through
``torch.nn.functional.scaled_dot_product_attention`` with one boolean mask that combines causality and
key padding. The KV cache is a tuple with one ``(k, v)`` pair per layer, each ``[B, heads, S, head_dim]``,
grown by concatenation every step.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from palestra.config import check_options
from palestra.models.policy import CausalLMPolicy
from palestra.plugins.policies.char_tokenizer import CharTokenizer
from palestra.plugins.policies.tiny import TinyOptions

KVCache = tuple[tuple[torch.Tensor, torch.Tensor], ...]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_table(length: int, head_dim: int, base: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos`` and ``sin`` ``[length, head_dim / 2]``: the rotation angles of positions ``0 .. length - 1``."""
    half = head_dim // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64) / half)  # float64 on the CPU, once: exact angles
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq
    return angles.cos().float().to(device), angles.sin().float().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs ``(x[..., i], x[..., i + D/2])`` of ``x [..., L, D]`` by the position's angles
    (``cos``, ``sin``: ``[B, 1, L, D/2]``, broadcast over the leading dimensions)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def attention_mask_4d(attention_mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Boolean ``[B, 1, L, S]`` (True = may attend) for the last ``L = new_tokens`` of ``S`` positions.

    A query sees the real (mask True) keys at or before its own position. Every query may also see itself:
    that changes nothing for real tokens and keeps padded queries (left padding, finished rows) from having
    no key at all, which would make the softmax NaN.
    """
    s = attention_mask.shape[1]
    keys = torch.arange(s, device=attention_mask.device)
    queries = keys[s - new_tokens :, None]
    allowed = (keys <= queries) & attention_mask[:, None, :]
    allowed |= keys == queries
    return allowed[:, None]


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, length, d = x.shape
        qkv = self.qkv(x).view(b, length, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(qkv[:2], cos, sin).unbind(0)  # q and k rotated in one go: fewer ops per decoding step
        v = qkv[2]
        if past is not None:
            k = torch.cat((past[0], k), dim=2)
            v = torch.cat((past[1], v), dim=2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, length, d)), (k, v)


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=False)  # one matmul for both halves
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_ff: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(d_model)
        self.attn = Attention(d_model, n_heads)
        self.mlp_norm = RMSNorm(d_model)
        self.mlp = SwiGLU(d_model, d_ff)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        h, kv = self.attn(self.attn_norm(x), cos, sin, mask, past)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), kv

    def hidden_only(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self(x, cos, sin, mask)[0]


class TinyTransformerPolicy(CausalLMPolicy):
    """The ``tiny`` policy: see the module docstring; options in :class:`palestra.plugins.policies.tiny.TinyOptions`.

    ``state_dict()`` holds every tensor; together with :attr:`options` (which include the tokenizer's
    alphabet and atoms) it rebuilds the policy: ``TinyTransformerPolicy(**dataclasses.asdict(options))``.
    """

    tokenizer: CharTokenizer  # the base's Tokenizer, and more (to_transformers for export)

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options: TinyOptions = check_options(TinyOptions, options, where="policy.options")
        o = self.options
        self.tokenizer = CharTokenizer(o.alphabet, o.atoms, o.unknown)
        self._rope_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        vocab = len(self.tokenizer)
        self.embed = nn.Embedding(vocab, o.d_model)
        self.blocks = nn.ModuleList(Block(o.d_model, o.n_heads, o.d_ff) for _ in range(o.n_layers))
        self.norm = RMSNorm(o.d_model)
        self.lm_head = nn.Linear(o.d_model, vocab, bias=False)
        if o.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.reset_parameters()

    # ---- construction -----------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights; the projections back into the residual stream get init_std / sqrt(2 n_layers)
        (as in GPT-2) so the stream's variance does not grow with depth. ``options.seed`` makes it reproducible."""
        o = self.options
        gen = torch.Generator().manual_seed(o.seed) if o.seed is not None else None
        residual_std = o.init_std / math.sqrt(2 * o.n_layers)
        for name, param in self.named_parameters():  # a fixed order, so a seed always gives the same weights
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
            elif name.endswith(("attn.out.weight", "mlp.down.weight")):
                self._normal(param, residual_std, gen)
            else:
                self._normal(param, o.init_std, gen)

    @staticmethod
    def _normal(param: torch.Tensor, std: float, gen: torch.Generator | None) -> None:
        if gen is None or param.device.type == "cpu":
            nn.init.normal_(param, 0.0, std, generator=gen)
        else:  # the seeded generator lives on the CPU
            param.copy_(torch.randn(param.shape, generator=gen) * std)

    # ---- CausalLMPolicy ---------------------------------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return self.options.d_model

    def keep_untied(self) -> None:
        self.options.tie_embeddings = False

    def model_dims(self) -> dict[str, int]:
        o = self.options
        return {"layers": o.n_layers, "hidden": o.d_model, "heads": o.n_heads, "vocab": len(self.tokenizer)}

    @property
    def max_len(self) -> int:
        """The longest sequence (prompt + completion, padding included) the policy accepts."""
        return self.options.max_len

    def output_head(self) -> nn.Module:
        return self.lm_head

    def set_gradient_checkpointing(self, on: bool) -> None:
        """Per-block recomputation in training-mode forwards with gradients (``options.gradient_checkpointing``)."""
        self.options.gradient_checkpointing = bool(on)

    def layer_groups(self) -> dict[str, list[str]]:
        decoder = ["norm", "lm_head"] + (["value_head"] if self.value_head is not None else [])
        return {"embedding": ["embed"], "encoder": ["blocks"], "decoder": decoder}

    def trunk(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache | None = None,
        *,
        use_cache: bool = False,
    ) -> tuple[torch.Tensor, KVCache | None]:
        o = self.options
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids: expected shape [B, L], got {list(input_ids.shape)}")
        b, length = input_ids.shape
        past = 0 if not cache else cache[0][0].shape[2]
        total = past + length
        if tuple(attention_mask.shape) != (b, total):
            raise ValueError(
                f"attention_mask: expected shape [B, cached + new] = [{b}, {total}] ({past} cached), "
                f"got {list(attention_mask.shape)}"
            )
        if tuple(position_ids.shape) != (b, length):
            raise ValueError(
                f"position_ids: expected shape [{b}, {length}] like input_ids, got {list(position_ids.shape)}"
            )
        if total > o.max_len:
            raise ValueError(
                f"policy.options.max_len: a sequence of {total} tokens (prompt + completion, padding included) "
                f"is longer than max_len={o.max_len}; raise policy.options.max_len or shorten the prompt"
            )
        if (
            not cache and input_ids.numel()
        ):  # once per call (not per decoding step): out-of-range ids give a clear error
            low, high = int(input_ids.min()), int(input_ids.max())
            if low < 0 or high >= self.embed.num_embeddings:
                raise ValueError(
                    f"input_ids: ids must be in [0, {self.embed.num_embeddings}), got values in [{low}, {high}]"
                )

        x = self.embed(input_ids)
        cos, sin = self._rope(position_ids, x.dtype)
        mask = attention_mask_4d(attention_mask.to(torch.bool), length)
        recompute = (
            o.gradient_checkpointing and self.training and torch.is_grad_enabled() and not use_cache and not cache
        )
        new_cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, block in enumerate(self.blocks):
            if recompute:
                x = checkpoint(block.hidden_only, x, cos, sin, mask, use_reentrant=False)
                continue
            x, kv = block(x, cos, sin, mask, cache[i] if cache else None)
            if use_cache:
                new_cache.append(kv)
        return self.norm(x), (tuple(new_cache) if use_cache else None)

    def _rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sin`` ``[B, 1, L, head_dim / 2]`` for ``position_ids [B, L]``, looked up in a per-device table.

        The table is float32 and not a buffer: casting the model to bf16 must not round the angles, and it
        need not be saved. It is built on first use on each device (one table of max_len rows).
        """
        table = self._rope_tables.get(position_ids.device)
        if table is None:
            o = self.options
            table = rope_table(o.max_len, o.d_model // o.n_heads, o.rope_base, position_ids.device)
            self._rope_tables[position_ids.device] = table
        cos, sin = table
        return cos[position_ids][:, None].to(dtype), sin[position_ids][:, None].to(dtype)

    # ---- export -----------------------------------------------------------------------------------------
    def llama_config(self) -> Any:
        """The ``transformers.LlamaConfig`` whose model computes exactly this policy (see :meth:`to_transformers`)."""
        from transformers import LlamaConfig

        o, tok = self.options, self.tokenizer
        return LlamaConfig(
            vocab_size=len(tok),
            hidden_size=o.d_model,
            intermediate_size=o.d_ff,
            num_hidden_layers=o.n_layers,
            num_attention_heads=o.n_heads,
            num_key_value_heads=o.n_heads,
            head_dim=o.d_model // o.n_heads,
            hidden_act="silu",
            max_position_embeddings=o.max_len,
            rms_norm_eps=self.norm.eps,
            # transformers 4.x's name, which 5.x still takes (into rope_parameters) but leaves out of its signature
            rope_theta=o.rope_base,  # type: ignore[call-arg]
            attention_bias=False,
            mlp_bias=False,  # transformers 5 files it in rope_parameters
            attention_dropout=0.0,
            tie_word_embeddings=o.tie_embeddings,
            initializer_range=o.init_std,
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
        )

    def llama_state_dict(self) -> dict[str, torch.Tensor]:
        """This policy's weights under ``LlamaForCausalLM``'s names (the value head, if any, has no place there).

        The architectures agree piece by piece: pre-norm blocks with RMSNorm (eps 1e-6, weight only); attention
        without biases whose fused ``qkv`` rows are the q, k and v projections in that order (heads laid out the
        same way, ``view(..., heads, head_dim)``), RoPE rotating the pairs ``(i, i + head_dim / 2)`` as Llama's
        ``rotate_half`` does, ``1 / sqrt(head_dim)`` scaling; a SwiGLU MLP whose fused ``gate_up`` rows are
        ``gate_proj`` then ``up_proj``; a final RMSNorm; a bias-free head, tied or not.
        """
        out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": self.embed.weight}
        for i, module in enumerate(self.blocks):
            block = cast(Block, module)  # self.blocks holds the Blocks __init__ built, nothing else
            at = f"model.layers.{i}"
            q, k, v = block.attn.qkv.weight.chunk(3, dim=0)
            gate, up = block.mlp.gate_up.weight.chunk(2, dim=0)
            out.update(
                {
                    f"{at}.input_layernorm.weight": block.attn_norm.weight,
                    f"{at}.self_attn.q_proj.weight": q,
                    f"{at}.self_attn.k_proj.weight": k,
                    f"{at}.self_attn.v_proj.weight": v,
                    f"{at}.self_attn.o_proj.weight": block.attn.out.weight,
                    f"{at}.post_attention_layernorm.weight": block.mlp_norm.weight,
                    f"{at}.mlp.gate_proj.weight": gate,
                    f"{at}.mlp.up_proj.weight": up,
                    f"{at}.mlp.down_proj.weight": block.mlp.down.weight,
                }
            )
        out["model.norm.weight"] = self.norm.weight
        out["lm_head.weight"] = self.lm_head.weight  # the embedding itself when tied: Llama ties it the same way
        return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in out.items()}

    def to_transformers(self) -> Any:
        """A ``transformers.LlamaForCausalLM`` (eval mode, on the CPU, in the policy's dtype) with these weights: its
        logits equal the policy's up to float rounding (RoPE angles: float64 here, float32 in transformers)."""
        from transformers import LlamaForCausalLM

        dtype = self.embed.weight.dtype
        # Building the model draws its random init from torch's global generator: fork it, so exporting at the
        # end of a run changes nothing the run's random streams would see.
        with torch.random.fork_rng(devices=[]):
            model = LlamaForCausalLM(self.llama_config())
        model.load_state_dict(self.llama_state_dict(), strict=True)
        # transformers wraps PreTrainedModel.to in a decorator whose annotation loses the signature
        return model.to(dtype).eval()  # type: ignore[arg-type]

    def save_pretrained(self, folder: str | Path, *, merge_lora: bool = True, dtype: torch.dtype | None = None) -> None:
        """Write the policy as a transformers folder: a ``LlamaForCausalLM`` (``config.json``, ``model.safetensors``,
        ``generation_config.json``) in ``dtype`` (None: the policy's own) and its tokenizer
        (:meth:`CharTokenizer.to_transformers`), which ``AutoModelForCausalLM.from_pretrained(folder)`` /
        ``AutoTokenizer.from_pretrained(folder)`` load and ``policy: hf`` trains further. ``merge_lora`` is
        accepted like every policy's; tiny has no adapters."""
        del merge_lora  # nothing to merge: every weight is a plain tensor
        model = self.to_transformers()  # a copy: casting it leaves the policy as it is
        (model.to(dtype) if dtype is not None else model).save_pretrained(folder)
        self.tokenizer.to_transformers(model_max_length=self.options.max_len).save_pretrained(folder)

    def extra_repr(self) -> str:
        return f"vocab={len(self.tokenizer)}, params={sum(p.numel() for p in self.parameters())}"


__all__ = ["KVCache", "TinyTransformerPolicy"]
