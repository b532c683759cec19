"""Writes sums.jsonl next to this file: every ``a + b`` with one-digit operands (100 rows), for examples/dataset_math.yaml.

    python examples/data/make_sums.py

Each row has the question, the answer, and the number of carries (a metadata column the example passes through).
The rows are written in a fixed order, so the file is the same on every machine; the environment shuffles.
"""

from __future__ import annotations

import json
from pathlib import Path


def rows() -> list[dict[str, object]]:
    return [
        {"question": f"{a} + {b}", "answer": a + b, "carries": int(a + b >= 10)}
        for a in range(10)
        for b in range(10)
    ]


def main() -> None:
    out = Path(__file__).with_name("sums.jsonl")
    out.write_text("".join(json.dumps(row) + "\n" for row in rows()), encoding="utf-8")
    print(f"wrote {out} ({len(rows())} rows)")


if __name__ == "__main__":
    main()
