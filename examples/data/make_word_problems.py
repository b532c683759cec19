"""Writes word_problems.jsonl, next to this file: short word problems whose arithmetic a small model cannot do in
its head, for examples/smollm2_calculator.yaml (a model that learns to call the calculator tool).

Half the rows multiply a 3-digit number by a 2-digit one ("A crate holds 437 apples. How many apples are in 28
crates?"), half add four 3-digit numbers ("Four shelves hold 312, 845, 109 and 560 books. How many books are there
in all?"); the two kinds alternate. Each row has

* ``messages`` (for the run with the calculator): two worked problems, each the user's question, the model's
  ``calculator`` call in the hermes format, the tool's result and the model's ``<answer>N</answer>``, then the
  question. No system message: the ``tools:`` section's ``system_prompt`` and the tool's description make it. A
  135M model almost never calls a tool it is only told about; after the two worked problems its greedy first turn
  calls the calculator 17 times in 20, with the right expression 11 times (bench/smollm2_tool_probe.py);
* ``messages_no_tool`` (for the same model without the tool, the baseline): a system message, the same two
  problems answered directly in the tag, then the question;
* ``answer``: the exact result, an integer (the ``correctness`` reward reads the last ``<answer>`` tag and
  compares by value);
* ``kind``: ``product`` or ``sum`` (a metadata column, for reading results per kind).

The no-tool questions end by asking for the final answer as ``<answer>N</answer>``; the tool chats' questions do
not, as the example's ``tools.system_prompt`` says it: with the request repeated in every question, the model calls
the calculator less often (greedy: 12 of 20 problems against 17; bench/smollm2_tool_probe.py, variants short_shot2
and short_shot2_noask).

    python examples/data/make_word_problems.py

The numbers come from a fixed seed, so the file is the same on every machine; the dataset environment holds out
``eval_size`` rows of it (chosen by its ``split_seed``) and shuffles the rest.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ROWS = 400  # 200 of each kind
SEED = 24

SYSTEM = "You are a careful assistant who solves arithmetic word problems."  # the no-tool chats' system message
ASK = "Give the final answer as <answer>N</answer>."  # ends the no-tool questions

# The worked problems every chat starts with (a product, then a sum): the question, the expression, the value. Their
# wording is in neither template list below, so no row repeats them.
SHOTS = (
    ("A box holds 214 pencils. How many pencils are in 36 boxes?", "214 * 36", 214 * 36),
    ("Four farms have 352, 618, 127 and 490 cows. How many cows are there in all?", "352 + 618 + 127 + 490", 1587),
)

# (how one unit holds the items, the question), over {a} (3 digits, per unit) and {b} (2 digits, the units).
PRODUCTS = (
    "A crate holds {a} apples. How many apples are in {b} crates?",
    "A book has {a} pages. How many pages are in {b} copies of the book?",
    "A train carries {a} passengers on each trip. How many passengers does it carry in {b} trips?",
    "A factory makes {a} bottles an hour. How many bottles does it make in {b} hours?",
    "Each box holds {a} nails. How many nails are in {b} boxes?",
    "A ticket costs {a} dollars. How many dollars do {b} tickets cost?",
    "A farmer plants {a} seeds in each row. How many seeds are in {b} rows?",
    "A truck moves {a} bricks in one load. How many bricks does it move in {b} loads?",
)

# Four numbers {a}, {b}, {c}, {d}, each 3 digits.
SUMS = (
    "Four shelves hold {a}, {b}, {c} and {d} books. How many books are there in all?",
    "A shop sold {a}, {b}, {c} and {d} cups on four days. How many cups did it sell in all?",
    "Four classes collected {a}, {b}, {c} and {d} cans. How many cans did they collect together?",
    "A runner ran {a}, {b}, {c} and {d} meters in four laps. How many meters did she run in total?",
    "Four buses carried {a}, {b}, {c} and {d} people. How many people did the buses carry altogether?",
    "A baker made {a}, {b}, {c} and {d} rolls on four mornings. How many rolls did he make in all?",
    "Four towns planted {a}, {b}, {c} and {d} trees. How many trees were planted in total?",
    "A library lent {a}, {b}, {c} and {d} books in four weeks. How many books did it lend altogether?",
)


def product_row(rng: random.Random) -> dict[str, object]:
    a, b = rng.randint(100, 999), rng.randint(11, 99)
    question = rng.choice(PRODUCTS).format(a=a, b=b)
    return {"question": question, "answer": a * b, "kind": "product"}


def sum_row(rng: random.Random) -> dict[str, object]:
    a, b, c, d = (rng.randint(100, 999) for _ in range(4))
    question = rng.choice(SUMS).format(a=a, b=b, c=c, d=d)
    return {"question": question, "answer": a + b + c + d, "kind": "sum"}


def tool_call(expression: str) -> str:
    """A calculator call in the hermes format (plugins/tools/parsers.py)."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def with_tool(question: str) -> list[dict[str, str]]:
    shown: list[dict[str, str]] = []
    for shot, expression, value in SHOTS:
        shown += [
            {"role": "user", "content": shot},
            {"role": "assistant", "content": tool_call(expression)},
            {"role": "tool", "content": str(value)},
            {"role": "assistant", "content": f"<answer>{value}</answer>"},
        ]
    return [*shown, {"role": "user", "content": question}]


def without_tool(question: str) -> list[dict[str, str]]:
    shown: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    for shot, _, value in SHOTS:
        shown += [
            {"role": "user", "content": f"{shot} {ASK}"},
            {"role": "assistant", "content": f"<answer>{value}</answer>"},
        ]
    return [*shown, {"role": "user", "content": f"{question} {ASK}"}]


def rows(n: int = ROWS, seed: int = SEED) -> list[dict[str, object]]:
    """``n`` rows, products and sums alternating, every question distinct."""
    rng = random.Random(seed)
    made: list[dict[str, object]] = []
    seen: set[object] = set()
    while len(made) < n:
        row = (product_row if len(made) % 2 == 0 else sum_row)(rng)
        if row["question"] in seen:  # a repeat would sit in both splits
            continue
        seen.add(row["question"])
        question = str(row["question"])
        made.append(
            {
                "messages": with_tool(question),
                "messages_no_tool": without_tool(question),
                "answer": row["answer"],
                "kind": row["kind"],
            }
        )
    return made


def main() -> None:
    made = rows()
    out = Path(__file__).with_name("word_problems.jsonl")
    out.write_text("".join(json.dumps(row) + "\n" for row in made), encoding="utf-8")
    print(f"wrote {out} ({len(made)} rows)")


if __name__ == "__main__":
    main()
