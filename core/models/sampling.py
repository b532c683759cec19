"""Batched sampling with a KV cache: :func:`sample` (token ids in) and :func:`generate` (observations in).

Works with any :class:`palestra.models.policy.CausalLMPolicy`: the prompt is prefilled with one
``policy.decode_step`` call, then every step feeds one token per row and reuses the cache. Rows end on
the tokenizer's EOS, on ``params.stop_token_ids``, on a stop string, or at their length limit:
``params.max_new_tokens``, or a row's own smaller cap (``Observation.max_new_tokens``); finished rows are fed
padding (masked out) until every row is done, which ends the loop early.

The result follows the completion conventions of :class:`palestra.types.Generation`:

* ``completion_ids [B, T]`` right-padded with the pad id, ``T`` = the longest completion;
* ``completion_mask`` True on every sampled token, including the EOS (or stop token) that ended the row;
* ``texts`` decode the completion without that EOS / stop token; a stop *string* that ended the row is
  part of the text (and of the tokens);
* ``logprobs`` (float32, 0 where masked) are ``log_softmax(logits / temperature)`` at the sampled token,
  before any top-p filtering, at temperature 1 for greedy decoding: exactly what
  ``policy.score(..., temperature=params.temperature or 1.0)`` gives for the same tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from palestra.types import AgentId, Generation, Observation, SamplingParams


def check_params(params: SamplingParams) -> None:
    """Raise a one-line ValueError naming the first bad field of ``params``."""
    n = params.max_new_tokens
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"SamplingParams.max_new_tokens: expected an integer >= 0, got {n!r}")
    t = params.temperature
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise ValueError(f"SamplingParams.temperature: expected a finite number >= 0 (0 = greedy), got {t!r}")
    p = params.top_p
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
        raise ValueError(f"SamplingParams.top_p: expected a number in (0, 1], got {p!r}")
    for i, s in enumerate(params.stop):
        if not isinstance(s, str) or not s:
            raise ValueError(f"SamplingParams.stop[{i}]: expected a non-empty string, got {s!r}")
    for i, token_id in enumerate(params.stop_token_ids):
        if isinstance(token_id, bool) or not isinstance(token_id, int):
            raise ValueError(f"SamplingParams.stop_token_ids[{i}]: expected an integer token id, got {token_id!r}")


def pick_tokens(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits [B, V]`` and its behaviour log-prob (float32), both ``[B]``.

    ``temperature == 0`` is greedy (log-prob at temperature 1). Otherwise the token is drawn from
    ``softmax(logits / temperature)`` restricted to the nucleus: the smallest set of most likely tokens whose
    mass reaches ``top_p`` (the top token always stays). The draw is one uniform number per row, turned into
    a token by inverse-CDF; that uses ``generator`` from any device and never picks a token of probability 0.

    The CDF runs over the probabilities sorted in descending order (the nucleus is a prefix of that order), except
    with ``top_p == 1`` and a vocabulary of more than :data:`SORTED_DRAW_MAX_VOCAB` tokens: there it runs over the
    vocabulary in id order (:func:`_draw_in_id_order`), which draws from the same distribution without sorting
    the vocabulary (a sort of ``[64, 32000]`` took 0.4 s per token on a CPU). Small vocabularies keep the sorted
    draw, which costs nothing there, so that their seeded runs sample what they always have.
    """
    logits = logits.float()
    if temperature == 0:
        token = logits.argmax(-1, keepdim=True)
        return token.squeeze(-1), torch.log_softmax(logits, -1).gather(-1, token).squeeze(-1)
    scaled = logits if temperature == 1 else logits / temperature
    if top_p >= 1 and logits.shape[-1] > SORTED_DRAW_MAX_VOCAB:
        probs = torch.softmax(scaled, dim=-1)
        token = _draw_in_id_order(probs, _uniform(logits, generator))
        return token.squeeze(-1), probs.gather(-1, token).log_().squeeze(-1)
    logp_all = torch.log_softmax(scaled, dim=-1)
    probs, order = logp_all.exp().sort(dim=-1, descending=True, stable=True)
    if top_p < 1:
        before = probs.cumsum(-1) - probs  # mass of the more likely tokens: keep while it is below top_p
        probs = probs.masked_fill(before >= top_p, 0.0)
    cdf = probs.cumsum(-1)
    u = _uniform(logits, generator)
    index = (cdf <= u * cdf[:, -1:]).sum(-1, keepdim=True)
    # Rounding can push the index past the last token of positive probability (probabilities are sorted, so
    # those form a prefix): clamp it back.
    index = torch.minimum(index, (probs > 0).sum(-1, keepdim=True) - 1)
    token = order.gather(-1, index)
    return token.squeeze(-1), logp_all.gather(-1, token).squeeze(-1)


def _uniform(logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One uniform number per row of ``logits``, ``[B, 1]`` on its device, drawn from ``generator``'s device."""
    if generator is None:
        return torch.rand((logits.shape[0], 1), device=logits.device)
    return torch.rand((logits.shape[0], 1), generator=generator, device=generator.device).to(logits.device)


SORTED_DRAW_MAX_VOCAB = 256  # pick_tokens sorts vocabularies up to this size even at top_p == 1 (see there)
DRAW_BLOCK = 256  # vocabulary ids per block in _draw_in_id_order


def _draw_in_id_order(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``[B, 1]`` ids: for each row, the first id (in id order) whose cumulative probability passes ``u`` times the
    row's total; its probability is > 0 (the cumulative sum rises there).

    In two levels, because a running sum over the whole vocabulary is sequential (slow on a CPU) where a sum is
    vectorised: the masses of blocks of :data:`DRAW_BLOCK` ids and their running sum pick the block, then a running
    sum inside that block picks the id. Rounding can put the target at or past a running sum's end: then the last
    block / id with positive mass is taken.
    """
    b, v = probs.shape
    pad = -v % DRAW_BLOCK
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).view(b, -1, DRAW_BLOCK)
    masses = blocks.sum(-1)
    cdf = masses.cumsum(-1)
    target = u * cdf[:, -1:]
    k = torch.minimum(torch.searchsorted(cdf, target, right=True), _last_positive(masses))
    before = torch.where(k > 0, cdf.gather(-1, (k - 1).clamp(min=0)), torch.zeros_like(target))
    inner = blocks.gather(1, k[:, :, None].expand(-1, -1, DRAW_BLOCK)).squeeze(1)
    j = torch.minimum(torch.searchsorted(before + inner.cumsum(-1), target, right=True), _last_positive(inner))
    return k * DRAW_BLOCK + j


def _last_positive(x: torch.Tensor) -> torch.Tensor:
    """``[B, 1]``: the index of the last positive entry of each row of ``x [B, N]``."""
    return x.shape[-1] - 1 - (x.flip(-1) > 0).to(torch.int8).argmax(-1, keepdim=True)


class _StopStrings:
    """Watches the rows that have stop strings: after each step, says which rows' text now contains one.

    Only the tail of a row's completion is decoded: enough tokens to cover the longest stop string before
    the newest token's text (a new match must end inside that token, or an earlier step would have seen it).
    """

    def __init__(self, tokenizer: Any, row_stops: list[list[str]]) -> None:
        self.tokenizer = tokenizer
        self.stops = {i: s for i, s in enumerate(row_stops) if s}
        self.longest = {i: max(len(x) for x in s) for i, s in self.stops.items()}
        self.history: dict[int, list[int]] = {i: [] for i in self.stops}
        # A token's text length on its own, per id: the same for every row and step, so decoded once.
        self.token_chars: dict[int, int] = {}

    def __bool__(self) -> bool:
        return bool(self.stops)

    def update(self, tokens: list[int], done: list[bool]) -> list[int]:
        """Record this step's ``tokens`` and return the rows (not yet ``done``) that a stop string ends now."""
        hits: list[int] = []
        for i in list(self.stops):
            if done[i]:  # ended by EOS this step (or earlier): stop watching
                del self.stops[i]
                continue
            ids = self.history[i]
            token = tokens[i]
            ids.append(token)
            chars = self.token_chars.get(token)
            if chars is None:
                chars = self.token_chars[token] = len(self.tokenizer.decode([token]))
            need = self.longest[i] - 1 + chars
            width = self.longest[i] + 1
            tail = self.tokenizer.decode(ids[-width:])
            while len(tail) < need and width < len(ids):
                width *= 2
                tail = self.tokenizer.decode(ids[-width:])
            if any(s in tail for s in self.stops[i]):
                hits.append(i)
                del self.stops[i]
        return hits


def _check_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> None:
    """Raise a one-line ValueError unless the prompts are a non-empty, left-padded int64 ``[B, P]`` and bool mask."""
    if prompt_ids.dim() != 2 or prompt_ids.dtype != torch.int64:
        raise ValueError(
            f"prompt_ids: expected an int64 tensor [B, P], got {prompt_ids.dtype} {list(prompt_ids.shape)}"
        )
    if prompt_mask.shape != prompt_ids.shape or prompt_mask.dtype != torch.bool:
        raise ValueError(
            f"prompt_mask: expected a bool tensor shaped like prompt_ids {list(prompt_ids.shape)}, "
            f"got {prompt_mask.dtype} {list(prompt_mask.shape)}"
        )
    b, p = prompt_ids.shape
    if b == 0 or p == 0:
        raise ValueError(f"prompt_ids: expected at least one row and one token, got shape {list(prompt_ids.shape)}")
    if not bool(prompt_mask[:, -1].all()):
        bad = int((~prompt_mask[:, -1]).nonzero()[0])
        raise ValueError(f"prompt_mask: row {bad} does not end in a real token (prompts are left-padded and not empty)")


def _row_caps(n: int, max_new_tokens: Sequence[int | None] | None, b: int) -> list[int] | None:
    """Each row's token limit, ``min(n, max_new_tokens[i])`` (None: no per-row caps)."""
    if max_new_tokens is None:
        return None
    if len(max_new_tokens) != b:
        raise ValueError(f"max_new_tokens: expected one cap (or None) per row ({b}), got {len(max_new_tokens)}")
    for i, c in enumerate(max_new_tokens):
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 0):
            raise ValueError(f"max_new_tokens[{i}]: expected an integer >= 0 or None, got {c!r}")
    return [n if c is None else min(n, c) for c in max_new_tokens]


def _row_stops(params: SamplingParams, stops: Sequence[Sequence[str] | None] | None, b: int) -> list[list[str]]:
    """Each row's stop strings: ``params.stop`` plus its own (``stops`` has one entry per row, checked already)."""
    row_stops = [list(params.stop) + list((stops[i] or []) if stops is not None else []) for i in range(b)]
    for i, row in enumerate(row_stops):
        for s in row:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stops[{i}]: expected non-empty strings, got {s!r}")
    return row_stops


@dataclass
class _Draws:
    """The completion being written, one column per step: token ids, their mask and their behaviour log-probs."""

    ids: torch.Tensor
    mask: torch.Tensor
    logprobs: torch.Tensor
    steps: int = 0  # columns written

    @classmethod
    def empty(cls, b: int, n: int, pad: int, device: torch.device) -> _Draws:
        return cls(
            ids=torch.full((b, n), pad, dtype=torch.int64, device=device),
            mask=torch.zeros((b, n), dtype=torch.bool, device=device),
            logprobs=torch.zeros((b, n), dtype=torch.float32, device=device),
        )


class DecodeStepper(Protocol):
    """What the sampling loop needs of a model: logits for the prompt's last token, then for each new token."""

    def prefill(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[B, V]`` after the left-padded prompt ``[B, P]`` (``positions``: each token's position)."""
        ...

    def step(self, token: torch.Tensor, mask: torch.Tensor, length: int, position: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[B, V]`` after ``token [B, 1]`` at ``position [B, 1]``. ``mask [B, P + N]`` is the whole
        generation's attention mask, allocated once; its first ``length`` columns are written (the prompt, the
        tokens so far and this one), the rest are not yet."""
        ...


class PolicySteps:
    """The policy's own ``decode_step`` with the cache it returns (grown by one column a step)."""

    def __init__(self, policy: Any, agent_ids: Sequence[AgentId] | None) -> None:
        self.policy, self.agent_ids, self.cache = policy, agent_ids, None

    def prefill(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        logits, self.cache = self.policy.decode_step(prompt_ids, prompt_mask, positions, None, agent_ids=self.agent_ids)
        return logits

    def step(self, token: torch.Tensor, mask: torch.Tensor, length: int, position: torch.Tensor) -> torch.Tensor:
        logits, self.cache = self.policy.decode_step(
            token, mask[:, :length], position, self.cache, agent_ids=self.agent_ids
        )
        return logits


def _decode_loop(
    policy: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    params: SamplingParams,
    out: _Draws,
    *,
    end_ids: list[int],
    watch: _StopStrings,
    caps: list[int] | None,
    generator: torch.Generator | None,
    agent_ids: Sequence[AgentId] | None,
    stepper: DecodeStepper | None = None,
) -> None:
    """Prefill the prompt, then draw one token per row per step into ``out`` until every row is done or full.

    ``stepper`` runs the model (None: :class:`PolicySteps`, the policy's own ``decode_step`` and KV cache)."""
    b, p = prompt_ids.shape
    n = out.ids.shape[1]
    device = prompt_ids.device
    pad = policy.tokenizer.pad_token_id
    end_t = torch.tensor(end_ids, dtype=torch.int64, device=device)
    # The attention mask of the whole generation, allocated once: step t attends to its first p + t + 1
    # columns (a view), and each step writes one column (finished rows' new tokens are padding).
    mask = torch.empty((b, p + n), dtype=torch.bool, device=device)
    mask[:, :p] = prompt_mask
    positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
    next_position = positions[:, -1:] + 1
    done = torch.zeros(b, dtype=torch.bool, device=device)
    cap_t = None if caps is None else torch.tensor(caps, dtype=torch.int64, device=device)
    if cap_t is not None:
        done = cap_t == 0  # rows capped at 0 tokens sample nothing
    steps = stepper if stepper is not None else PolicySteps(policy, agent_ids)
    logits = steps.prefill(prompt_ids, prompt_mask, positions)
    for t in range(n):
        token, logp = pick_tokens(logits, params.temperature, params.top_p, generator)
        token = token.masked_fill_(done, pad)
        out.ids[:, t] = token
        torch.logical_not(done, out=out.mask[:, t])
        out.logprobs[:, t] = logp.masked_fill_(done, 0.0)
        done = done | torch.isin(token, end_t)
        out.steps = t + 1
        if watch:
            hits = watch.update(token.tolist(), done.tolist())
            if hits:
                done[hits] = True
        if cap_t is not None:
            done = done | (cap_t <= t + 1)  # rows at their own cap: truncated like at max_new_tokens
        if t == n - 1 or bool(done.all()):
            break
        torch.logical_not(done, out=mask[:, p + t])
        logits = steps.step(token[:, None], mask, p + t + 1, next_position)
        next_position = next_position + 1


def _texts(
    tokenizer: Any, completion_ids: torch.Tensor, completion_mask: torch.Tensor, end_ids: list[int]
) -> list[str]:
    """Each row's completion as text, without the EOS / stop token that ended it."""
    lengths = completion_mask.sum(-1).tolist()
    end_set = set(end_ids)
    texts = []
    for row, length in zip(completion_ids.tolist(), lengths):
        ids = row[:length]
        if ids and ids[-1] in end_set:  # the EOS / stop token that ended the row is not text
            ids = ids[:-1]
        texts.append(tokenizer.decode(ids))
    return texts


@torch.no_grad()
def sample(
    policy: Any,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    params: SamplingParams,
    *,
    stops: Sequence[Sequence[str] | None] | None = None,
    max_new_tokens: Sequence[int | None] | None = None,
    generator: torch.Generator | None = None,
    agent_ids: Sequence[AgentId] | None = None,
    stepper: Callable[[int], DecodeStepper] | None = None,
) -> Generation:
    """Sample one completion per row of the left-padded ``prompt_ids [B, P]`` / ``prompt_mask [B, P]``.

    ``stops[i]`` adds stop strings for row ``i`` to ``params.stop``. ``max_new_tokens[i]`` caps row ``i`` at
    ``min(params.max_new_tokens, max_new_tokens[i])`` tokens (None: no extra cap); a row that reaches its cap
    ends like a length-truncated one, and the draws of the other rows do not change. ``generator`` seeds the
    draws (same seed, same completions); None uses torch's global RNG. ``agent_ids`` (one per row) go to every
    ``policy.decode_step``. ``stepper(n)`` builds the model runner for ``n`` new tokens at most (None:
    :class:`PolicySteps`). See the module docstring for the result.
    """
    check_params(params)
    _check_prompts(prompt_ids, prompt_mask)
    b, p = prompt_ids.shape
    if stops is not None and len(stops) != b:
        raise ValueError(f"stops: expected one list per row ({b}), got {len(stops)}")
    caps = _row_caps(params.max_new_tokens, max_new_tokens, b)
    n = params.max_new_tokens if caps is None else max(caps)  # no row runs longer than its cap
    limit = getattr(policy, "max_len", None)
    if isinstance(limit, int) and p + n > limit:
        raise ValueError(
            f"policy.options.max_len: a prompt of {p} tokens + max_new_tokens={n} is longer than max_len={limit}"
        )
    tokenizer = policy.tokenizer
    end_ids = sorted({tokenizer.eos_token_id, *params.stop_token_ids})
    watch = _StopStrings(tokenizer, _row_stops(params, stops, b))
    out = _Draws.empty(b, n, tokenizer.pad_token_id, prompt_ids.device)
    if n > 0:
        _decode_loop(
            policy,
            prompt_ids,
            prompt_mask,
            params,
            out,
            end_ids=end_ids,
            watch=watch,
            caps=caps,
            generator=generator,
            agent_ids=agent_ids,
            stepper=None if stepper is None else stepper(n),
        )
    completion_ids = out.ids[:, : out.steps]
    completion_mask = out.mask[:, : out.steps]
    return Generation(
        texts=_texts(tokenizer, completion_ids, completion_mask, end_ids),
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        logprobs=out.logprobs[:, : out.steps],
    )


def generate(
    policy: Any,
    observations: Sequence[Observation],
    params: SamplingParams,
    *,
    generator: torch.Generator | None = None,
    stepper: Callable[[int], DecodeStepper] | None = None,
) -> Generation:
    """Encode ``observations`` with ``policy.encode_observations`` and :func:`sample` one completion for each,
    with each observation's ``stop`` strings added to ``params.stop``, its ``max_new_tokens`` (when set)
    capping its row below ``params.max_new_tokens``, and its ``agent_id`` handed to the policy's decode steps.
    ``stepper`` is :func:`sample`'s."""
    if not observations:
        raise ValueError("generate: observations is empty")
    caps = [o.max_new_tokens for o in observations]
    for i, c in enumerate(caps):
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 0):
            raise ValueError(f"observations[{i}].max_new_tokens: expected an integer >= 0 or None, got {c!r}")
    prompt_ids, prompt_mask = policy.encode_observations(observations)
    stops = [list(o.stop or []) for o in observations]
    return sample(
        policy,
        prompt_ids,
        prompt_mask,
        params,
        stops=stops if any(stops) else None,
        max_new_tokens=caps if any(c is not None for c in caps) else None,
        generator=generator,
        agent_ids=[o.agent_id for o in observations],
        stepper=stepper,
    )


__all__ = ["DecodeStepper", "PolicySteps", "check_params", "generate", "pick_tokens", "sample"]
