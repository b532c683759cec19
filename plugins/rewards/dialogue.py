"""Built-in dialogue rewards: ``fluency``, ``factual`` and ``politeness``, each in [0, 1].

Written for the ``customer_service`` environment's three roles; each reads ``metadata["agent_id"]`` to know
whose output it scores (a row without one is scored as a ``response``). The joint reward is the built-in
``weighted_sum`` of the three (0.4 / 0.4 / 0.2), which logs every component::

    reward:
      name: weighted_sum
      options:
        components:
          - {name: fluency, weight: 0.4}
          - {name: factual, weight: 0.4}
          - {name: politeness, weight: 0.2}

Evaluated on an episode's last turn (team credit) it scores the reply; evaluated on each agent's own last
turn (role credit) it scores that agent's output:

============  ===========================================  ==============================  ======================
role          factual                                      fluency                         politeness
============  ===========================================  ==============================  ======================
intent        1 if the label is the gold intent            1 exactly one label; 0.5 a      = fluency (a clean
                                                           label among other text; else 0  label is the courteous
                                                                                           hand-over)
retrieval     F1 of the named entry ids vs the gold ids    1 only known ids from the       = fluency
                                                           candidates; 0.5 ids with junk
                                                           or off the list; else 0
response      0.75 x share of the gold value's words       sentence heuristics (below)     0.6 one polite marker,
              + 0.25 x share of the fact's other words,                                    1.0 two kinds; 0 if
              halved if another entry's value is stated                                    anything rude
============  ===========================================  ==============================  ======================

Reply fluency: 0.2 starts with a capital letter, 0.2 ends with ``.``, ``!`` or ``?``, 0.4 x the share of
characters in known words (knowledge-base words, reply phrases, numbers) x (1 - the share of repeated
words), 0.2 x a length score (1 for 4-16 words, falling to 0 at none and at 32). Words must be separated:
``refundstake`` is one unknown word here.

The content scorers (labels, facts, polite and rude phrases) read words run together as the separate
known words they are made of (:func:`palestra.plugins.envs._support_kb.segment`), so a policy gets credit
for content before it has learnt spacing, which fluency rewards on its own.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from palestra import hookimpl
from palestra.plugins.envs._support_kb import (
    POLITE_MARKERS,
    RUDE,
    known_words,
    segment,
    words,
)

if TYPE_CHECKING:
    import torch

_ID = re.compile(r"K\d+")
_ID_LIST = re.compile(r"\s*K\d+(\s*[, ]\s*K\d+)*\s*")
_KNOWN = known_words()
_STOPWORDS = frozenset({"the", "are", "is", "in", "to", "by", "for", "an", "a", "we", "on", "your", "every"})


def _scores(values: list[float]) -> torch.Tensor:
    import torch

    return torch.tensor(values, dtype=torch.float32)


def _role(meta: Mapping[str, Any]) -> str:
    return str(meta.get("agent_id", "response"))


def _has_phrase(text_words: Sequence[str], phrase: str) -> bool:
    """Whether the words of ``phrase`` occur consecutively in ``text_words``."""
    p = words(phrase)
    n = len(p)
    return n > 0 and any(list(text_words[i : i + n]) == p for i in range(len(text_words) - n + 1))


# ---- per-role scorers (plain functions, so tests and other rewards can reuse them) -------------------
def label_form(completion: str, meta: Mapping[str, Any]) -> float:
    """Intent role: 1.0 for exactly one valid label, 0.5 for one label among other text, else 0."""
    labels = set(meta.get("labels", ()))
    found = {w for w in segment(completion) if w in labels}
    if len(found) != 1:
        return 0.0
    return 1.0 if completion.strip() in labels else 0.5


def ids_form(completion: str, meta: Mapping[str, Any]) -> float:
    """Retrieval role: 1.0 for a clean list of candidate ids, 0.5 for ids with other text or off the list, else 0."""
    named = _ID.findall(completion)
    if not named:
        return 0.0
    offered = meta.get("info", {}).get("candidates")
    listed = offered is None or all(i in offered for i in named)
    clean = _ID_LIST.fullmatch(completion) is not None and len(set(named)) == len(named)
    return 1.0 if clean and listed else 0.5


def reply_fluency(reply: str) -> float:
    """Response role: sentence heuristics (see the module docstring)."""
    text = reply.strip()
    ws = words(text)
    if not ws:
        return 0.0
    capital = float(text[0].isupper())
    end = float(text[-1] in ".!?")
    known = sum(len(w) for w in ws if w in _KNOWN or w.isdigit()) / sum(len(w) for w in ws)  # by characters
    repeats = sum(1 for i, w in enumerate(ws) if w in ws[:i]) / len(ws)
    n = len(ws)
    length = min(1.0, n / 4) if n < 4 else (1.0 if n <= 16 else max(0.0, 1 - (n - 16) / 16))
    return 0.2 * capital + 0.2 * end + 0.4 * known * (1 - repeats) + 0.2 * length


def reply_factual(reply: str, meta: Mapping[str, Any]) -> float:
    """Response role: the gold value (and fact) stated, no other entry's value stated (see the module docstring)."""
    ws = segment(reply)
    said = set(ws)
    value = words(str(meta["gold_value"]))
    rest = [w for w in words(str(meta.get("gold_fact", ""))) if w not in value and w not in _STOPWORDS]
    value_share = sum(w in said for w in value) / len(value) if value else 0.0
    rest_share = sum(w in said for w in rest) / len(rest) if rest else value_share
    score = 0.75 * value_share + 0.25 * rest_share
    if any(_has_phrase(ws, v) for v in meta.get("other_values", ())):
        score *= 0.5
    return score


def reply_politeness(reply: str) -> float:
    """Response role: 0.6 for a polite marker, 1.0 for markers of two kinds (greeting, thanks, apology, offer);
    0 if rude."""
    ws = segment(reply)
    if any(_has_phrase(ws, r) for r in RUDE):
        return 0.0
    kinds = sum(any(_has_phrase(ws, m) for m in markers) for markers in POLITE_MARKERS.values())
    return 0.0 if kinds == 0 else (0.6 if kinds == 1 else 1.0)


# ---- the registered rewards ---------------------------------------------------------------------------
class _RoleReward:
    max_score = 1.0

    def __init__(self, **options: Any) -> None:
        if options:
            raise TypeError(f"{type(self).__name__} takes no options, got {sorted(options)}")

    def score(self, completion: str, meta: Mapping[str, Any]) -> float:
        raise NotImplementedError

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], metadata: Sequence[Mapping[str, Any]]
    ) -> torch.Tensor:
        return _scores([min(1.0, max(0.0, self.score(c, m))) for c, m in zip(completions, metadata)])


class FluencyReward(_RoleReward):
    """Well-formedness of the role's output: a clean label, a clean id list, or a fluent reply."""

    def score(self, completion: str, meta: Mapping[str, Any]) -> float:
        role = _role(meta)
        if role == "intent":
            return label_form(completion, meta)
        if role == "retrieval":
            return ids_form(completion, meta)
        return reply_fluency(completion)


class FactualReward(_RoleReward):
    """Accuracy against the knowledge base: the right intent, the right entries, or the right fact in the reply."""

    def score(self, completion: str, meta: Mapping[str, Any]) -> float:
        role = _role(meta)
        if role == "intent":
            found = list(dict.fromkeys(w for w in segment(completion) if w in set(meta.get("labels", ()))))
            return float(found == [meta["intent"]])
        if role == "retrieval":
            named = set(_ID.findall(completion))
            gold = set(meta["gold_ids"])
            hits = len(named & gold)
            return 2 * hits / (len(named) + len(gold)) if named else 0.0
        return reply_factual(completion, meta)


class PolitenessReward(FluencyReward):
    """Tone: polite markers and no rude words in a reply; for the intent and retrieval roles, equal to fluency
    (a label has no tone, and a clean one is the polite thing to hand on)."""

    def score(self, completion: str, meta: Mapping[str, Any]) -> float:
        if _role(meta) in ("intent", "retrieval"):
            return super().score(completion, meta)
        return reply_politeness(completion)


@hookimpl
def register_rewards(register: Any) -> None:
    register(
        "fluency",
        FluencyReward,
        description="dialogue: a clean label / id list, or a well-formed reply (per agent_id role)",
    )
    register(
        "factual",
        FactualReward,
        description="dialogue: right intent / entry F1 / the gold fact stated without contradiction",
    )
    register(
        "politeness",
        PolitenessReward,
        description="dialogue: polite markers and no rude words in a reply (labels: = fluency)",
    )
