"""Built-in environment ``relay``: a three-turn, turn-based, multi-agent lookup task.

Each episode has its own small knowledge base about made-up places (so the answer cannot be known without
looking it up) and one user question. Three roles act in turn, each seeing only what the previous one produced:

1. ``planner`` (query understanding): rewrites the question as ``<query>ENTITY | ATTRIBUTE</query>``;
2. ``retriever`` (knowledge retrieval): sees that query and numbered documents, picks one: ``<doc>N</doc>``;
3. ``responder`` (response generation): sees the question and the chosen document, answers ``<answer>...</answer>``.

Metadata carries the ground truth (``answer``, ``entity``, ``attribute``, ``gold_doc``) for rewards; each
turn's info says what the environment parsed and whether it was right (``query_ok``, ``doc_ok``).
With ``roles: shared`` one agent (``assistant``) plays all three turns: single-agent, multi-turn.
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
from palestra.types import Message, Observation, StepResult

ROLES = ("planner", "retriever", "responder")

# attribute -> (question template, document template)
ATTRIBUTES: dict[str, tuple[str, str]] = {
    "capital": ("What is the capital of {e}?", "The capital of {e} is {v}."),
    "founder": ("Who founded {e}?", "{e} was founded by {v}."),
    "river": ("Which river flows through {e}?", "The {v} river flows through {e}."),
    "year": ("In which year was {e} founded?", "{e} was founded in {v}."),
}
_SYLLABLES = ("ka", "lo", "mir", "ten", "vel", "or", "sa", "dun", "bri", "tha", "gol", "en", "ru", "pes", "ani", "cor")


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()


def _value(attribute: str, rng: random.Random) -> str:
    if attribute == "year":
        return str(rng.randint(1100, 1950))
    if attribute == "founder":
        return f"{_name(rng, 2)} {_name(rng, 2)}"
    return _name(rng, 2)


def _tag(text: str, tag: str) -> str | None:
    found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, re.DOTALL)
    return found[-1].strip() if found else None


@dataclass
class RelayOptions:
    roles: Literal["separate", "shared"] = "separate"  # separate: planner/retriever/responder; shared: one "assistant"
    entities: int = option(3, ge=1, le=8)  # places in each episode's knowledge base (4 facts each)
    documents: int = option(4, ge=2, le=32)  # documents the retriever chooses from; one answers the question

    def __post_init__(self) -> None:
        facts = self.entities * len(ATTRIBUTES)
        if self.documents > facts:
            raise OptionError(
                "documents",
                f"must be at most entities * {len(ATTRIBUTES)} = {facts} (the facts there are), got {self.documents}",
            )


@dataclass(frozen=True)
class RelayTask:
    question: str
    entity: str
    attribute: str
    answer: str
    documents: tuple[str, ...]
    gold_doc: int

    def metadata(self) -> dict[str, Any]:
        return {
            "answer": self.answer,
            "question": self.question,
            "entity": self.entity,
            "attribute": self.attribute,
            "gold_doc": self.gold_doc,
            "documents": list(self.documents),
        }


@dataclass
class _Row:
    task: RelayTask
    turn: int = 0
    query: str = ""  # what the retriever is shown
    doc: int | None = None  # the retriever's choice


class RelayEnv:
    """Turn-based multi-agent lookup episodes. See :class:`palestra.types.Environment` for the protocol."""

    max_turns = len(ROLES)

    def __init__(self, **options: Any) -> None:
        self.options: RelayOptions = check_options(RelayOptions, options, where="relay")
        self.agent_ids = ROLES if self.options.roles == "separate" else ("assistant",)
        self._rng = random.Random()
        self._rows: list[_Row] = []

    def agent_for(self, turn: int) -> str:
        return ROLES[turn] if self.options.roles == "separate" else "assistant"

    def make_task(self, rng: random.Random) -> RelayTask:
        names: list[str] = []
        while len(names) < self.options.entities:
            name = _name(rng, 3)
            if name not in names:
                names.append(name)
        facts = [(e, a, _value(a, rng)) for e in names for a in ATTRIBUTES]
        gold = rng.choice(facts)
        others = rng.sample([f for f in facts if f is not gold], self.options.documents - 1)
        chosen = [gold, *others]
        rng.shuffle(chosen)
        docs = tuple(ATTRIBUTES[a][1].format(e=e, v=v) for e, a, v in chosen)
        entity, attribute, answer = gold
        question = ATTRIBUTES[attribute][0].format(e=entity)
        return RelayTask(question, entity, attribute, answer, docs, chosen.index(gold))

    def _observation(self, row: _Row) -> Observation:
        task, turn = row.task, row.turn
        if turn == 0:
            text = (
                "You are the query planner of a lookup team. Turn the user's question into a lookup query.\n"
                f"Question: {task.question}\nAttributes: {', '.join(ATTRIBUTES)}.\n"
                "Reply as <query>ENTITY | ATTRIBUTE</query>."
            )
        elif turn == 1:
            listing = "\n".join(f"[{i}] {d}" for i, d in enumerate(task.documents))
            text = (
                "You are the retriever of a lookup team. Pick the document that answers the query.\n"
                f"Query: {row.query}\nDocuments:\n{listing}\nReply as <doc>NUMBER</doc>."
            )
        else:
            doc = task.documents[row.doc] if row.doc is not None else "(no document was retrieved)"
            text = (
                "You are the responder of a lookup team. Answer the user's question from the retrieved document.\n"
                f"Question: {task.question}\nDocument: {doc}\nReply as <answer>ANSWER</answer>."
            )
        return Observation(
            prompt=text,
            agent_id=self.agent_for(turn),
            messages=[Message("user", text)],
            metadata=task.metadata(),
            turn=turn,
        )

    def reset(self, batch_size: int, *, seed: int | None = None, group_size: int = 1) -> list[Observation]:
        tasks = draw_tasks(self.make_task, self._rng, batch_size, seed, group_size, "relay")
        self._rows = [_Row(task) for task in tasks]
        return [self._observation(r) for r in self._rows]

    def step(self, actions: Sequence[str | None]) -> StepResult:
        return step_turns("relay", self._rows, actions, self.max_turns, self._act, self._observation)

    def _act(self, row: _Row, action: str) -> dict[str, dict[str, Any]]:
        return {self.agent_for(row.turn): self._apply(row, action)}

    def _apply(self, row: _Row, action: str) -> dict[str, Any]:
        """Record one agent's action on its row; return what the environment made of it."""
        task = row.task
        if row.turn == 0:
            query = _tag(action, "query")
            parts = [p.strip() for p in query.split("|")] if query is not None else []
            ok = (
                len(parts) == 2
                and parts[0].casefold() == task.entity.casefold()
                and parts[1].casefold() == task.attribute
            )
            row.query = query if query is not None else " ".join(action.split())[:200] or "(empty)"
            return {"query": query, "query_ok": ok}
        if row.turn == 1:
            raw = _tag(action, "doc")
            row.doc = int(raw) if raw is not None and raw.isdigit() and int(raw) < len(task.documents) else None
            return {"doc": row.doc, "doc_ok": row.doc == task.gold_doc}
        return {"answer": _tag(action, "answer")}


@hookimpl
def register_environments(register: Any) -> None:
    register(
        "relay",
        RelayEnv,
        options=RelayOptions,
        description=(
            "turn-based multi-agent lookup: planner -> retriever -> responder over a per-episode knowledge base"
        ),
    )
