"""The synthetic customer-support knowledge base behind the ``customer_service`` environment.

Five intents (``billing``, ``shipping``, ``returns``, ``account``, ``technical``), four topics each. A topic
is one knowledge-base entry: a short title (what the retrieval agent sees), a fact with one slot (what the
response agent must state), and paraphrased customer queries. Queries of one intent ask about different
entries, and many paraphrases share no word with the entry's title, so retrieval is a real choice among
entries of the same intent, not keyword matching.

:func:`build_kb` turns the topic table into entries with ids (``K1``..``K20``) and slot values, both drawn
from ``kb_seed``: the same seed gives the same knowledge base. Every word used anywhere (queries, titles,
facts, labels, ids, the environment's cues, polite and rude reply words) is listed by :func:`vocabulary`,
so a word-level tokenizer (the tiny policy with these words as atoms) reads and writes all of it.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

INTENTS: tuple[str, ...] = ("billing", "shipping", "returns", "account", "technical")


@dataclass(frozen=True)
class Topic:
    title: str
    fact: str  # one "{v}" slot: the value the reply must state
    values: tuple[str, ...]  # candidate slot values (one is drawn per knowledge base)
    queries: tuple[str, ...]  # paraphrases, most varied last; "{item}" is filled from ITEMS


ITEMS: tuple[str, ...] = ("order", "parcel", "package")

TOPICS: dict[str, tuple[Topic, ...]] = {
    "billing": (
        Topic(
            "refund time",
            "refunds take {v} days",
            ("3", "5", "7"),
            ("when do i get my refund ?", "how long does a refund take ?", "where is my money back ?"),
        ),
        Topic(
            "late fee",
            "the late fee is {v} dollars",
            ("2", "4", "6"),
            ("is there a fee if i pay late ?", "what if my payment is late ?", "do you charge for late bills ?"),
        ),
        Topic(
            "payment options",
            "we accept {v}",
            ("cards", "paypal", "cash"),
            ("how can i pay my bill ?", "which payment options do you take ?", "what ways can i pay ?"),
        ),
        Topic(
            "invoice copy",
            "invoices are in the {v} tab",
            ("orders", "profile", "history"),
            ("where can i find my invoice ?", "can i get a copy of my bill ?", "i need a receipt"),
        ),
    ),
    "shipping": (
        Topic(
            "delivery time",
            "delivery takes {v} days",
            ("2", "4", "6"),
            ("how long does delivery take ?", "when will my {item} arrive ?", "how fast do you ship ?"),
        ),
        Topic(
            "shipping cost",
            "shipping costs {v} dollars",
            ("3", "5", "8"),
            ("how much is shipping ?", "do i pay for delivery ?", "what does it cost to send ?"),
        ),
        Topic(
            "order tracking",
            "track orders in the {v}",
            ("app", "email", "website"),
            ("how do i track my {item} ?", "where is my {item} now ?", "can i see where my {item} is ?"),
        ),
        Topic(
            "international shipping",
            "we ship to {v} countries",
            ("8", "9", "6"),
            ("do you ship abroad ?", "can you send to another country ?", "do you deliver overseas ?"),
        ),
    ),
    "returns": (
        Topic(
            "return window",
            "returns are open for {v} days",
            ("9", "4", "8"),
            ("can i still return my {item} ?", "how long do i have to return it ?", "is it too late to send it back ?"),
        ),
        Topic(
            "return label",
            "labels are sent by {v}",
            ("email", "text", "post"),
            ("how do i get a return label ?", "where is my return label ?", "i need a label to send it back"),
        ),
        Topic(
            "exchanges",
            "exchanges are free for {v} weeks",
            ("2", "3", "4"),
            ("can i exchange my {item} ?", "can i swap for another size ?", "i want a different size"),
        ),
        Topic(
            "damaged item",
            "send a photo by {v}",
            ("email", "chat", "app"),
            ("my {item} arrived broken", "the {item} is damaged", "what if it came broken ?"),
        ),
    ),
    "account": (
        Topic(
            "password reset",
            "reset links last {v} hours",
            ("2", "6", "8"),
            ("how do i reset my password ?", "i forgot my password", "i cannot log in"),
        ),
        Topic(
            "change email",
            "change your email in {v}",
            ("settings", "profile"),
            ("how do i change my email ?", "can i update my email ?", "i have a new address"),
        ),
        Topic(
            "close account",
            "closing an account takes {v} days",
            ("3", "5", "7"),
            ("how do i close my account ?", "can you delete my account ?", "i want to leave for good"),
        ),
        Topic(
            "username",
            "usernames can change every {v} months",
            ("3", "6", "9"),
            ("can i change my username ?", "how do i get a new username ?", "i want a different name"),
        ),
    ),
    "technical": (
        Topic(
            "app crash",
            "update the app to version {v}",
            ("4", "5", "6"),
            ("the app keeps crashing", "why does the app close ?", "the app will not open"),
        ),
        Topic(
            "site error",
            "the site is back in {v} hours",
            ("2", "3", "4"),
            ("the website is not loading", "i see an error page", "is the site down ?"),
        ),
        Topic(
            "notifications",
            "turn on alerts in {v}",
            ("settings", "profile"),
            ("how do i turn on notifications ?", "i get no alerts", "why is my phone silent ?"),
        ),
        Topic(
            "slow app",
            "clear the cache every {v} weeks",
            ("2", "3", "4"),
            ("the app is slow", "why is everything so slow ?", "pages take ages to load"),
        ),
    ),
}

# Reply words. Capitalised openers start a well-formed reply; the offers close it politely.
GREETINGS = ("Hello", "Hi")
THANKS = ("Thanks", "Thank you")
APOLOGIES = ("Sorry",)
OFFERS = ("Happy to help", "Glad to help")
RUDE = ("whatever", "stupid", "not my problem", "go away")
COMMON_REPLY_WORDS = ("yes", "please", "and", "so", "for", "asking", "waiting", "note", "that")
CUES = ("Q:", "intent:", "entry:", "fact:", "reply:", "none")

POLITE_MARKERS: dict[str, tuple[str, ...]] = {
    "greeting": GREETINGS,
    "thanks": THANKS,
    "apology": APOLOGIES,
    "offer": OFFERS,
}

_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> list[str]:
    """Lower-case words and numbers of ``text`` (punctuation dropped): how every scorer here reads text."""
    return _WORD.findall(text.lower())


@dataclass(frozen=True)
class Entry:
    id: str  # "K7"
    intent: str
    title: str
    fact: str  # "refunds take 5 days"
    value: str  # the slot value as stated: "5 days", "paypal"
    queries: tuple[str, ...]


def _value_phrase(fact_template: str, value: str) -> str:
    """The slot value as a checkable phrase: a number with its unit (``"5 days"``, ``"version 4"``), or the word
    (``"paypal"``)."""
    before, after = (part.split() for part in fact_template.split("{v}", 1))
    if not value.isdigit():
        return value
    return f"{value} {after[0]}" if after else f"{before[-1]} {value}"


def build_kb(intents: int = 5, topics_per_intent: int = 4, kb_seed: int = 0) -> tuple[Entry, ...]:
    """The entries of the first ``intents`` intents, ``topics_per_intent`` topics each; ids and values from
    ``kb_seed``."""
    if not 1 <= intents <= len(INTENTS):
        raise ValueError(f"intents must be in 1..{len(INTENTS)}, got {intents}")
    if not 1 <= topics_per_intent <= 4:
        raise ValueError(f"topics_per_intent must be in 1..4, got {topics_per_intent}")
    rng = random.Random(f"palestra-support-kb:{kb_seed}")
    chosen = [(intent, topic) for intent in INTENTS[:intents] for topic in TOPICS[intent][:topics_per_intent]]
    numbers = list(range(1, len(chosen) + 1))
    rng.shuffle(numbers)
    entries = []
    for (intent, topic), n in zip(chosen, numbers):
        v = rng.choice(topic.values)
        entries.append(
            Entry(f"K{n}", intent, topic.title, topic.fact.format(v=v), _value_phrase(topic.fact, v), topic.queries)
        )
    return tuple(entries)


def vocabulary() -> list[str]:
    """Every word and phrase the environment writes or a good reply needs, longest first (a tokenizer's atoms).

    Independent of the options and the seed (it covers all intents, topics, values and ids), so one tiny-policy
    configuration serves every variant of the environment.
    """
    items: set[str] = set(INTENTS) | set(ITEMS) | set(CUES)
    for topics in TOPICS.values():
        for t in topics:
            for text in (t.title, *t.queries, *(t.fact.format(v=v) for v in t.values)):
                items.update(w for w in text.replace("{item}", "").split() if not w.isdigit() and w not in "?.,!")
    items.update(f"K{n}" for n in range(1, 21))
    phrases = (*GREETINGS, *THANKS, *APOLOGIES, *OFFERS, *RUDE, *COMMON_REPLY_WORDS)
    items.update(phrases)
    return sorted((w for w in items if len(w) >= 2), key=lambda w: (-len(w), w))


def known_words() -> frozenset[str]:
    """The lower-case words the fluency scorer counts as known (numbers are always known)."""
    return _KNOWN


_KNOWN = frozenset(w for item in vocabulary() for w in words(item)) | frozenset({"a", "i"})
_LONGEST = max(len(w) for w in _KNOWN)
_DIGITS = re.compile(r"[0-9]+")


def segment(text: str) -> list[str]:
    """The words of ``text``, with run-together known words split apart: ``"Thanks,refundstake5days"`` ->
    ``["thanks", "refunds", "take", "5", "days"]``.

    Splitting is greedy, longest known word first, as the word-level tokenizer reads text; characters that
    start no known word are skipped. The content scorers (intent, facts, politeness) read text this way, so
    a policy that has not yet learnt to put spaces between its words still gets credit for them; spacing is
    the fluency scorer's business.
    """
    out: list[str] = []
    for w in words(text):
        if w in _KNOWN or w.isdigit():
            out.append(w)
            continue
        i = 0
        while i < len(w):
            digits = _DIGITS.match(w, i)
            if digits:
                out.append(digits.group())
                i = digits.end()
                continue
            for n in range(min(_LONGEST, len(w) - i), 0, -1):
                if w[i : i + n] in _KNOWN:
                    out.append(w[i : i + n])
                    i += n
                    break
            else:
                i += 1
    return out
