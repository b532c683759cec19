"""Writes, next to this file, every ``a + b`` with one-digit operands (100 rows) twice:

* sums.jsonl (for examples/dataset_math.yaml): the question, the answer, and the number of carries (a metadata
  column the example passes through);
* sums_chat.jsonl (for examples/smollm2_lora.yaml): the question as a chat that first shows two answered sums in
  the ``<answer>N</answer>`` form, and the answer. A small instruction-tuned model answers in that form about
  two times in three after those two turns, and almost never when only told to in words (docs/models.md).

    python examples/data/make_sums.py

The rows are written in a fixed order, so the files are the same on every machine; the environment shuffles.
"""

from __future__ import annotations

import json
from pathlib import Path


def rows() -> list[dict[str, object]]:
    return [
        {"question": f"{a} + {b}", "answer": a + b, "carries": int(a + b >= 10)} for a in range(10) for b in range(10)
    ]


SHOTS = ((3, 5), (6, 1))  # the answered sums every chat starts with


def chat_rows() -> list[dict[str, object]]:
    def turns(a: int, b: int) -> list[dict[str, str]]:
        return [
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": f"<answer>{a + b}</answer>"},
        ]

    shown = [turn for a, b in SHOTS for turn in turns(a, b)]
    return [{"messages": [*shown, turns(a, b)[0]], "answer": a + b} for a in range(10) for b in range(10)]


def main() -> None:
    for name, made in (("sums.jsonl", rows()), ("sums_chat.jsonl", chat_rows())):
        out = Path(__file__).with_name(name)
        out.write_text("".join(json.dumps(row) + "\n" for row in made), encoding="utf-8")
        print(f"wrote {out} ({len(made)} rows)")


if __name__ == "__main__":
    main()
