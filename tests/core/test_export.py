"""``palestra export`` and ``train.export``: a trained run written as a transformers folder, loaded back with equal
logits.

Runs are trained here for two steps (tiny batches), exported through the command, and reloaded with
``transformers.AutoModelForCausalLM``: the tiny policy as the ``LlamaForCausalLM`` it maps onto, an ``hf`` policy
(a tiny local Llama from tests/fixtures/tiny_hf.py) fully fine-tuned and with LoRA, merged and unmerged. Bad input is
one line, exit 2.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import plugin_installs
import pytest
import torch

from palestra import cli
from palestra.config import load_config
from palestra.engine import checkpoint as ckpt
from palestra.engine.trainer import Trainer
from palestra.types import Observation

transformers = pytest.importorskip("transformers", reason="exporting writes transformers folders")

pytestmark = pytest.mark.usefixtures("one_thread")


ERROR = "palestra export: error: "
SMALL = [
    "loggers=[]",
    "train.steps=2",
    "train.batch_size=2",
    "train.group_size=2",
    "train.eval_size=2",
    "train.max_new_tokens=4",
    "train.save_every=1",
]
TEXT = "3 + 4 =<answer>7</answer> 12 + 30 =<answer>42</answer>"


def train_run(tmp: Path, name: str, *overrides: str) -> Trainer:
    """A two-step run in ``tmp/name`` (a step checkpoint after step 1, checkpoint.pt at the end), and its trainer."""
    config = load_config(None, [*SMALL, f"run.output_dir={tmp}", f"run.name={name}", *overrides])
    trainer = Trainer(config)
    trainer.train()
    return trainer


def export(*args: object) -> int:
    return cli.main(["export", *map(str, args)])


def policy_logits(policy: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The policy's logits for one unpadded row, computed as training computes them (trunk, then head)."""
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        hidden, _ = policy.trunk(ids, mask, torch.arange(ids.shape[1])[None])
        return policy.logits(hidden).float()


def hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Trainer:
    return train_run(tmp_path_factory.mktemp("runs"), "tiny")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import tiny_hf  # tests/fixtures: on sys.path by pyproject's [tool.pytest.ini_options] pythonpath

    return tiny_hf.build_llama(tmp_path_factory.mktemp("llama"))


# ---- the tiny policy: a real LlamaForCausalLM ------------------------------------------------------------------
def test_tiny_exports_as_a_llama_with_the_trained_logits(tiny_run: Trainer, tmp_path: Path, capsys) -> None:
    out = tmp_path / "export"
    assert export(tiny_run.run_dir, "--out", out) == 0
    line = capsys.readouterr().out.strip()
    assert line == f"exported {tiny_run.run_dir} step 2 (policy tiny) to {out}: LlamaForCausalLM"
    assert {"config.json", "model.safetensors", "tokenizer.json", "palestra_export.json"} <= {
        p.name for p in out.iterdir()
    }
    assert not list(tmp_path.glob(".*"))  # the temporary sibling is gone
    record = json.loads((out / "palestra_export.json").read_text())
    assert record["step"] == 2 and record["policy"] == "tiny" and record["adapters"] is False

    policy = tiny_run.policy.eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer.encode(TEXT)  # BOS in front, as the policy puts it in front of prompts
    assert ids == [policy.tokenizer.bos_token_id, *policy.tokenizer.encode(TEXT)]
    assert tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    ids_t = torch.tensor([ids])
    exported, trained = hf_logits(out, ids_t), policy_logits(policy, ids_t)
    # Equal up to float32 rounding: the RoPE angles are computed in float64 by tiny and float32 by transformers ...
    torch.testing.assert_close(exported, trained, rtol=0, atol=1e-4)
    # ... and bitwise once tiny uses transformers' own angles: the architectures agree everywhere else.
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    cos, sin = model.model.rotary_emb(torch.zeros(1), torch.arange(policy.max_len)[None])
    half = cos.shape[-1] // 2
    policy._rope_tables[torch.device("cpu")] = (cos[0, :, :half].contiguous(), sin[0, :, :half].contiguous())
    try:
        assert torch.equal(policy_logits(policy, ids_t), hf_logits(out, ids_t))
    finally:
        policy._rope_tables.clear()


def test_exported_tiny_trains_on_as_an_hf_policy(tiny_run: Trainer, tmp_path: Path) -> None:
    from palestra.plugins.policies.hf import build_hf_policy

    out = tmp_path / "export"
    assert export(tiny_run.run_dir, "--out", out) == 0
    tiny = tiny_run.policy.eval()
    hf = build_hf_policy(path=str(out)).eval()
    observations = [Observation(prompt="3 + 4 ="), Observation(prompt="12 + 30 =")]
    prompt_ids, prompt_mask = tiny.encode_observations(observations)
    hf_ids, hf_mask = hf.encode_observations(observations)
    assert torch.equal(prompt_ids, hf_ids) and torch.equal(prompt_mask, hf_mask)  # BOS, left padding with <pad>
    completion = torch.tensor([tiny.tokenizer.encode("<answer>7</answer>")] * 2)
    done = torch.ones_like(completion, dtype=torch.bool)
    with torch.no_grad():
        a = tiny.score(prompt_ids, prompt_mask, completion, done).logprobs
        b = hf.score(prompt_ids, prompt_mask, completion, done).logprobs
    torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


@pytest.mark.parametrize("unknown", ["unk", "drop"])
def test_the_character_tokenizer_encodes_the_same_in_transformers(unknown: str) -> None:
    from palestra.plugins.policies.char_tokenizer import CharTokenizer

    # atoms sharing first characters (the longest wins), regex-special and whitespace characters in the alphabet
    ours = CharTokenizer("0123456789+-*= ?]^\\\n.", ["<a>", "<ab>", "</a>", "ab"], unknown)
    theirs = ours.to_transformers(model_max_length=64)
    for text in ["1 + 2 =<a>3</a>", "<ab>x<abc 4]^\\\n.", "ab<a b> é😀 ?", "", "zzz"]:
        assert theirs.encode(text, add_special_tokens=False) == ours.encode(text), text
        assert theirs.encode(text) == [ours.bos_token_id, *ours.encode(text)]
        ids = ours.encode(text)
        if ours.unk_token_id not in ids:
            assert theirs.decode(ids) == ours.decode(ids)


def test_checkpoint_option_exports_that_step(tiny_run: Trainer, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    step1 = ckpt.load_checkpoint(tiny_run.run_dir / "checkpoints" / "step-000001.pt")
    final = ckpt.load_checkpoint(tiny_run.run_dir / "checkpoint.pt")
    assert not torch.equal(step1["policy"]["embed.weight"], final["policy"]["embed.weight"])  # the step trained
    out = tmp_path / "step1"
    assert export(tiny_run.run_dir, "--out", out, "--checkpoint", "checkpoints/step-000001.pt") == 0
    weights = load_file(out / "model.safetensors")
    assert torch.equal(weights["model.embed_tokens.weight"], step1["policy"]["embed.weight"])
    assert json.loads((out / "palestra_export.json").read_text())["step"] == 1


def test_force_replaces_a_folder_and_no_adapters_gets_a_note(tiny_run: Trainer, tmp_path: Path, capsys) -> None:
    out = tmp_path / "export"
    out.mkdir()
    (out / "old.txt").write_text("previous")
    assert export(tiny_run.run_dir, "--out", out) == 2
    assert capsys.readouterr().err.strip() == (
        f"{ERROR}--out: {str(out)!r} already holds files; name a new folder, or pass --force to replace it"
    )
    assert export(tiny_run.run_dir, "--out", out, "--force", "--no-merge-lora") == 0
    err = capsys.readouterr().err.strip()
    assert err == (
        "palestra export: note: policy 'tiny' has no LoRA adapters, so --no-merge-lora changes nothing; "
        "the full model is written"
    )
    assert not (out / "old.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # nothing left beside it


# ---- bad input: one line, exit 2 ---------------------------------------------------------------------------------
def test_bad_input_is_one_line(tiny_run: Trainer, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    run_dir = tiny_run.run_dir
    empty = tmp_path / "empty"
    empty.mkdir()
    no_config = tmp_path / "no_config"
    ckpt.save_checkpoint({"step": 1, "policy": {}}, no_config / "checkpoint.pt")
    (tmp_path / "a_file").write_text("x")
    cases = {
        (empty, "--out", "o"): f"RUN_DIR: {str(empty)!r} holds no checkpoint (checkpoint.pt or checkpoints/step-*.pt); "
        "a run writes checkpoint.pt when training ends and step files every train.save_every steps",
        (tmp_path / "missing", "--out", "o"): f"RUN_DIR: run directory {str(tmp_path / 'missing')!r} does not exist",
        (
            run_dir / "checkpoint.pt",
            "--out",
            "o",
        ): (
            f"RUN_DIR: {str(run_dir / 'checkpoint.pt')!r} is a file;"
            " pass the run directory, and the file as --checkpoint"
        ),
        (
            no_config,
            "--out",
            "o",
        ): f"checkpoint {no_config / 'checkpoint.pt'} holds no config; it was not written by palestra train",
        (run_dir, "--out", run_dir): f"--out: {str(run_dir)!r} is the run directory; name a folder of its own",
        (
            run_dir,
            "--out",
            run_dir.parent,
        ): f"--out: {str(run_dir.parent)!r} holds the run directory; name a folder of its own",
        (run_dir, "--out", "."): "--out: '.' is the working directory; name a folder of its own",
        (run_dir, "--out", "a_file"): "--out: 'a_file' is a file; name a folder to create",
        (
            run_dir,
            "--out",
            "o",
            "--checkpoint",
            "nope.pt",
        ): f"--checkpoint: 'nope.pt' is not a file (looked as given and inside {run_dir})",
    }
    for args, message in cases.items():
        assert export(*args) == 2, args
        assert capsys.readouterr().err.splitlines() == [ERROR + message]
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "checkpoint.pt").write_bytes(b"not a checkpoint")
    assert export(corrupt, "--out", "o") == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{ERROR}RUN_DIR: {corrupt} holds no intact checkpoint: checkpoint {corrupt / 'checkpoint.pt'} is corrupt: "
        "truncated or not a torch.save archive (16 bytes, no zip directory at its end)"
    ]
    assert not (tmp_path / "o").exists()


def test_train_export_keys_are_checked(tmp_path: Path, capsys) -> None:
    assert cli.main(["config", "show", "train.export_dir=x"]) == 2
    assert capsys.readouterr().err.strip() == (
        "palestra config: error: train.export_dir: is 'x' but train.export is "
        "false, so nothing would be written there; set train.export=true (or drop export_dir)"
    )
    assert cli.main(["config", "show", "train.export=true", "train.export_dir= "]) == 2
    assert "train.export_dir: must name a folder" in capsys.readouterr().err
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    args = ["train", *SMALL, f"run.output_dir={tmp_path / 'runs'}", "train.export=true", f"train.export_dir={taken}"]
    assert cli.main(args) == 2  # before anything is built or trained
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"palestra train: error: train.export_dir: {str(taken)!r} already holds files; set train.export_dir to a new "
        "folder, or delete that one"
    )
    assert not (tmp_path / "runs").exists()


# ---- train.export through the command line -----------------------------------------------------------------------
@pytest.mark.slow  # a fresh interpreter importing torch and transformers: 6 s on a quiet machine, 10-25 s on a busy one
def test_train_export_writes_the_folder_when_training_ends(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    result = plugin_installs.run_palestra(
        ["train", *SMALL, f"run.output_dir={out}", "train.export=true"], [], tmp_path, OMP_NUM_THREADS="1"
    )
    assert result.returncode == 0, result.stderr
    run_dir = out / "arithmetic"
    folder = run_dir / "export"
    assert result.stdout.splitlines()[-1] == f"exported {run_dir} step 2 (policy tiny) to {folder}: LlamaForCausalLM"
    assert "Writing model shards" not in result.stderr  # transformers' progress bars stay quiet
    record = json.loads((folder / "palestra_export.json").read_text())
    assert record["run_id"] == json.loads((run_dir / "run.json").read_text())["run_id"]
    state = ckpt.load_checkpoint(run_dir / "checkpoint.pt")
    from palestra.config import validate_config

    trainer = Trainer(validate_config({**state["config"], "loggers": []}), run_dir=run_dir)
    trainer.load_state(state, source=run_dir / "checkpoint.pt")
    ids = torch.tensor([[1, *trainer.policy.tokenizer.encode(TEXT)]])
    torch.testing.assert_close(hf_logits(folder, ids), policy_logits(trainer.policy.eval(), ids), rtol=0, atol=1e-4)


# ---- the hf policy -----------------------------------------------------------------------------------------------
def hf_run(tmp: Path, llama_dir: Path, name: str, *overrides: str) -> Trainer:
    return train_run(tmp, name, "policy.name=hf", f"policy.options.path={llama_dir}", "train.lr=1e-3", *overrides)


def test_hf_policy_exports_with_the_trained_logits(llama_dir: Path, tmp_path: Path) -> None:
    trainer = hf_run(tmp_path, llama_dir, "hf")
    out = tmp_path / "export"
    assert export(trainer.run_dir, "--out", out, "--set", f"policy.options.path={llama_dir}") == 0
    ids = torch.tensor([transformers.AutoTokenizer.from_pretrained(out).encode(TEXT)])
    base = hf_logits(llama_dir, ids)
    trained = policy_logits(trainer.policy.eval(), ids)
    assert not torch.allclose(base, trained)  # training moved the weights: the comparison below can fail
    torch.testing.assert_close(hf_logits(out, ids), trained, rtol=0, atol=1e-5)


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "unmerged"])
def test_lora_policy_exports_with_the_trained_logits(llama_dir: Path, tmp_path: Path, merge: bool) -> None:
    pytest.importorskip("peft", reason="LoRA runs need peft")
    trainer = hf_run(tmp_path, llama_dir, "lora", "policy.options.lora={r: 4, alpha: 8}")
    out = tmp_path / "export"
    again = ("--set", f"policy.options.path={llama_dir}")  # the model folder lies outside the run folder
    assert export(trainer.run_dir, "--out", out, "--merge-lora" if merge else "--no-merge-lora", *again) == 0
    record = json.loads((out / "palestra_export.json").read_text())
    assert record["adapters"] is True and record["merge_lora"] is merge
    assert (out / "adapter_config.json").is_file() is not merge
    ids = torch.tensor([transformers.AutoTokenizer.from_pretrained(out).encode(TEXT)])
    trained = policy_logits(trainer.policy.eval(), ids)
    moved = (hf_logits(llama_dir, ids) - trained).abs().max().item()
    assert moved > 1e-3  # the adapters changed the logits by far more than the tolerance below
    # Merging folds B @ A into the weights: one rounding more than the policy's separate adapter path.
    tolerance = 5e-5 if merge else 1e-5
    torch.testing.assert_close(hf_logits(out, ids), trained, rtol=0, atol=tolerance)
    if not merge:  # peft's own loader finds the base through adapter_config.json: the exported folder itself
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(out).eval()
        assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(out.resolve())
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits.float(), trained, rtol=0, atol=1e-5)


# ---- lean exports: the dtype and the files' modes (issue 27) ------------------------------------------------------
def safetensors_dtypes(path: Path) -> set[str]:
    """The dtypes its header lists (the file's first 8 bytes give the JSON header's length)."""
    data = path.read_bytes()
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


def test_export_dtype_and_the_usual_file_modes(tiny_run: Trainer, tmp_path: Path) -> None:
    mask = os.umask(0o022)
    try:
        assert export(tiny_run.run_dir, "--out", tmp_path / "f32") == 0
        assert export(tiny_run.run_dir, "--out", tmp_path / "bf16", "--dtype", "bfloat16") == 0
    finally:
        os.umask(mask)
    assert safetensors_dtypes(tmp_path / "f32" / "model.safetensors") == {"F32"}  # tiny's own dtype by default
    weights = tmp_path / "bf16" / "model.safetensors"
    assert (
        safetensors_dtypes(weights) == {"BF16"}
        and weights.stat().st_size < 0.6 * (tmp_path / "f32" / "model.safetensors").stat().st_size
    )
    assert json.loads((tmp_path / "bf16" / "palestra_export.json").read_text())["dtype"] == "bfloat16"
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "bf16").iterdir()}
    assert set(modes.values()) == {0o644}, modes  # safetensors alone used to write 0600
    assert (tmp_path / "bf16").stat().st_mode & 0o777 == 0o755
    ids = torch.tensor([transformers.AutoTokenizer.from_pretrained(tmp_path / "bf16").encode(TEXT)])
    torch.testing.assert_close(hf_logits(tmp_path / "bf16", ids), hf_logits(tmp_path / "f32", ids), rtol=0, atol=0.1)


def test_a_gguf_model_exports_in_bf16_unless_told(tmp_path: Path) -> None:
    import tiny_gguf  # tests/fixtures

    gguf_path, _ = tiny_gguf.build_llama_gguf(tmp_path / "model")
    where = [f"policy.options.path={gguf_path.parent}", f"policy.options.gguf_file={gguf_path.name}"]
    trainer = train_run(tmp_path, "gguf", "policy.name=hf", *where)
    again = [part for key in where for part in ("--set", key)]
    assert export(trainer.run_dir, "--out", tmp_path / "lean", *again) == 0
    assert export(trainer.run_dir, "--out", tmp_path / "full", "--dtype", "float32", *again) == 0
    assert safetensors_dtypes(tmp_path / "lean" / "model.safetensors") == {"BF16"}
    assert safetensors_dtypes(tmp_path / "full" / "model.safetensors") == {"F32"}
    config = json.loads((tmp_path / "lean" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    assert next(trainer.policy.parameters()).dtype == torch.float32  # the live policy was not cast
