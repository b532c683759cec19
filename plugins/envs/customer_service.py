"""Built-in environment ``customer_service``: a three-role support pipeline over a synthetic knowledge base.

Each episode is one customer query (a paraphrase of a question about one knowledge-base entry, see
:mod:`palestra.plugins.envs._support_kb`). Three agents act in turn, each seeing only what it needs:

1. ``intent`` (query understanding) sees ``Q: <query>`` and writes one intent label (``billing``, ...);
2. ``retrieval`` (knowledge retrieval) sees the query, the predicted intent and ``candidates`` entries
   (``K7 refund time`` lines) and writes the id(s) of the entry that answers it;
3. ``response`` (response generation) sees the query and the fact(s) of the retrieved entries and writes
   a short reply, e.g. ``Thanks, refunds take 7 days. Happy to help.``

Errors propagate: with ``candidate_source: predicted`` (the default) the candidates are entries of the
*predicted* intent, so a wrong intent hides the right entry; a wrong entry shows the responder a wrong fact.

Every observation's metadata carries ``"state"``: the joint state text (the query plus every earlier agent's
output) for a centralised critic. Episode metadata holds the ground truth for the rewards in
:mod:`palestra.plugins.rewards.dialogue` (``intent``, ``gold_ids``, ``gold_fact``, ``gold_value``,
``other_values``, ``labels``); each turn's info says what the environment parsed (``intent``/``correct``,
``ids``/``candidates``/``f1``, the facts shown). Every turn stops at a newline.

Each observation also caps its turn's length (``Observation.max_new_tokens``; the effective limit is the
smaller of it and ``train.max_new_tokens``): ``label_tokens`` (default 1) for the intent and retrieval turns,
whose answer is one atom of the recommended tokenizer (an intent label, an entry id such as ``K7``), and
``reply_tokens`` (default None: the trainer's limit) for the reply. A policy that has not learnt to end a
turn with the newline still hands over a label of one token, not a run of them; ``label_tokens: null`` leaves
those turns to the trainer's limit too (several ids, or words around the label, then fit).

Prompts are short and made only of knowledge-base words, so a word-level tokenizer reads them in few
tokens. The built-in tiny policy gets one from :func:`tiny_policy_options` (every word and phrase an atom,
digits and punctuation as characters): ``python -m palestra.plugins.envs.customer_service`` prints the
``policy.options`` block to paste into a config. Recommended for learning on 2 CPU cores in minutes:
``{d_model: 64, n_layers: 2, n_heads: 4, d_ff: 256, max_len: 128}`` plus those tokenizer options,
``temperature: 1.0`` and a short reply (``train.max_new_tokens`` or ``reply_tokens`` around 8; see
``examples/customer_service_mappo.yaml``).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from palestra import hookimpl
from palestra.config import OptionError, check_options, option
from palestra.plugins.envs._episodes import draw_tasks, step_turns
from palestra.plugins.envs._support_kb import INTENTS, ITEMS, Entry, build_kb, segment, vocabulary
from palestra.types import Message, Observation, StepResult

ROLES = ("intent", "retrieval", "response")
STOP = "\n"
ALPHABET = "0123456789 .,!?\nai"  # everything that is not an atom: digits, punctuation, and the words "a" and "i"
_ID = re.compile(r"K\d+")


@dataclass
class CustomerServiceOptions:
    intents: int = option(4, ge=2, le=len(INTENTS))  # billing, shipping, returns, account, technical (the first n)
    topics_per_intent: int = option(3, ge=1, le=4)  # knowledge-base entries per intent
    candidates: int = option(3, ge=1, le=8)  # entries listed for the retrieval agent
    candidate_source: Literal["predicted", "mixed"] = (
        "predicted"  # predicted: the predicted intent's entries; mixed: gold + any
    )
    paraphrases: int = option(3, ge=1, le=3)  # query wordings per entry (1: one fixed question per entry)
    kb_seed: int = 0  # draws the entry ids and fact values: the same seed, the same knowledge base
    label_tokens: int | None = option(1, ge=1)  # the intent and retrieval turns' token cap; None: train.max_new_tokens
    reply_tokens: int | None = option(None, ge=1)  # the response turn's token cap; None: train.max_new_tokens

    def __post_init__(self) -> None:
        total = self.intents * self.topics_per_intent
        if self.candidates > total:
            raise OptionError(
                "candidates",
                f"must be at most intents * topics_per_intent = {total} (the entries there are), got {self.candidates}",
            )


@dataclass(frozen=True)
class SupportTask:
    query: str
    entry: Entry
    shuffle_seed: int  # orders this task's candidate lists (the same for every row of a group)


@dataclass
class _Row:
    task: SupportTask
    turn: int = 0
    predicted: str | None = None
    candidates: tuple[str, ...] = ()
    retrieved: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()  # each earlier agent's output, cleaned, for the joint state


def _clean(text: str, limit: int = 80) -> str:
    return " ".join(text.split())[:limit]


def parse_intent(text: str, labels: Sequence[str]) -> tuple[str | None, bool]:
    """``(label, exact)``: the one label ``text`` names (None for none or several), and whether it is only that label.

    Words run together count (``"shipbilling"`` names ``billing``; see :func:`~._support_kb.segment`).
    """
    found = list(dict.fromkeys(w for w in segment(text) if w in labels))
    label = found[0] if len(found) == 1 else None
    return label, label is not None and text.strip() == label


def parse_ids(text: str) -> list[str]:
    """Entry ids named in ``text`` (``K7``), in order, without repeats."""
    return list(dict.fromkeys(_ID.findall(text)))


class CustomerServiceEnv:
    """Turn-based customer-support episodes. See the module docstring and :class:`palestra.types.Environment`."""

    agent_ids = ROLES
    max_turns = len(ROLES)

    def __init__(self, **options: Any) -> None:
        self.options: CustomerServiceOptions = check_options(CustomerServiceOptions, options, where="customer_service")
        o = self.options
        self.kb: tuple[Entry, ...] = build_kb(o.intents, o.topics_per_intent, o.kb_seed)
        self.by_id = {e.id: e for e in self.kb}
        self.labels: tuple[str, ...] = INTENTS[: o.intents]
        self._rng = random.Random()
        self._rows: list[_Row] = []

    # ---- tasks ---------------------------------------------------------------------------------------
    def make_task(self, rng: random.Random) -> SupportTask:
        entry = rng.choice(self.kb)
        template = rng.choice(entry.queries[: self.options.paraphrases])
        query = template.replace("{item}", rng.choice(ITEMS))
        return SupportTask(query, entry, rng.randrange(2**31))

    def metadata(self, task: SupportTask) -> dict[str, Any]:
        e = task.entry
        return {
            "query": task.query,
            "intent": e.intent,
            "gold_ids": [e.id],
            "gold_title": e.title,
            "gold_fact": e.fact,
            "gold_value": e.value,
            "other_values": sorted({x.value for x in self.kb if x.value != e.value}),
            "labels": list(self.labels),
        }

    def candidates_for(self, task: SupportTask, predicted: str | None) -> tuple[str, ...]:
        """The entries the retrieval agent chooses from, given the intent agent's label (see ``candidate_source``)."""
        k, gold = self.options.candidates, task.entry
        rng = random.Random(f"{task.shuffle_seed}:{predicted}")
        others = [e for e in self.kb if e is not gold]
        if self.options.candidate_source == "mixed" or predicted == gold.intent:
            same = [e for e in others if e.intent == gold.intent and self.options.candidate_source == "predicted"]
            rest = [e for e in others if e not in same]
            picked = [gold, *rng.sample(same, min(k - 1, len(same)))]
        else:  # a wrong (or no) intent: entries of that intent, never the gold one
            same = [e for e in others if e.intent == predicted]
            rest = [e for e in others if e not in same]
            picked = rng.sample(same, min(k, len(same)))
        picked += rng.sample(rest, k - len(picked))
        rng.shuffle(picked)
        return tuple(e.id for e in picked)

    # ---- observations ----------------------------------------------------------------------------------
    def _observation(self, row: _Row) -> Observation:
        task, turn = row.task, row.turn
        head = f"Q: {task.query}"
        if turn == 0:
            text = f"{head}\nintent:"
        elif turn == 1:
            listing = "".join(f"\n{i} {self.by_id[i].title}" for i in row.candidates)
            text = f"{head}\nintent: {row.predicted or 'none'}{listing}\nentry:"
        else:
            facts = [self.by_id[i].fact for i in row.retrieved[:2]] or ["none"]
            text = f"{head}" + "".join(f"\nfact: {f}" for f in facts) + "\nreply:"
        state = "\n".join([head, *(f"{c} {o}" for c, o in zip(("intent:", "entry:", "reply:"), row.outputs))])
        return Observation(
            prompt=text,
            agent_id=ROLES[turn],
            messages=[Message("user", text)],
            metadata={**self.metadata(task), "state": state},
            stop=[STOP],
            turn=turn,
            max_new_tokens=self.options.reply_tokens if turn == 2 else self.options.label_tokens,
        )

    # ---- protocol --------------------------------------------------------------------------------------
    def reset(self, batch_size: int, *, seed: int | None = None, group_size: int = 1) -> list[Observation]:
        tasks = draw_tasks(self.make_task, self._rng, batch_size, seed, group_size, "customer_service")
        self._rows = [_Row(task) for task in tasks]
        return [self._observation(r) for r in self._rows]

    def step(self, actions: Sequence[str | None]) -> StepResult:
        return step_turns("customer_service", self._rows, actions, self.max_turns, self._act, self._observation)

    def _act(self, row: _Row, action: str) -> dict[str, dict[str, Any]]:
        info = {ROLES[row.turn]: self._apply(row, action)}
        row.outputs = (*row.outputs, _clean(action) or "none")
        return info

    def _apply(self, row: _Row, action: str) -> dict[str, Any]:
        """Record one agent's action on its row; return what the environment made of it."""
        task = row.task
        if row.turn == 0:
            row.predicted, exact = parse_intent(action, self.labels)
            row.candidates = self.candidates_for(task, row.predicted)
            return {"intent": row.predicted, "valid": exact, "correct": row.predicted == task.entry.intent}
        if row.turn == 1:
            named = parse_ids(action)
            row.retrieved = tuple(i for i in named if i in self.by_id)
            gold = task.entry.id
            hits = int(gold in row.retrieved)
            f1 = 2 * hits / (len(row.retrieved) + 1) if row.retrieved else 0.0
            clean = bool(named) and re.fullmatch(r"\s*K\d+(\s*[, ]\s*K\d+)*\s*", action) is not None
            return {
                "ids": list(row.retrieved),
                "candidates": list(row.candidates),
                "valid": clean and all(i in row.candidates for i in named),
                "gold_offered": gold in row.candidates,
                "f1": f1,
            }
        shown = list(row.retrieved[:2])
        return {"shown_ids": shown, "facts": [self.by_id[i].fact for i in shown], "reply": action.strip()}


def tiny_policy_options(**model: Any) -> dict[str, Any]:
    """Options for the built-in ``tiny`` policy that read and write this environment word by word.

    Every knowledge-base word, label, entry id, cue and reply phrase is an atom (one token); digits,
    punctuation, space, newline and the one-letter words ``a`` and ``i`` are characters. ``model`` adds or
    overrides the model's size (``d_model``, ...).
    """
    return {
        "d_model": 64,
        "n_layers": 2,
        "n_heads": 4,
        "d_ff": 256,
        "max_len": 128,
        "alphabet": ALPHABET,
        "atoms": vocabulary(),
        "unknown": "unk",
        **model,
    }


@hookimpl
def register_environments(register: Any) -> None:
    register(
        "customer_service",
        CustomerServiceEnv,
        options=CustomerServiceOptions,
        description=(
            "turn-based customer-support pipeline: intent -> retrieval -> response over a synthetic knowledge base"
        ),
    )


if __name__ == "__main__":  # print the tiny policy's options block for a config file
    import json

    opts = tiny_policy_options()
    print("policy:\n  name: tiny\n  options:")
    for key, value in opts.items():
        print(f"    {key}: {json.dumps(value)}")
