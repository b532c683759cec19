"""``check_policy``: the policy contract the generator and the optimisers rely on, rule by rule.

The trainer encodes observations (``encode_observations``), samples through a generator that drives
``decode_step``, and every optimiser's loss is built from ``score``: log-probs (and entropy) per completion
token, 0 where masked, differentiable, the same for a row whatever padding its batch gave it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from palestra.testing.compare import first_difference
from palestra.testing.components import Subject, subject
from palestra.testing.errors import Contract
from palestra.testing.samples import SEED, completions, observations
from palestra.types import Observation

__all__ = ["RULES", "check_policy"]

RULES: dict[str, str] = {
    "builds from its options": "the factory builds the policy from the options given",
    "tokenizer": (
        "tokenizer has int pad_token_id and eos_token_id, len(), encode(str) -> list of ints, decode(ids) -> str"
    ),
    "trainable parameters": "parameters() yields at least one tensor that requires grad",
    "encodes one row per observation": (
        "encode_observations returns (ids [B, P] int64, mask [B, P] bool), one row per observation"
    ),
    "left padding": "every row's real tokens end at the last column; padding comes first",
    "encoding is deterministic": "encoding the same observations twice gives equal tensors",
    "score runs": "score(prompt_ids, prompt_mask, completion_ids, completion_mask) returns without raising",
    "scores are [B, T] float32": (
        "score(...).logprobs, and .entropy when asked for, are float32 tensors of shape [B, T]"
    ),
    "masked tokens score 0": "log-probs and entropy are 0 where completion_mask is False",
    "log-probs are finite and <= 0": "every real token's log-prob is finite and at most 0",
    "padding does not change a row's scores": (
        "a row scored alone matches the same row scored beside a longer one (within 1e-4)"
    ),
    "scoring is deterministic": "in eval mode, scoring twice gives the same numbers bit for bit",
    "score takes agent_ids": (
        "score(..., agent_ids=[one id per row]) runs; every row naming the same agent scores bit for bit as without"
    ),
    "scores are differentiable": "backward from the log-probs reaches the parameters",
    "one-row batch": "one observation encodes and scores",
    "state round-trip": "a fresh instance loaded from state_dict() scores bit for bit the same",
    "generates": (
        "the generator (default kv_cache) samples one completion per observation with consistent shapes "
        "(decode_step takes agent_ids, as score does); greedy sampling repeats"
    ),
}


def check_policy(
    policy: str | Callable[..., Any],
    options: Mapping[str, Any] | None = None,
    *,
    name: str | None = None,
    prompts: Sequence[str] | None = None,
    generator: str | Callable[..., Any] | None = "kv_cache",
) -> None:
    """Check a registered policy (by name) or a factory against the contract; raise a one-line
    :class:`~palestra.testing.ContractError` at the first broken rule.

    ``prompts`` are the texts it encodes (default: short arithmetic prompts of different lengths);
    ``generator=None`` skips sampling.
    """
    subj = subject("policy", policy, options, name=name)
    c = Contract("policy", subj.label, RULES)
    obs = observations(4, prompts) if prompts else observations(4)
    model = _build(subj, c)
    _check_tokenizer(model, c)
    c.require(
        any(p.requires_grad for p in model.parameters()),
        "parameters",
        "trainable parameters",
        "no parameter requires grad",
    )
    model.eval()
    ids, mask = _encode(model, c, obs)
    found = first_difference((ids, mask), _encode(model, c, obs), "encoding")
    c.require(found is None, "encode_observations", "encoding is deterministic", f"a second encoding differs: {found}")
    comp_ids, comp_mask = completions(model, len(obs), seed=SEED)
    scores = _score(model, c, ids, mask, comp_ids, comp_mask)
    found = first_difference(scores, _score(model, c, ids, mask, comp_ids, comp_mask), "logprobs")
    c.require(found is None, "score", "scoring is deterministic", f"scoring twice differs: {found}")
    _check_agent_ids(model, c, ids, mask, comp_ids, comp_mask, scores)
    _check_padding(model, c, obs, comp_ids, comp_mask)
    _check_gradient(model, c, ids, mask, comp_ids, comp_mask)
    _check_state(model, subj, c, ids, mask, comp_ids, comp_mask, scores)
    if generator is not None:
        _check_generation(model, c, obs, ids, generator)


def _build(subj: Subject, c: Contract) -> Any:
    with c.calling("build", "builds from its options"):
        return subj.make()


def _check_tokenizer(model: Any, c: Contract) -> None:
    tok: Any = getattr(model, "tokenizer", None)  # a plugin's object; c.require below fails the check on None
    c.require(tok is not None, "tokenizer", "tokenizer", "the policy has no tokenizer attribute")
    for attr in ("pad_token_id", "eos_token_id"):
        value = getattr(tok, attr, None)
        c.require(
            isinstance(value, int) and not isinstance(value, bool),
            "tokenizer",
            "tokenizer",
            f"{attr} is {value!r}; expected an int",
        )
    with c.calling("tokenizer", "tokenizer"):
        ids = tok.encode("1 + 2 =")
        size = len(tok)
        text = tok.decode(ids)
    c.require(
        isinstance(ids, list) and all(isinstance(i, int) and 0 <= i < size for i in ids),
        "tokenizer",
        "tokenizer",
        f"encode returned {ids!r}; expected a list of ints below len(tokenizer)={size}",
    )
    c.require(isinstance(text, str), "tokenizer", "tokenizer", f"decode returned {type(text).__name__}; expected str")


def _encode(model: Any, c: Contract, obs: list[Observation]) -> tuple[Any, Any]:
    import torch

    rule = "encodes one row per observation" if len(obs) > 1 else "one-row batch"
    with c.calling("encode_observations", rule):
        out = model.encode_observations(obs)
    ok = isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)
    c.require(
        ok, "encode_observations", rule, f"returned {type(out).__name__}; expected (prompt_ids, prompt_mask) tensors"
    )
    ids, mask = out
    b = len(obs)
    c.require(
        ids.dim() == 2 and ids.shape[0] == b and ids.dtype == torch.int64,
        "encode_observations",
        rule,
        f"prompt_ids is a {ids.dtype} tensor of shape {list(ids.shape)}; expected int64 [{b}, P]",
    )
    c.require(
        mask.shape == ids.shape and mask.dtype == torch.bool,
        "encode_observations",
        rule,
        f"prompt_mask is a {mask.dtype} tensor of shape {list(mask.shape)}; expected bool {list(ids.shape)}",
    )
    lengths = mask.sum(-1)
    left = bool(mask[:, -1].all()) and bool((mask.long().cumsum(-1) > 0).eq(mask).all()) and bool((lengths > 0).all())
    c.require(
        left,
        "encode_observations",
        "left padding",
        "some row's tokens do not end at the last column, or padding sits between tokens",
    )
    return ids, mask


def _score(
    model: Any, c: Contract, ids: Any, mask: Any, comp_ids: Any, comp_mask: Any, *, rule: str = "score runs"
) -> Any:
    import torch

    with torch.no_grad(), c.calling("score", rule):
        out = model.score(ids, mask, comp_ids, comp_mask, entropy=True)
    shape = tuple(comp_ids.shape)
    for field in ("logprobs", "entropy"):
        value: Any = getattr(out, field, None)  # c.require below fails the check unless it is a float32 tensor
        ok = isinstance(value, torch.Tensor) and value.dtype == torch.float32 and tuple(value.shape) == shape
        c.require(
            ok, "score", "scores are [B, T] float32", f"{field} is {_describe(value)}; expected float32 {list(shape)}"
        )
        masked = value[~comp_mask]
        c.require(
            bool((masked == 0).all()), "score", "masked tokens score 0", f"{field} is not 0 on padded completion tokens"
        )
    real = out.logprobs[comp_mask]
    c.require(
        bool(torch.isfinite(real).all()) and bool((real <= 0).all()),
        "score",
        "log-probs are finite and <= 0",
        f"log-probs range from {real.min().item()} to {real.max().item()}",
    )
    return out.logprobs


def _check_agent_ids(model: Any, c: Contract, ids: Any, mask: Any, comp_ids: Any, comp_mask: Any, scores: Any) -> None:
    """The learner passes every row's agent id to every policy (a multi-agent policy routes rows by them)."""
    import torch

    from palestra.types import DEFAULT_AGENT

    rule = "score takes agent_ids"
    with torch.no_grad(), c.calling("score", rule):
        out = model.score(ids, mask, comp_ids, comp_mask, entropy=True, agent_ids=[DEFAULT_AGENT] * ids.shape[0])
    found = first_difference(scores, out.logprobs, "logprobs")
    c.require(found is None, "score", rule, f"agent_ids={DEFAULT_AGENT!r} on every row changed the scores: {found}")


def _check_padding(model: Any, c: Contract, obs: list[Observation], comp_ids: Any, comp_mask: Any) -> None:
    short, long = min(obs, key=lambda o: len(o.prompt)), max(obs, key=lambda o: len(o.prompt))
    alone_ids, alone_mask = _encode(model, c, [short])
    pair_ids, pair_mask = _encode(model, c, [short, long])
    row_ids, row_mask = comp_ids[1:2], comp_mask[1:2]  # a completion of several tokens
    alone = _score(model, c, alone_ids, alone_mask, row_ids, row_mask, rule="one-row batch")
    pair = _score(model, c, pair_ids, pair_mask, row_ids.repeat(2, 1), row_mask.repeat(2, 1))
    gap = (alone[0] - pair[0]).abs().max().item()
    c.require(
        gap <= 1e-4,
        "score",
        "padding does not change a row's scores",
        f"a row's log-probs moved by {gap:.3g} when a longer prompt joined its batch",
    )


def _check_gradient(model: Any, c: Contract, ids: Any, mask: Any, comp_ids: Any, comp_mask: Any) -> None:
    model.train()
    try:
        with c.calling("score", "scores are differentiable"):
            out = model.score(ids, mask, comp_ids, comp_mask, entropy=False)
            out.logprobs.sum().backward()
        reached = any(
            p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.parameters() if p.requires_grad
        )
        c.require(
            reached, "score", "scores are differentiable", "no parameter got a non-zero gradient from the log-probs"
        )
    finally:
        model.zero_grad(set_to_none=True)
        model.eval()


def _check_state(
    model: Any, subj: Subject, c: Contract, ids: Any, mask: Any, comp_ids: Any, comp_mask: Any, scores: Any
) -> None:
    with c.calling("state_dict", "state round-trip"):
        state = copy.deepcopy(model.state_dict())
    fresh = _build(subj, c)
    with c.calling("load_state_dict", "state round-trip"):
        fresh.load_state_dict(state)
    fresh.eval()
    found = first_difference(scores, _score(fresh, c, ids, mask, comp_ids, comp_mask), "logprobs")
    c.require(
        found is None,
        "load_state_dict",
        "state round-trip",
        f"a fresh instance loaded from state_dict() scores differently: {found}",
    )


def _check_generation(
    model: Any, c: Contract, obs: list[Observation], ids: Any, generator: str | Callable[..., Any]
) -> None:
    import torch

    from palestra.types import SamplingParams

    backend = subject("generator", generator).make()
    params = SamplingParams(max_new_tokens=3, temperature=0.0)
    runs = []
    for _ in range(2):
        with torch.no_grad(), c.calling("generate", "generates"):
            runs.append(backend.generate(model, obs, params, generator=torch.Generator().manual_seed(SEED)))
    out = runs[0]
    b = len(obs)
    t = out.completion_ids.shape[-1] if isinstance(out.completion_ids, torch.Tensor) else -1
    ok = (
        len(out.texts) == b
        and all(isinstance(x, str) for x in out.texts)
        and tuple(out.completion_ids.shape) == (b, t)
        and 0 < t <= params.max_new_tokens
        and tuple(out.completion_mask.shape) == (b, t)
        and tuple(out.logprobs.shape) == (b, t)
        and torch.equal(out.prompt_ids, ids)
    )
    c.require(
        ok,
        "generate",
        "generates",
        f"a Generation for {b} observations has {len(out.texts)} texts and completion ids of shape "
        f"{list(out.completion_ids.shape)}",
    )
    found = first_difference(out, runs[1], "generation")
    c.require(found is None, "generate", "generates", f"greedy sampling twice differs: {found}")


def _describe(value: Any) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return f"{type(value).__name__}"
