"""The ``customer_service`` environment and the dialogue rewards (``fluency``, ``factual``, ``politeness``)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from palestra.config import ConfigError, build_component
from palestra.engine.rollout import collect, reward_rows, run_episodes
from palestra.plugin_manager import get_registry
from palestra.plugins.envs._support_kb import INTENTS, build_kb, segment, vocabulary
from palestra.plugins.envs.customer_service import (
    ROLES,
    tiny_policy_options,
)
from palestra.plugins.generators.kv_cache import KVCacheGenerator
from palestra.plugins.policies.char_tokenizer import CharTokenizer
from palestra.plugins.policies.tiny import TinyTransformerPolicy
from palestra.types import Environment, Observation, SamplingParams

JOINT = {
    "name": "weighted_sum",
    "options": {
        "components": [
            {"name": "fluency", "weight": 0.4},
            {"name": "factual", "weight": 0.4},
            {"name": "politeness", "weight": 0.2},
        ]
    },
}


def env(**options: Any) -> Any:
    return build_component("environment", {"name": "customer_service", "options": options}, path="environment")


def reward(spec: Any) -> Any:
    return build_component("reward", spec if isinstance(spec, dict) else {"name": spec}, path="reward")


def shown_fact(o: Observation) -> str:
    return o.prompt.split("fact: ")[1].split("\n")[0]


def oracle(obs: list[Observation]) -> list[str]:
    """Plays every role perfectly."""
    out = []
    for o in obs:
        m = o.metadata
        out.append(
            m["intent"]
            if o.turn == 0
            else m["gold_ids"][0]
            if o.turn == 1
            else f"Thanks, {shown_fact(o)}. Happy to help."
        )
    return out


def garbage(seed: int) -> Any:
    rng = random.Random(seed)
    words = vocabulary()
    return lambda obs: ["".join(rng.choice(words) for _ in range(8)) for _ in obs]


def wrong_intent(obs: list[Observation]) -> list[str]:
    """Names another intent, then answers like the oracle with what it was shown."""
    out = oracle(obs)
    for k, o in enumerate(obs):
        if o.turn == 0:
            labels = o.metadata["labels"]
            out[k] = labels[(labels.index(o.metadata["intent"]) + 1) % len(labels)]
        elif o.turn == 1:
            out[k] = o.prompt.split("\n")[2].split()[0]  # the first candidate (never the gold one here)
    return out


def test_registered_and_protocol() -> None:
    registry = get_registry()
    assert "customer_service" in registry.names("environment")
    assert {"fluency", "factual", "politeness"} <= set(registry.names("reward"))
    e = env()
    assert (
        isinstance(e, Environment) and e.agent_ids == ROLES == ("intent", "retrieval", "response") and e.max_turns == 3
    )


def test_knowledge_base_is_seeded_and_queries_of_one_intent_ask_about_different_entries() -> None:
    kb = build_kb(5, 4, kb_seed=3)
    assert kb == build_kb(5, 4, kb_seed=3) and kb != build_kb(5, 4, kb_seed=4)
    assert sorted(e.id for e in kb) == sorted(f"K{n}" for n in range(1, 21))
    for intent in INTENTS:
        mine = [e for e in kb if e.intent == intent]
        assert len(mine) == 4 and len({e.title for e in mine}) == 4
    for e in kb:
        assert all(w in e.fact.split() for w in e.value.split())
    assert {e.intent for e in build_kb(2, 1)} == {"billing", "shipping"}


def test_episodes_pass_state_and_record_what_was_parsed() -> None:
    e = env()
    obs = e.reset(3, seed=1, group_size=2)
    assert [o.agent_id for o in obs] == ["intent"] * 6 and all(o.stop == ["\n"] for o in obs)
    assert all(o.max_new_tokens == 1 for o in obs)  # label_tokens: one atom for the label
    for g in range(3):
        assert obs[2 * g].prompt == obs[2 * g + 1].prompt and obs[2 * g].metadata == obs[2 * g + 1].metadata
    m = obs[0].metadata
    assert obs[0].prompt == f"Q: {m['query']}\nintent:" and m["state"] == f"Q: {m['query']}"
    assert m["intent"] in m["labels"] and m["gold_value"] in m["gold_fact"] and m["gold_value"] not in m["other_values"]

    res = e.step(oracle(obs))
    assert res.done == [False] * 6 and [o.agent_id for o in res.observations] == ["retrieval"] * 6
    assert res.info[0] == {"intent": {"intent": m["intent"], "valid": True, "correct": True}}
    o1 = res.observations[0]
    assert o1.metadata["state"] == f"Q: {m['query']}\nintent: {m['intent']}"
    cands = [line.split()[0] for line in o1.prompt.split("\n")[2:-1]]
    assert len(cands) == 3 and m["gold_ids"][0] in cands and o1.prompt.endswith("\nentry:")
    assert o1.max_new_tokens == 1

    res = e.step(oracle(res.observations))
    info = res.info[0]["retrieval"]
    assert info["ids"] == m["gold_ids"] and info["candidates"] == cands and info["valid"] and info["f1"] == 1.0
    o2 = res.observations[0]
    assert o2.agent_id == "response" and f"fact: {m['gold_fact']}" in o2.prompt
    assert o2.metadata["state"].endswith(f"\nentry: {m['gold_ids'][0]}")
    assert o2.max_new_tokens is None  # reply_tokens: the trainer's limit

    res = e.step(oracle(res.observations))
    assert res.done == [True] * 6 and res.observations == [None] * 6
    assert res.info[0]["response"]["shown_ids"] == m["gold_ids"]
    with pytest.raises(RuntimeError, match="every episode is done"):
        e.step([None] * 6)


def test_same_seed_same_episodes_and_a_wrong_intent_hides_the_gold_entry() -> None:
    e = env(intents=5, topics_per_intent=4, candidates=4)
    a = run_episodes(e, oracle, 8, seed=7)
    b = run_episodes(env(intents=5, topics_per_intent=4, candidates=4), oracle, 8, seed=7)
    assert [t.observation.prompt for ep in a for t in ep.turns] == [t.observation.prompt for ep in b for t in ep.turns]
    assert [ep.metadata for ep in run_episodes(e, oracle, 8, seed=8)] != [ep.metadata for ep in a]
    bad = run_episodes(e, wrong_intent, 8, seed=7)
    for ep in bad:
        intent_info, retrieval_info, _ = (t.info for t in ep.turns)
        assert not intent_info["correct"] and not retrieval_info["gold_offered"] and retrieval_info["f1"] == 0.0
    mixed = run_episodes(env(candidate_source="mixed"), wrong_intent, 8, seed=7)
    assert all(ep.turns[1].info["gold_offered"] for ep in mixed)


def test_rewards_oracle_is_one_and_garbage_is_low_for_every_role() -> None:
    e = env()
    joint = reward(JOINT)
    good = run_episodes(e, oracle, 6, seed=2, group_size=2)
    bad = run_episodes(e, garbage(0), 6, seed=2, group_size=2)
    for role in (None, *ROLES):  # None: the team reward, on the last (response) turn
        out = joint(*reward_rows(good, role))
        assert out.scores.tolist() == pytest.approx([1.0] * 12)
        assert set(out.components) == {"fluency", "factual", "politeness"}
        low = joint(*reward_rows(bad, role)).scores
        assert ((low >= 0) & (low <= 1)).all() and low.mean() < 0.5
    # The intent agent's own reward follows its own output, not the others'.
    mixed_play = run_episodes(e, lambda obs: [oracle([o])[0] if o.turn == 0 else "no idea" for o in obs], 6, seed=2)
    assert joint(*reward_rows(mixed_play, "intent")).scores.tolist() == pytest.approx([1.0] * 6)
    assert joint(*reward_rows(mixed_play, "response")).scores.max() < 0.5


def score(name: str, completions: list[str], meta: dict[str, Any]) -> list[float]:
    return reward(name)([""] * len(completions), completions, [meta] * len(completions)).scores.tolist()


META = {
    "agent_id": "response",
    "intent": "billing",
    "labels": ["billing", "shipping"],
    "gold_ids": ["K3"],
    "gold_fact": "refunds take 5 days",
    "gold_value": "5 days",
    "other_values": ["7 days", "paypal"],
    "info": {"candidates": ["K3", "K4", "K9"]},
}


def test_reply_scorers_on_hand_made_replies() -> None:
    replies = [
        "Thanks, refunds take 5 days. Happy to help.",  # perfect
        "Refunds take 5 days.",  # right, fluent, not polite
        "Sorry, refunds take 7 days.",  # a wrong fact
        "Hello, refunds take 5 days or 7 days.",  # a contradiction
        "whatever, refunds take 5 days.",  # rude (and lower-case)
        "Thanks,refundstake5days.",  # run-together words: content counts, fluency does not
        "",
    ]
    fluency = score("fluency", replies, META)
    factual = score("factual", replies, META)
    polite = score("politeness", replies, META)
    assert fluency[:3] == pytest.approx([1.0, 1.0, 1.0]) and fluency[4] < 1.0 and fluency[5] < 0.7 and fluency[6] == 0.0
    assert factual == pytest.approx([1.0, 1.0, 0.3125, 0.5, 1.0, 1.0, 0.0])  # "days" right, "7" wrong, halved
    assert polite == pytest.approx([1.0, 0.0, 0.6, 0.6, 0.0, 0.6, 0.0])
    joint = reward(JOINT)([""] * 2, [replies[0], "you stupid go away"], [META] * 2).scores.tolist()
    assert joint[0] == pytest.approx(1.0) and joint[1] < 0.3
    assert score("fluency", ["Thanks thanks thanks thanks thanks."], META)[0] < 0.7  # repetition


def test_label_and_id_scorers() -> None:
    intent = {**META, "agent_id": "intent"}
    assert score("factual", ["billing", " billing\n", "shipping", "billing shipping", "bill"], intent) == [
        1.0,
        1.0,
        0.0,
        0.0,
        0.0,
    ]
    assert score("fluency", ["billing", " billing\n", "it is billing", "billing shipping", ""], intent) == [
        1.0,
        1.0,
        0.5,
        0.0,
        0.0,
    ]
    assert score("politeness", ["billing", "it is billing"], intent) == [1.0, 0.5]
    retrieval = {**META, "agent_id": "retrieval"}
    assert score("factual", ["K3", "K3 K4", "K4", "nothing", "K3K3"], retrieval) == pytest.approx(
        [1.0, 2 / 3, 0.0, 0.0, 1.0]
    )
    assert score("fluency", ["K3", "K3, K4", "entry K3", "K7", "none", "K3 K3"], retrieval) == [
        1.0,
        1.0,
        0.5,
        0.5,
        0.0,
        0.5,
    ]
    assert segment("shipbilling") == ["ship", "billing"]


def test_options_are_checked() -> None:
    with pytest.raises(
        ConfigError, match=r"^environment.options.candidates: must be at most intents \* topics_per_intent = 4"
    ):
        env(intents=2, topics_per_intent=2, candidates=5)
    with pytest.raises(ConfigError, match=r"^environment.options.intents"):
        env(intents=9)
    for name in ("label_tokens", "reply_tokens"):
        with pytest.raises(ConfigError, match=rf"^environment.options.{name}"):
            env(**{name: 0})


def test_turn_caps_follow_the_options() -> None:
    def caps(e: Any) -> list[int | None]:
        return [t.observation.max_new_tokens for ep in run_episodes(e, oracle, 2, seed=0) for t in ep.turns]

    assert caps(env()) == [1, 1, None] * 2
    assert caps(env(label_tokens=None, reply_tokens=6)) == [None, None, 6] * 2
    assert caps(env(label_tokens=2, reply_tokens=9)) == [2, 2, 9] * 2


def test_tiny_policy_reads_every_prompt_and_plays_through_collect() -> None:
    torch.set_num_threads(1)
    opts = tiny_policy_options()
    tok = CharTokenizer(opts["alphabet"], opts["atoms"], opts["unknown"])
    e = env(intents=5, topics_per_intent=4, candidates=5)
    for ep in run_episodes(e, oracle, 40, seed=0):
        for t in ep.turns:
            ids = tok.encode(t.observation.prompt)
            assert tok.unk_token_id not in ids and tok.decode(ids) == t.observation.prompt and len(ids) < 64
            assert tok.decode(tok.encode(t.completion)) == t.completion
    policy = TinyTransformerPolicy(**tiny_policy_options(d_model=32, d_ff=64, seed=0))
    ro = collect(
        env(reply_tokens=5),
        policy,
        KVCacheGenerator(),
        SamplingParams(max_new_tokens=12),
        4,
        group_size=2,
        seed=3,
        rng=torch.Generator().manual_seed(0),
    )
    assert [[t.agent_id for t in ep.turns] for ep in ro.episodes] == [list(ROLES)] * 8
    # The turn caps hold: one token for the label and the entry id, at most 5 for the reply.
    lengths = [g.completion_mask.sum(-1).tolist() for g in ro.generations]
    assert [max(n) for n in lengths] == [1, 1, 5] and min(lengths[0]) == 1
    assert all(len(tok.encode(t.completion)) <= 1 for ep in ro.episodes for t in ep.turns[:2])
    out = reward(JOINT)(*ro.reward_rows())
    assert ((out.scores >= 0) & (out.scores <= 1)).all() and torch.isfinite(out.scores).all()
    batch = ro.experience(out.scores, out.components)
    assert batch.validate().batch_size == 24 and batch.agent_ids[:3] == list(ROLES)
