"""Prove that a refactor changed no behaviour: train the same configs at two commits and compare bitwise.

For each commit the script exports the tree (``git archive``: a clean copy, whatever the work tree holds), installs
it without dependencies into a folder of its own (``pip install --target``: the installed package and its entry
points, found first through ``PYTHONPATH``), and trains every case below for ``--steps`` steps, one thread per
process, checkpointing every step (``train.save_every=1``) and logging every step (``train.log_every=1``):

* ``default``: ``palestra train`` with no config;
* every ``examples/*.yaml``, as the earlier commit wrote them (MAPPO and the multi-agent ones included).
  ``hf_local`` gets a tiny Llama folder (``tests/fixtures/tiny_hf.py``) as ``policy.options.path``, and
  ``smollm2_lora`` (LoRA through peft) a tiny Llama GGUF file (``tests/fixtures/tiny_gguf.py``) as
  ``policy.options.path`` and ``policy.options.gguf_file``; both are built once and handed to both commits;
* ``torchrun_ddp`` and ``torchrun_fsdp``: the default run on 2 CPU processes over gloo
  (``torchrun --nproc_per_node=2 -m palestra train distributed.strategy=ddp|fsdp``), and
  ``customer_service_mappo_ddp`` / ``_fsdp``: the MAPPO example the same way;
* ``NAME_dense``: the default run, every single-agent example and the two torchrun default runs again with a length
  reward that differs for almost every completion (see ``DENSE_TARGET``): a few steps of the examples' own rewards
  leave most advantages at 0.

Then it compares each case's run folders with ``bitwise_compare.compare_runs`` (metrics but the wall-clock keys,
every checkpoint bitwise but the file header's run id, save time and digest, numpy's global RNG state and the logged
file sizes) and prints one line per case. Exit status 0 when every case matches, 1 otherwise (a run that fails on
either side counts as a mismatch; its output is in ``runs/NAME.log`` beside the run folders).

Checked on 328b40e against itself: 38 cases identical; against the same commit with GRPO's advantages scaled by
one ulp, ``grpo_dense`` and both torchrun ``_dense`` cases differ at step 1 and ``ppo_dense`` stays identical.

Both commits at once, or the earlier side kept once and reused:

    python bench/bitwise_before_after.py --before 328b40e --after HEAD [--steps 3] [--only grpo,default]
    python bench/bitwise_before_after.py --before 328b40e --keep /work/bitwise-before     # the before side alone
    python bench/bitwise_before_after.py --before-dir /work/bitwise-before --after HEAD   # later: the after side

``--keep DIR`` writes the before side (its exported tree, installed site, kernel cache and run folders, the tiny
models, and ``manifest.json``: the commit, the steps, the Python/torch/transformers versions, every case's command
and outcome) under ``DIR``; run again with the same commit it skips the cases already done.
``--before-dir DIR`` runs only the after side, with the manifest's cases and the kept tiny models, in a temporary
folder (removed when everything matches, kept and named otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bitwise_compare import compare_runs

ROOT = Path(__file__).resolve().parents[1]
MANIFEST = "manifest.json"
GGUF_NAME = "tiny-llama.gguf"  # tests/fixtures/tiny_gguf.py's file name
# Environment variables a run must not inherit: torchrun's rendezvous, test hooks, another install's path.
INHERITED_NOT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH")


@dataclass
class Case:
    """One training run, the same on both sides: ``palestra train ARGS`` in one process or under torchrun."""

    name: str
    args: list[str]
    torchrun: bool = False
    seconds: float | None = None  # how long the kept side's run took
    error: str | None = None  # why the kept side's run failed; None when it finished


@dataclass
class Manifest:
    """What a kept before side holds: enough to run the after side the same way and to refuse a mismatched reuse."""

    commit: str
    steps: int
    versions: dict[str, str]
    cases: dict[str, Case] = field(default_factory=dict)

    def write(self, folder: Path) -> None:
        (folder / MANIFEST).write_text(json.dumps(asdict(self), indent=1) + "\n")

    @staticmethod
    def read(folder: Path) -> Manifest:
        raw = json.loads((folder / MANIFEST).read_text())
        return Manifest(raw["commit"], raw["steps"], raw["versions"], {k: Case(**v) for k, v in raw["cases"].items()})


def fail(message: str) -> None:
    sys.exit(f"bitwise_before_after: {message}")


def sh(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, text=True, capture_output=True, check=False)


def commit_of(rev: str) -> str:
    sha = sh("git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", cwd=ROOT).stdout.strip()
    if not sha:
        fail(f"{rev!r} is not a commit of {ROOT}")
    return sha


def versions() -> dict[str, str]:
    """What the numbers depend on besides the commit: a kept side run under other versions cannot match bitwise."""
    import torch
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
    }


def install(sha: str, side: Path) -> Path:
    """Export ``sha`` into ``side/src`` and install it into ``side/site``; returns the site folder. A site of the
    same commit already there (a kept side run again) is reused."""
    src, site, stamp = side / "src", side / "site", side / "commit"
    if stamp.exists() and stamp.read_text().strip() == sha and (site / "palestra").is_dir():
        return site
    for folder in (src, site):
        shutil.rmtree(folder, ignore_errors=True)
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "--format=tar", sha], cwd=ROOT, capture_output=True, check=False)
    if archive.returncode:
        fail(f"git archive {sha[:12]} failed: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive.stdout, check=True)
    out = sh(
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        "--target",
        str(site),
        str(src),
    )
    if out.returncode:
        fail(f"installing {sha[:12]} failed: {out.stderr.strip().splitlines()[-1]}")
    stamp.write_text(sha + "\n")
    return site


def tiny_models(work: Path) -> tuple[Path, Path]:
    """``(hf_dir, gguf_path)``: a tiny Llama folder and a tiny Llama GGUF file under ``work``, built once."""
    sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
    hf_dir, gguf_path = work / "tiny-llama", work / "tiny-gguf" / "gguf" / GGUF_NAME
    if not (hf_dir / "config.json").exists():
        from tiny_hf import build_llama

        build_llama(hf_dir)
    if not gguf_path.exists():
        from tiny_gguf import build_llama_gguf

        built, _ = build_llama_gguf(work / "tiny-gguf")
        assert built == gguf_path, built
    return hf_dir, gguf_path


# From random weights a few steps rarely earn an example's reward (the answer format comes later), so every
# advantage is 0 and a changed policy-gradient term would go unseen. The dense variants swap the reward for a
# length one whose target lies beyond any completion: the score is then length / target, different for almost every
# completion, so every group has non-zero advantages from the first step. Targets in characters: the tiny policy
# writes at most a few dozen, the hf ones (256 and 12 new tokens of a byte-level tokenizer) at most a few thousand.
DENSE_TARGET = {"tiny": 64, "hf": 8192}


def dense_reward(target: int) -> str:
    return f"reward={{name: length, options: {{target: {target}, unit: chars}}}}"


def single_agent_policy(path: Path) -> str | None:
    """The policy name of an example without agents (MAPPO's already earn non-zero rewards), else None."""
    import yaml

    raw = yaml.safe_load(path.read_text())
    return None if raw.get("agents") else raw.get("policy", {}).get("name", "tiny")


def cases(examples: Path, hf_dir: Path, gguf_path: Path) -> dict[str, Case]:
    """Every case, named; ``examples`` is the earlier commit's folder, which both sides train from."""
    out = {"default": Case("default", [])}
    dense = {"default_dense": Case("default_dense", [dense_reward(DENSE_TARGET["tiny"])])}
    for path in sorted(examples.glob("*.yaml")):
        args = ["--config", str(path)]
        if path.stem == "hf_local":
            args.append(f"policy.options.path={hf_dir}")
        elif path.stem == "smollm2_lora":
            args += [f"policy.options.path={gguf_path.parent}", f"policy.options.gguf_file={gguf_path.name}"]
        out[path.stem] = Case(path.stem, args)
        policy = single_agent_policy(path)
        if policy in DENSE_TARGET:
            dense[f"{path.stem}_dense"] = Case(f"{path.stem}_dense", [*args, dense_reward(DENSE_TARGET[policy])])
    out.update(dense)
    mappo = ["--config", str(examples / "customer_service_mappo.yaml"), "train.batch_size=4"]  # 2 episodes a rank
    for strategy in ("ddp", "fsdp"):
        # gloo and a short collective timeout: a rank that dies fails the job in seconds instead of hanging it
        dist = [
            "train.device=cpu",
            f"distributed.strategy={strategy}",
            "distributed.backend=gloo",
            "distributed.timeout_s=300",
        ]
        out[f"torchrun_{strategy}"] = Case(f"torchrun_{strategy}", dist, torchrun=True)
        out[f"torchrun_{strategy}_dense"] = Case(
            f"torchrun_{strategy}_dense", [*dist, dense_reward(DENSE_TARGET["tiny"])], torchrun=True
        )
        out[f"customer_service_mappo_{strategy}"] = Case(
            f"customer_service_mappo_{strategy}", mappo + dist, torchrun=True
        )
    return out


def train(case: Case, site: Path, side: Path, examples: Path, steps: int, timeout: float) -> Path:
    """Run ``case`` with the install in ``site``; returns its run folder (``side/runs/NAME``). Raises
    ``RuntimeError`` with the output's last lines when it fails."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PALESTRA_", "TORCHELASTIC_")) and k not in INHERITED_NOT
    }
    # One kernel cache per side: the two installs build the same sources at different paths.
    env.update(
        PYTHONPATH=str(site),
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONHASHSEED="0",
        PALESTRA_CACHE_DIR=str(side / "kernel-cache"),
    )
    # The examples' relative data paths (examples/data/...) resolve against the working folder: the earlier commit's.
    link = side / "examples"
    if not link.exists():
        link.symlink_to(examples, target_is_directory=True)
    run_dir = side / "runs" / case.name
    shutil.rmtree(run_dir, ignore_errors=True)
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        if case.torchrun
        else [sys.executable]
    )
    # A relative output folder, so that the configs saved in both sides' checkpoints are the same text.
    cmd = [
        *launcher,
        "-m",
        "palestra",
        "train",
        *case.args,
        f"train.steps={steps}",
        "train.save_every=1",
        "train.log_every=1",
        "run.output_dir=runs",
        f"run.name={case.name}",
    ]
    # A session of its own, so that a run past the timeout is ended with every process torchrun started.
    proc = subprocess.Popen(
        cmd, cwd=side, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(f"palestra train ran past {timeout:.0f} s") from None
    (side / "runs").mkdir(exist_ok=True)
    (side / "runs" / f"{case.name}.log").write_text(f"$ {' '.join(cmd)}\n{stdout}\n--- stderr ---\n{stderr}")
    if proc.returncode:
        tail = (stderr.strip() or stdout.strip()).splitlines()[-3:]
        raise RuntimeError(f"palestra train exited {proc.returncode}: {' | '.join(tail)}")
    return run_dir


def timed_train(
    case: Case, site: Path, side: Path, examples: Path, steps: int, timeout: float
) -> tuple[float, str | None]:
    """``(seconds, error)`` of one run; error is None when it finished."""
    start = time.monotonic()
    try:
        train(case, site, side, examples, steps, timeout)
        error = None
    except RuntimeError as e:
        error = str(e)
    return time.monotonic() - start, error


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    before = ap.add_mutually_exclusive_group(required=True)
    before.add_argument("--before", help="the earlier commit (run it here)")
    before.add_argument("--before-dir", help="a before side kept with --keep: compare against it without re-running")
    ap.add_argument(
        "--after", default=None, help="the later commit; without it, --before --keep runs the before side alone"
    )
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--only", default=None, help="comma-separated case names (default, grpo, torchrun_fsdp, ...)")
    ap.add_argument(
        "--keep", default=None, help="keep the before side (and, with --after, the after side) in this folder"
    )
    ap.add_argument("--timeout", type=float, default=1800, help="seconds one training run may take")
    args = ap.parse_args()
    if args.before_dir and args.keep:
        fail("--keep writes a before side and --before-dir reads one; give one of them")
    if args.before_dir and not args.after:
        fail("--before-dir needs --after: the commit to compare with the kept side")
    if args.before and not (args.after or args.keep):
        fail("--before alone compares nothing: give --after, or --keep DIR to keep the before side for later")
    only = set(args.only.split(",")) if args.only else None
    after_sha = commit_of(args.after) if args.after else None

    if args.before_dir:
        kept = Path(args.before_dir).resolve()
        if not (kept / MANIFEST).exists():
            fail(f"--before-dir: {str(kept)!r} holds no {MANIFEST} (write one with --before REV --keep DIR)")
        manifest = Manifest.read(kept)
        if manifest.versions != versions():
            print(f"warning: the kept side ran under {manifest.versions}, this one runs under {versions()}", flush=True)
        if args.steps != ap.get_default("steps") and args.steps != manifest.steps:
            fail(f"--steps {args.steps}: the kept side ran {manifest.steps} steps")
        before_side = kept / "before"
        work = Path(tempfile.mkdtemp(prefix="palestra-bitwise-after-"))
    else:
        sha = commit_of(args.before)
        work = Path(args.keep).resolve() if args.keep else Path(tempfile.mkdtemp(prefix="palestra-bitwise-"))
        work.mkdir(parents=True, exist_ok=True)
        before_side = work / "before"
        manifest = Manifest(sha, args.steps, versions())
        if (work / MANIFEST).exists():
            old = Manifest.read(work)
            if (old.commit, old.steps, old.versions) == (sha, args.steps, manifest.versions):
                manifest.cases = {k: v for k, v in old.cases.items() if v.error is None}  # done: skipped this time
            else:
                shutil.rmtree(before_side, ignore_errors=True)  # another commit's runs: start afresh
    try:
        return run_cases(args, manifest, work, before_side, after_sha, only)
    except SystemExit:
        if not args.keep:  # a temporary folder, of no use once a setup step failed
            shutil.rmtree(work, ignore_errors=True)
        raise


def run_cases(
    args: argparse.Namespace,
    manifest: Manifest,
    work: Path,
    before_side: Path,
    after_sha: str | None,
    only: set[str] | None,
) -> int:
    """Train the chosen cases (the before side unless kept, the after side when given), compare, print a line each."""
    steps = manifest.steps
    examples = before_side / "src" / "examples"
    models = Path(args.before_dir).resolve() if args.before_dir else work
    hf_dir, gguf_path = tiny_models(models)

    before_site = None if args.before_dir else install(manifest.commit, before_side)
    chosen = cases(examples, hf_dir, gguf_path)
    if args.before_dir:
        chosen = {k: manifest.cases.get(k, v) for k, v in chosen.items() if k in manifest.cases}
    if only is not None:
        unknown = only - set(chosen)
        if unknown:
            fail(f"--only: no case named {', '.join(sorted(unknown))} (cases: {', '.join(chosen)})")
        chosen = {k: v for k, v in chosen.items() if k in only}
    after_side = work / "after"
    after_site = install(after_sha, after_side) if after_sha else None

    failed = 0
    total_before = total_after = 0.0
    for name, case in chosen.items():
        if before_site is not None:
            done = manifest.cases.get(name)
            if done is not None and (before_side / "runs" / name).is_dir():
                case = done
            else:
                case.seconds, case.error = timed_train(case, before_site, before_side, examples, steps, args.timeout)
                manifest.cases[name] = case
                if args.keep:
                    manifest.write(work)
        total_before += case.seconds or 0.0
        if case.error is not None:
            print(f"{name:28s} FAILED before: {case.error}", flush=True)
            failed += 1
            continue
        if after_site is None:
            print(f"{name:28s} ran ({case.seconds:.0f} s)", flush=True)
            continue
        seconds, error = timed_train(case, after_site, after_side, examples, steps, args.timeout)
        total_after += seconds
        if error is not None:
            print(f"{name:28s} FAILED after: {error}", flush=True)
            failed += 1
            continue
        found = compare_runs(before_side / "runs" / name, after_side / "runs" / name)
        what = (
            f"DIFFERS: {found.problem}"
            if found.problem
            else f"identical ({found.metric_lines} metric lines, {found.checkpoints} checkpoints bitwise)"
        )
        print(f"{name:28s} {what} [{case.seconds:.0f} s / {seconds:.0f} s]", flush=True)
        failed += found.problem is not None

    label = f"{manifest.commit[:9]} -> {args.after}" if args.after else f"{manifest.commit[:9]} kept in {work}"
    verdict = (
        f"{len(chosen) - failed} identical, {failed} differing or failed"
        if args.after
        else f"{len(chosen) - failed} ran, {failed} failed"
    )
    print(f"{verdict} ({label}, {steps} steps; before {total_before:.0f} s, after {total_after:.0f} s)")
    if not args.keep:  # a temporary folder: kept to look into only when something differs
        if failed:
            print(f"the runs are kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
