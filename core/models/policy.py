"""The base every built-in policy stands on: :class:`CausalLMPolicy`.

A policy is a causal language model with a tokenizer. Subclasses supply three things: the trunk
(token ids -> final hidden states, with an opaque KV cache), the output head, and the tokenizer. This base
then provides, the same way for our own transformer and for a HuggingFace model:

* :meth:`encode_observations`: observations -> left-padded prompt ids and mask;
* :meth:`score`: log-probs and entropy of completion tokens, plus per-token values when a value head is enabled
  (PPO). When the output head is a plain ``nn.Linear`` and the logits would be large
  (:data:`FUSED_HEAD_MIN_LOGIT_BYTES`) and no autocast is active, the head and the log-prob kernel run as one op,
  :func:`palestra.kernels.linear_logprob_entropy`, over the real completion tokens only: no ``[B, T, V]`` logits
  are kept for the backward pass, and padding costs nothing. Any other head (a LoRA-wrapped one, say) goes through
  :meth:`logits` and :func:`palestra.kernels.logprob_entropy` (never an fp32 ``[B, T, V]`` copy);
* :meth:`decode_step`: one incremental forward with the KV cache, which the samplers
  (:mod:`palestra.models.sampling`) drive.

Position ids are counted over real tokens only (``cumsum(mask) - 1``), so a left-padded row gives the
same numbers as the same row unpadded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from palestra.types import AgentId, Observation

# score() fuses the output head with the log-prob kernel (palestra.kernels.linear_logprob_entropy) only when the
# fp32 logits of a call would take at least this much memory: the fused op never keeps them, but on a CPU it is
# about 0.9x the speed of the unfused path (docs/kernels.md), so small heads (the tiny policy's) stay unfused.
FUSED_HEAD_MIN_LOGIT_BYTES = 32 * 2**20


@runtime_checkable
class Tokenizer(Protocol):
    """What a policy needs from a tokenizer. ``encode`` adds no special tokens."""

    pad_token_id: int
    eos_token_id: int
    bos_token_id: int | None

    def __len__(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@runtime_checkable
class ShapeAware(Protocol):
    """A policy that states its shape for memory estimates (optional): every :class:`CausalLMPolicy` does, and a
    multi-agent policy answers for its base."""

    def model_dims(self) -> dict[str, int]: ...


@dataclass
class TokenScores:
    """What :meth:`CausalLMPolicy.score` returns; every tensor is float32 ``[B, T]`` and 0 where masked."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    values: torch.Tensor | None = None


def left_pad(rows: Sequence[Sequence[int]], pad_token_id: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows as one left-padded ``[B, width]`` id tensor and its mask, on ``device`` (prompts end flush right,
    so that generation continues every row at the same column)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(list(r), dtype=torch.int64)
        mask[i, width - len(r) :] = True
    return ids.to(device), mask.to(device)


def attended(completion_mask: torch.Tensor) -> torch.Tensor:
    """The completion positions a forward reads: every position up to each row's last trained one. Completions are
    right-padded, so for a single turn this is ``completion_mask`` itself; a multi-turn episode trained as one
    sequence also holds untrained text between its turns (what the environment said), which the model must read."""
    return torch.flip(torch.flip(completion_mask, [-1]).long().cumsum(-1), [-1]) > 0


class CausalLMPolicy(torch.nn.Module):
    """A causal LM policy (see the module docstring). Subclasses implement :meth:`trunk` and :meth:`output_head`."""

    tokenizer: Tokenizer

    @property
    def value_head(self) -> torch.nn.Linear | None:
        # A property, not a class attribute defaulting to None: a class attribute would shadow the submodule
        # that nn.Module registers when enable_value_head() assigns one, so self.value_head would stay None.
        return self._modules.get("value_head")  # type: ignore[return-value]

    # ---- what a subclass provides ------------------------------------------------------------------
    def trunk(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any = None,
        *,
        use_cache: bool = False,
    ) -> tuple[torch.Tensor, Any]:
        """Hidden states ``[B, L, H]`` after the final norm for ``input_ids [B, L]``, and the updated cache.

        ``attention_mask [B, S]`` covers the cached tokens and the new ones (``S = cached + L``);
        ``position_ids [B, L]`` are the new tokens' positions. With ``use_cache`` the returned cache holds
        every token so far; without it the second element is None.
        """
        raise NotImplementedError

    def output_head(self) -> torch.nn.Module:
        """The module mapping hidden states ``[..., H]`` to logits ``[..., V]``."""
        raise NotImplementedError

    @property
    def hidden_size(self) -> int:
        raise NotImplementedError

    def keep_untied(self) -> None:
        """Record that the input embedding and the output head no longer share one weight (multi-agent sharing
        gave them separate copies), so that the policy never ties them again. Nothing to record by default."""

    def model_dims(self) -> dict[str, int]:
        """``layers``, ``hidden``, ``heads``, ``vocab``: what the automatic micro-batch size estimates activation
        memory from. This default guesses from the parameter count (``12 * layers * hidden**2`` per transformer);
        a subclass that knows its shape says so."""
        hidden = int(self.hidden_size)
        params = sum(p.numel() for p in self.parameters())
        layers = max(1, round(params / (12 * hidden * hidden)))
        return {"layers": layers, "hidden": hidden, "heads": max(1, hidden // 64), "vocab": len(self.tokenizer)}

    def layer_groups(self) -> dict[str, list[str]]:
        """Module-name prefixes of the layer groups multi-agent sharing works in (:mod:`palestra.multiagent.sharing`):
        ``embedding`` (token embedding), ``encoder`` (the transformer blocks), ``decoder`` (final norm, output
        head, value head). Every parameter lies under exactly one prefix (a tied weight under two)."""
        raise NotImplementedError(f"{type(self).__name__} does not define layer_groups(); multi-agent sharing needs it")

    def prompt_text(self, observation: Observation) -> str:
        """The text of one observation's prompt, as :meth:`encode_prompt` encodes it: ``observation.prompt`` here;
        a chat policy renders ``observation.messages`` (and ``observation.tools``) with its template. A multi-turn
        episode trains as one sequence when each turn's text extends the last (:mod:`palestra.engine.trajectory`)."""
        return observation.prompt

    def encode_prompt(self, observation: Observation) -> list[int]:
        """Token ids of one observation's prompt: :meth:`prompt_text`, encoded."""
        return self.tokenizer.encode(self.prompt_text(observation))

    def prefix_preserving(self) -> bool:
        """Whether each turn's prompt text extends the last turn's prompt and completion (so an episode can train as one
        sequence). True for a plain-text prompt; a chat policy asks its template."""
        return True

    def token_text(self, token_id: int) -> str:
        """The text a special token stands for in a rendered prompt (an end-of-turn marker such as ``<|im_end|>``);
        "" when it has none. The one-sequence trajectory drops it from the text that follows a turn it ended."""
        del token_id
        return ""

    # ---- provided -------------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def for_agent(self, agent_id: AgentId) -> CausalLMPolicy:
        """The policy that plays ``agent_id``: this one, for every agent (one set of weights; a multi-agent policy
        answers with that agent's view). The rollout samples rows played by the same policy in one batch."""
        del agent_id
        return self

    def encode_observations(self, observations: Sequence[Observation]) -> tuple[torch.Tensor, torch.Tensor]:
        """Left-padded ``prompt_ids [B, P]`` (int64) and ``prompt_mask [B, P]`` (bool) on the policy's device.

        ``observation.token_ids`` wins when the environment set it; otherwise :meth:`encode_prompt`, with the
        tokenizer's BOS in front when it has one.
        """
        tok = self.tokenizer
        rows: list[list[int]] = []
        for i, obs in enumerate(observations):
            ids = list(obs.token_ids) if obs.token_ids is not None else self.encode_prompt(obs)
            if obs.token_ids is None and tok.bos_token_id is not None and (not ids or ids[0] != tok.bos_token_id):
                ids = [tok.bos_token_id, *ids]
            if not ids:
                raise ValueError(f"observations[{i}]: the prompt encodes to no tokens (prompt {obs.prompt!r})")
            rows.append(ids)
        return left_pad(rows, tok.pad_token_id, self.device)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., len(tokenizer)]`` for hidden states ``[..., H]``.

        A model whose output head has more rows than the tokenizer has tokens (vocabularies padded to a
        multiple of 64 or 128, as Qwen's are) must never sample those ids, which no text decodes to; the head
        is sliced to the tokenizer's size before the matmul, so they are neither sampled nor normalised over,
        and nothing is copied.
        """
        head = self.output_head()
        n = len(self.tokenizer)
        if isinstance(head, torch.nn.Linear) and head.out_features > n:
            bias = None if head.bias is None else head.bias[:n]
            return torch.nn.functional.linear(states, head.weight[:n], bias)
        out = head(states)
        return out[..., :n] if out.shape[-1] > n else out

    def fusable_head(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``(weight, bias)`` of the output head, sliced to the tokenizer's size as :meth:`logits` slices them, when
        :meth:`score` may run the head fused with the log-prob kernel; ``None`` when it must call the head.

        Fusable: the base :meth:`logits` and a head that is exactly ``torch.nn.Linear`` without forward hooks. A
        subclass of it, or any other module (peft's LoRA ``Linear``, a quantised layer), has a forward of its own
        that the fused op would skip, and so has a hook.
        """
        head = self.output_head()
        if type(self).logits is not CausalLMPolicy.logits or type(head) is not torch.nn.Linear:
            return None
        if head._forward_hooks or head._forward_pre_hooks:
            return None
        n = len(self.tokenizer)
        if head.out_features > n:
            return head.weight[:n], None if head.bias is None else head.bias[:n]
        return head.weight, head.bias

    def set_gradient_checkpointing(self, on: bool) -> None:
        """Recompute activations in the backward pass instead of keeping them (``train.gradient_checkpointing``).

        Policies that can override this; the base refuses to turn it on with a one-line error.
        """
        if on:
            from palestra.errors import ConfigError

            raise ConfigError(
                f"train.gradient_checkpointing: the policy {type(self).__name__} does not support gradient "
                "checkpointing; set it to false"
            )

    def enable_value_head(self) -> torch.nn.Linear:
        """Add (once) a linear value head on the final hidden states; its parameters join :meth:`parameters`."""
        if self.value_head is None:
            head = torch.nn.Linear(self.hidden_size, 1)
            torch.nn.init.zeros_(head.weight)  # start from V = 0: the first advantages are the plain returns
            torch.nn.init.zeros_(head.bias)
            ref = next(self.output_head().parameters())
            # nn.Module.__setattr__ registers the submodule (the property only reads it back): not a property write
            self.value_head = head.to(device=ref.device, dtype=ref.dtype)  # type: ignore[misc]
        return self.value_head

    def score(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        *,
        temperature: float = 1.0,
        entropy: bool = True,
        values: bool = False,
        agent_ids: Sequence[AgentId] | None = None,
    ) -> TokenScores:
        """Log-probs (and entropy, and values) of each completion token given everything before it.

        Differentiable with respect to the parameters. ``values`` needs :meth:`enable_value_head` first; the
        value at token ``t`` is the head applied to the state that predicts token ``t``. ``agent_ids`` (one per
        row) is accepted from every caller and ignored: one set of weights plays every agent (see
        :meth:`for_agent`); a multi-agent policy routes rows by it.
        """
        del agent_ids
        # imported here so that listing plugins stays light
        from palestra.kernels import linear_logprob_entropy, logprob_entropy

        p = prompt_ids.shape[1]
        t = completion_ids.shape[1]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        mask = torch.cat([prompt_mask, attended(completion_mask)], dim=1)
        position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
        hidden, _ = self.trunk(input_ids, mask, position_ids)
        states = hidden[:, p - 1 : p + t - 1]  # the state before each completion token predicts it
        head = self.fusable_head()
        if head is not None and completion_ids.numel() * head[0].shape[0] * 4 < FUSED_HEAD_MIN_LOGIT_BYTES:
            head = None  # small logits: the fused op would save little memory and costs one more matmul
        if head is not None and torch.is_autocast_enabled(states.device.type):
            # Under autocast (train.precision=bf16/fp16) the head runs as autocast runs a linear layer, in the low
            # precision: the fused op computes its logits in fp32, and its four fp32 head matmuls were a third of a
            # bf16 SmolLM2 update on a CPU with bf16 matrix units (docs/performance.md).
            head = None
        ent: torch.Tensor | None
        if head is None:
            logits = self.logits(states)
            tokens = completion_ids.masked_fill(~completion_mask, -100)
            logp, ent = logprob_entropy(logits, tokens, temperature=temperature, ignore_index=-100)
        else:
            # Only the real completion tokens' states go through the head; the rest stay 0, as the kernel's
            # ignored positions would be.
            keep = completion_mask.bool()
            weight, bias = head
            logp_kept, ent_kept = linear_logprob_entropy(
                states[keep], weight, bias, completion_ids[keep], temperature, entropy
            )
            zeros = states.new_zeros(keep.shape, dtype=torch.float32)
            logp = zeros.masked_scatter(keep, logp_kept)
            ent = None if ent_kept is None else zeros.masked_scatter(keep, ent_kept)
        out = TokenScores(logprobs=logp, entropy=ent if entropy else None)
        if values:
            if self.value_head is None:
                raise RuntimeError(f"{type(self).__name__}.score(values=True): call enable_value_head() first")
            v = self.value_head(states).squeeze(-1).float()
            out.values = v * completion_mask
        return out

    def token_logprobs(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
        agent_ids: Sequence[AgentId] | None = None,
    ) -> torch.Tensor:
        return self.score(
            prompt_ids, prompt_mask, completion_ids, completion_mask, entropy=False, agent_ids=agent_ids
        ).logprobs

    @torch.no_grad()
    def decode_step(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: Any,
        *,
        agent_ids: Sequence[AgentId] | None = None,
    ) -> tuple[torch.Tensor, Any]:
        """Logits ``[B, V]`` (float32) for the token after ``input_ids [B, L]``, and the extended cache.

        ``agent_ids`` (one per row) is ignored, as in :meth:`score`: one set of weights plays every agent."""
        del agent_ids
        hidden, cache = self.trunk(input_ids, attention_mask, position_ids, cache, use_cache=True)
        return self.logits(hidden[:, -1]).float(), cache


__all__ = ["CausalLMPolicy", "ShapeAware", "TokenScores", "Tokenizer"]
