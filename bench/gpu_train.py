#!/usr/bin/env python
"""One command for a machine with a GPU: a bf16 SmolLM2-135M GRPO run, synchronous and then with ``train.async``,
with each step's breakdown and tokens/s, after the decode loop alone (bench/decode_speed.py: ``kv_cache`` against
``static_kv``, eager and as a CUDA graph, with the graph's greedy completions checked against the eager step's).

The setup is the real-model goal of docs/performance.md: a full fine-tune (``--lora`` for the adapters alone),
8 prompts x 8 completions of up to 64 tokens, GRPO with a KL term to the frozen reference, bf16 autocast, sampling
with the ``static_kv`` generator. Each side is a real ``palestra train`` (bench/async_speed.py runs it), one after
the other; the first step of each is left out of the medians (compilation, the first batch). On a GPU the runs
decode with ``static_kv``'s compiled step, a CUDA graph.

    python bench/gpu_train.py --out gpu_train.json           # on the GPU machine (about 5 minutes on one H100)
    python bench/gpu_train.py --device cpu --steps 2 --quick # a smoke check of the script on a CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from async_speed import one_run  # noqa: E402 - bench/ is not a package

CONFIG = HERE.parent / "examples" / "smollm2_lora.yaml"


def overrides(device: str, lora: bool, quick: bool) -> list[str]:
    sizes = ["train.batch_size=2", "train.group_size=2", "train.max_new_tokens=8"] if quick else []
    return [
        f"train.device={device}",
        "train.precision=bf16",
        "train.batch_size=8",
        "train.group_size=8",
        "train.max_new_tokens=64",
        "train.grad_accum=1",
        "train.eval_size=4",
        "train.warmup_steps=0",
        "optimizer.options.beta=0.04",
        f"generator={{name: static_kv, options: {{compile: {'false' if device == 'cpu' else 'true'}}}}}",
        "policy.options.attn_implementation=sdpa",
        "policy.options.generation_attn_implementation=sdpa",
        *([] if lora else ["policy.options.lora=null", "train.lr=1e-6"]),
        *sizes,
    ]


def breakdown(run: dict[str, Any]) -> str:
    parts = run["parts_median"]
    shown = ", ".join(f"{k.removeprefix('perf/')} {v:.2f}" for k, v in parts.items())
    return f"step {run['median_step_s']:.2f} s ({shown}); tokens/s {run['tokens_per_s']:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--lora", action="store_true", help="train the example's LoRA adapters, not every weight")
    ap.add_argument("--quick", action="store_true", help="tiny batches: checks the script, not the speed")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    extra = overrides(args.device, args.lora, args.quick)
    result: dict[str, Any] = {"device": args.device, "overrides": extra}
    decode_out = Path("gpu_decode.json") if args.out is None else args.out.with_name(args.out.stem + "_decode.json")
    sizes = ["--prompts", "2", "--group", "2", "--new-tokens", "8", "--reps", "1"] if args.quick else []
    compiled = [] if args.device == "cpu" else ["--compile"]
    decode = [sys.executable, str(HERE / "decode_speed.py"), "--device", args.device, *compiled, *sizes]
    subprocess.run([*decode, "--out", str(decode_out)], check=True)
    result["decode"] = json.loads(decode_out.read_text())
    for name, worker in (("sync", None), ("async", 1)):
        run = one_run(CONFIG, args.steps, 4, worker, extra)
        run["tokens_per_s"] = statistics.median(run["tokens_per_s_steps"][1:])
        result[name] = run
        print(f"{name:>5}: {breakdown(run)}", flush=True)
    result["async_speedup"] = result["sync"]["median_step_s"] / result["async"]["median_step_s"]
    print(f"async / sync steps per hour: {result['async_speedup']:.2f}x")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
