"""palestra.kernels.linear_logprob_entropy (the output head fused with the log-prob kernel) against a float64
reference written here, values and gradients of hidden, weight and bias for random upstream grads of both outputs;
gradcheck and opcheck; what autograd saves; and CausalLMPolicy.score, fused, against the unfused path
(the head's logits, then logprob_entropy) on the tiny policy and on tiny HuggingFace models.
"""

from __future__ import annotations

import pytest
import torch

import palestra.kernels as K
from palestra.config import build_component
from palestra.kernels.linear_logprob_entropy import DEFAULT_CHUNK_BYTES, chunk_rows_for

IGNORE = -100
_seed = [4321]


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny shapes: a second intra-op thread only adds hand-off cost on a busy 2-core machine."""


def fresh_generator() -> torch.Generator:
    _seed[0] += 1
    return torch.Generator().manual_seed(_seed[0] * 7919)


def reference(hidden, weight, bias, targets, temperature=1.0):
    """(logp, entropy) in float64 from the float64 values of the inputs; autograd flows to all three."""
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    log_p = torch.log_softmax(z / temperature, dim=-1)
    keep = targets != IGNORE
    logp = log_p.gather(-1, torch.where(keep, targets, 0).unsqueeze(-1)).squeeze(-1)
    entropy = torch.special.entr(log_p.exp()).sum(-1)
    return torch.where(keep, logp, 0.0), torch.where(keep, entropy, 0.0)


def make_inputs(lead, hidden_size, vocab, *, dtype=torch.float32, weight_dtype=None, bias=True, ignored=0.25):
    gen = fresh_generator()
    hidden = torch.randn(*lead, hidden_size, generator=gen, dtype=torch.float64).to(dtype)
    # scale 3 / sqrt(H): logits of spread ~3, peaked enough that the entropy is far from log V
    weight = torch.randn(vocab, hidden_size, generator=gen, dtype=torch.float64) * 3 / hidden_size**0.5
    weight = weight.to(weight_dtype or dtype)
    b = torch.randn(vocab, generator=gen, dtype=torch.float64).to(weight_dtype or dtype) if bias else None
    targets = torch.randint(0, vocab, lead, generator=gen)
    targets[torch.rand(lead, generator=gen) < ignored] = IGNORE
    return hidden, weight, b, targets


def check_against_reference(hidden, weight, bias, targets, temperature, *, tol, grad_tol, entropy=True, **kw):
    """Values and gradients (random upstream grads for each output returned) vs the float64 reference."""
    gen = fresh_generator()
    g_logp = torch.randn(targets.shape, generator=gen)
    g_ent = torch.randn(targets.shape, generator=gen)
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight) + ((bias,) if bias is not None else ())]
    x_h, x_w, x_b = leaves[0], leaves[1], (leaves[2] if bias is not None else None)
    logp, ent = K.linear_logprob_entropy(x_h, x_w, x_b, targets, temperature, entropy, **kw)
    assert logp.dtype == torch.float32 and logp.shape == targets.shape
    refs = [t.detach().double().requires_grad_(True) for t in leaves]
    r_logp, r_ent = reference(refs[0], refs[1], refs[2] if bias is not None else None, targets, temperature)
    torch.testing.assert_close(logp.double(), r_logp.detach(), atol=tol, rtol=tol)
    if entropy:
        assert ent.dtype == torch.float32 and ent.shape == targets.shape
        torch.testing.assert_close(ent.double(), r_ent.detach(), atol=tol, rtol=tol)
        outs, r_outs, grads = (logp, ent), (r_logp, r_ent), (g_logp, g_ent)
    else:
        assert ent is None
        outs, r_outs, grads = (logp,), (r_logp,), (g_logp,)
    assert (logp <= 0).all()
    got = torch.autograd.grad(outs, leaves, grads)
    want = torch.autograd.grad(r_outs, refs, tuple(g.double() for g in grads))
    for name, g, w, leaf in zip(("hidden", "weight", "bias"), got, want, leaves):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape, name
        # the gradients are rounded to their input's dtype: compare relative to the largest entry
        scale = w.abs().max().item()
        torch.testing.assert_close(
            g.double(), w, atol=grad_tol * scale, rtol=grad_tol, msg=lambda m, name=name: f"{name}: {m}"
        )
    ignored = targets == IGNORE
    assert (logp[ignored] == 0).all() and (got[0][ignored] == 0).all()


@pytest.fixture(params=["torch", "cpp"])
def backend(request):
    K.set_backend(request.param)
    try:
        yield request.param
    finally:
        K.set_backend(None)


# (lead shape, H, V, rows per chunk): one row; rows not a multiple of the chunk; V = 17; a 32000-ish vocabulary
# with a small H, several chunks; a leading [B, T] shape; everything in one chunk.
SHAPES = [((1,), 8, 17, 1), ((37,), 16, 101, 5), ((9,), 4, 32003, 4), ((3, 5), 12, 64, 7), ((20,), 8, 50, 1000)]


@pytest.mark.parametrize("lead,hidden_size,vocab,rows", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fp32_matches_float64(backend, lead, hidden_size, vocab, rows, temperature):
    hidden, weight, bias, targets = make_inputs(lead, hidden_size, vocab, bias=rows % 2 == 1)
    check_against_reference(
        hidden, weight, bias, targets, temperature, tol=2e-5, grad_tol=2e-5, chunk_bytes=rows * vocab * 4
    )


@pytest.mark.parametrize(
    "dtype,weight_dtype", [(torch.bfloat16, None), (torch.float16, None), (torch.bfloat16, torch.float32)]
)
def test_half_precision_inputs_compute_in_fp32(backend, dtype, weight_dtype):
    """The logits are computed in fp32 from the rounded inputs, so only the gradients' final rounding shows."""
    hidden, weight, bias, targets = make_inputs((23,), 16, 97, dtype=dtype, weight_dtype=weight_dtype)
    check_against_reference(hidden, weight, bias, targets, 0.8, tol=2e-5, grad_tol=1e-2, chunk_bytes=6 * 97 * 4)


def test_entropy_off_returns_none_and_the_logp_gradient(backend):
    hidden, weight, bias, targets = make_inputs((13,), 8, 40)
    check_against_reference(
        hidden, weight, bias, targets, 1.3, tol=2e-5, grad_tol=2e-5, entropy=False, chunk_bytes=4 * 40 * 4
    )


def test_entropy_alone_gets_its_gradient(backend):
    """Only the entropy is used: the logp output gets no upstream gradient at all."""
    hidden, weight, bias, targets = make_inputs((11,), 8, 30, ignored=0.0)
    h = hidden.clone().requires_grad_(True)
    _, ent = K.linear_logprob_entropy(h, weight, bias, targets, chunk_bytes=3 * 30 * 4)
    (got,) = torch.autograd.grad(ent.sum(), h)
    h64 = hidden.double().requires_grad_(True)
    (want,) = torch.autograd.grad(reference(h64, weight, bias, targets)[1].sum(), h64)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


def test_triton_back_end_under_the_interpreter():
    pytest.importorskip("triton")
    hidden, weight, bias, targets = make_inputs((7,), 8, 45)
    check_against_reference(
        hidden, weight, bias, targets, 0.9, tol=2e-5, grad_tol=2e-5, chunk_bytes=3 * 45 * 4, backend="triton"
    )


def test_empty_input(backend):
    h = torch.zeros(0, 8, requires_grad=True)
    w = torch.randn(17, 8, requires_grad=True)
    logp, ent = K.linear_logprob_entropy(h, w, None, torch.zeros(0, dtype=torch.long))
    assert logp.shape == ent.shape == (0,)
    g_h, g_w = torch.autograd.grad(logp.sum() + ent.sum(), (h, w))
    assert g_h.shape == (0, 8) and (g_w == 0).all()


def test_a_tied_weight_gets_both_gradients(backend):
    """The head's weight is the embedding table: its gradient is the embedding's plus the head's."""
    gen = fresh_generator()
    vocab, width = 29, 8
    table = torch.randn(vocab, width, generator=gen, requires_grad=True)
    ids = torch.randint(0, vocab, (3, 6), generator=gen)
    targets = torch.randint(0, vocab, (3, 6), generator=gen)
    mix = torch.randn(width, width, generator=gen)

    def run(head):
        hidden = torch.tanh(torch.nn.functional.embedding(ids, table) @ mix)
        return head(hidden)

    logp, ent = run(lambda h: K.linear_logprob_entropy(h, table, None, targets, chunk_bytes=4 * vocab * 4))
    (got,) = torch.autograd.grad(logp.sum() - 0.3 * ent.sum(), table)
    logp_r, ent_r = run(lambda h: K.logprob_entropy(torch.nn.functional.linear(h, table), targets))
    (want,) = torch.autograd.grad(logp_r.sum() - 0.3 * ent_r.sum(), table)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bias", [True, False])
def test_gradcheck_float64(bias):
    """float64 runs the same chunked forward and backward (torch back end) in float64: autograd's own check,
    both outputs, every input, rows split over three chunks, an ignored row."""
    hidden, weight, b, targets = make_inputs((7,), 5, 11, dtype=torch.float64, bias=bias, ignored=0.0)
    targets[2] = IGNORE
    inputs = [t.requires_grad_(True) for t in (hidden, weight) + ((b,) if bias else ())]

    def fn(h, w, *maybe_bias):
        return K.linear_logprob_entropy(
            h, w, maybe_bias[0] if maybe_bias else None, targets, 0.8, chunk_bytes=3 * 11 * 4
        )

    logp, ent = fn(*inputs)
    assert logp.dtype == torch.float64
    r_logp, r_ent = reference(hidden, weight, b, targets, 0.8)
    torch.testing.assert_close(logp, r_logp, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(ent, r_ent, atol=1e-12, rtol=1e-12)
    assert torch.autograd.gradcheck(fn, tuple(inputs), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("op_backend", ["torch", "cpp"])
def test_opcheck(op_backend):
    """Schema, fake kernel, autograd registration and AOT dispatch of both ops."""
    K.linear_logprob_entropy(torch.randn(2, 4), torch.randn(5, 4), None, torch.tensor([0, 1]), backend=op_backend)
    hidden, weight, bias, targets = make_inputs((6,), 4, 9)
    for b in (bias, None):
        args = (
            hidden.requires_grad_(True),
            weight.requires_grad_(True),
            None if b is None else b.requires_grad_(True),
            targets,
            0.9,
            IGNORE,
            4,
            op_backend,
        )
        torch.library.opcheck(torch.ops.palestra_fused.linear_logprob_entropy, args)
    _logp, ent, lse = torch.ops.palestra_fused.linear_logprob_entropy(
        hidden, weight, bias, targets, 0.9, IGNORE, 4, op_backend
    )
    g = torch.randn(6)
    for needs in ((True, True, True), (True, False, False), (False, True, True)):
        args = (
            g,
            g * 0.5,
            hidden.detach(),
            weight.detach(),
            bias.detach(),
            targets,
            lse.detach(),
            ent.detach(),
            0.9,
            IGNORE,
            4,
            op_backend,
            *needs,
        )
        torch.library.opcheck(torch.ops.palestra_fused.linear_logprob_entropy_backward, args)


def test_autograd_keeps_no_vocabulary_sized_tensor(backend):
    """What the graph saves between forward and backward: the inputs themselves and O(N) vectors, nothing
    [N, V]; the unfused path saves its logits (at least)."""
    n, width, vocab = 64, 16, 1000
    hidden, weight, bias, targets = make_inputs((n,), width, vocab)
    h, w, b = (t.requires_grad_(True) for t in (hidden, weight, bias))
    inputs = {t.untyped_storage().data_ptr() for t in (h, w, b, targets)}

    def saved_bytes(fn) -> tuple[int, int]:
        extra, largest = {}, 0

        def pack(t):
            nonlocal largest
            ptr = t.untyped_storage().data_ptr()
            if ptr not in inputs:
                extra[ptr] = t.untyped_storage().nbytes()
                largest = max(largest, t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sum(extra.values()), largest

    fused, fused_largest = saved_bytes(lambda: K.linear_logprob_entropy(h, w, b, targets, chunk_bytes=8 * vocab * 4))
    unfused, _ = saved_bytes(lambda: K.logprob_entropy(torch.nn.functional.linear(h, w, b), targets))
    assert fused <= 3 * n * 4 and fused_largest <= n, (fused, fused_largest)  # lse, entropy (+ the logp buffer)
    assert unfused >= n * vocab * 4


def test_chunk_rows_follow_the_budget():
    assert chunk_rows_for(49152) == DEFAULT_CHUNK_BYTES // (4 * 49152)
    assert chunk_rows_for(1000, chunk_bytes=1) == 1
    assert chunk_rows_for(100, chunk_bytes=4 * 100 * 7 + 3) == 7


def test_bad_inputs_are_one_line_errors_naming_the_argument():
    h, w, b, t = make_inputs((4,), 8, 10, ignored=0.0)
    cases = [
        ((h, w[:, :4], b, t), {}, "hidden.shape[-1] must equal weight.shape[1]"),
        ((h, w, b[:3], t), {}, "bias has shape [3], expected [10]"),
        ((h, w, b, t[:2]), {}, "targets has shape [2]"),
        ((h, w, b, t.float()), {}, "targets has dtype float32"),
        ((h, w, b, torch.tensor([0, 1, 10, 2])), {}, "targets contains 10, outside [0, V) with V = 10"),
        ((h, w, b, t), {"temperature": 0.0}, "temperature must be a finite number > 0"),
        ((h, w, b, t), {"chunk_bytes": 0}, "chunk_bytes must be a positive int"),
        ((h.int(), w, b, t), {}, "hidden has dtype int32"),
        ((h.double(), w.double(), None, t), {"backend": "cpp"}, "float64 inputs run on the torch back end only"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises((ValueError, TypeError)) as info:
            K.linear_logprob_entropy(*args, **kwargs)
        text = str(info.value)
        assert text.startswith("linear_logprob_entropy: ") and message in text and "\n" not in text, text


# ---- CausalLMPolicy.score, fused, against the unfused path ------------------------------------------------
@pytest.fixture
def always_fused(monkeypatch: pytest.MonkeyPatch) -> None:
    """score() fuses whatever the logits' size (by default only large logits are fused)."""
    import palestra.models.policy as policy_module

    monkeypatch.setattr(policy_module, "FUSED_HEAD_MIN_LOGIT_BYTES", 0)


def unfused_score(policy, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature):
    """What score computed before the fused op: the head over every position, then logprob_entropy."""
    p, t = prompt_ids.shape[1], completion_ids.shape[1]
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    hidden, _ = policy.trunk(torch.cat([prompt_ids, completion_ids], dim=1), mask, position_ids)
    logits = policy.logits(hidden[:, p - 1 : p + t - 1])
    tokens = completion_ids.masked_fill(~completion_mask, IGNORE)
    return K.logprob_entropy(logits, tokens, temperature=temperature)


def batch_for(policy, seed: int, batch: int = 3, prompt: int = 5, length: int = 6):
    """Left-padded prompts and right-padded completions of different lengths (one row a single token)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = len(policy.tokenizer)
    prompt_ids = torch.randint(0, vocab, (batch, prompt), generator=gen)
    prompt_mask = torch.arange(prompt)[None, :] >= torch.tensor([0, 2, 1])[:batch, None]
    completion_ids = torch.randint(0, vocab, (batch, length), generator=gen)
    completion_mask = torch.arange(length)[None, :] < torch.tensor([length, 1, length - 2])[:batch, None]
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def assert_score_equals_unfused(policy, seed: int, temperature: float = 0.8, tol: float = 2e-5) -> None:
    """Values of both outputs and the gradient of every parameter, for random weights on logp and entropy."""
    batch = batch_for(policy, seed)
    completion_mask = batch[3]
    gen = torch.Generator().manual_seed(seed + 1)
    g_logp, g_ent = torch.randn(completion_mask.shape, generator=gen), torch.randn(completion_mask.shape, generator=gen)
    params = [p for p in policy.parameters() if p.requires_grad]

    scores = policy.score(*batch, temperature=temperature)
    got = torch.autograd.grad((scores.logprobs * g_logp).sum() + (scores.entropy * g_ent).sum(), params)
    logp, ent = unfused_score(policy, *batch, temperature)
    want = torch.autograd.grad((logp * g_logp).sum() + (ent * g_ent).sum(), params)

    torch.testing.assert_close(scores.logprobs, logp, atol=tol, rtol=tol)
    torch.testing.assert_close(scores.entropy, ent, atol=tol, rtol=tol)
    assert (scores.logprobs[~completion_mask] == 0).all() and (scores.entropy[~completion_mask] == 0).all()
    for (name, _), g, w in zip([(n, p) for n, p in policy.named_parameters() if p.requires_grad], got, want):
        atol = tol * max(1.0, w.abs().max().item())
        torch.testing.assert_close(g, w, atol=atol, rtol=tol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.usefixtures("always_fused")
def test_tiny_policy_score_is_fused_and_equals_the_unfused_path(tie):
    policy = build_component(
        "policy",
        {"name": "tiny", "options": {"d_model": 32, "d_ff": 64, "seed": 3, "tie_embeddings": tie, "init_std": 0.3}},
        path="policy",
    )
    weight, bias = policy.fusable_head()
    assert weight is policy.output_head().weight and bias is None
    assert_score_equals_unfused(policy, seed=5)
    logp_only = policy.score(*batch_for(policy, 5), entropy=False)
    assert logp_only.entropy is None


def test_score_fuses_only_when_the_logits_would_be_large(monkeypatch: pytest.MonkeyPatch):
    import palestra.models.policy as policy_module

    calls = []
    fused = K.linear_logprob_entropy
    monkeypatch.setattr(K, "linear_logprob_entropy", lambda *a, **k: calls.append(1) or fused(*a, **k))
    policy = build_component(
        "policy", {"name": "tiny", "options": {"d_model": 32, "d_ff": 64, "seed": 3}}, path="policy"
    )
    batch = batch_for(policy, 5)
    small = policy.score(*batch)
    assert calls == []  # a few KiB of logits: the unfused path, bitwise as before the fused op existed
    monkeypatch.setattr(policy_module, "FUSED_HEAD_MIN_LOGIT_BYTES", 0)
    large = policy.score(*batch)
    assert calls == [1]
    torch.testing.assert_close(large.logprobs, small.logprobs, atol=2e-5, rtol=2e-5)
    # Under autocast the head runs in bf16 like any linear layer, never through the fp32 fused op.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = policy.score(*batch)
    assert calls == [1]
    assert low.logprobs.dtype == torch.float32
    torch.testing.assert_close(low.logprobs, small.logprobs, atol=0.1, rtol=0.05)


# ---- tiny HuggingFace models (tests/fixtures/tiny_hf.py) -------------------------------------------------


@pytest.fixture(scope="module")
def hf_policies(tmp_path_factory):
    pytest.importorskip("transformers")
    import tiny_hf

    root = tmp_path_factory.mktemp("tiny-hf-fused")
    folders = {"llama": tiny_hf.build_llama(root / "llama"), "qwen2": tiny_hf.build_qwen2(root / "qwen2")}
    return {
        name: build_component("policy", {"name": "hf", "options": {"path": str(path)}}, path="policy")
        for name, path in folders.items()
    }


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.usefixtures("always_fused")
def test_hf_policy_score_is_fused_and_equals_the_unfused_path(hf_policies, name):
    """Llama: an untied head as large as the tokenizer. Qwen2: tied to the embedding, with rows past the tokenizer
    that the fused op must slice off as logits() does."""
    policy = hf_policies[name]
    weight, _ = policy.fusable_head()
    head = policy.output_head()
    assert weight.shape[0] == len(policy.tokenizer) and weight.data_ptr() == head.weight.data_ptr()
    if name == "qwen2":
        assert head.out_features > len(policy.tokenizer) and head.weight is policy.model.get_input_embeddings().weight
    assert_score_equals_unfused(policy, seed=7)


def test_a_lora_wrapped_head_takes_the_unfused_path(hf_policies, tmp_path):
    """peft's LoRA Linear is not an nn.Linear: score must call it (its adapter changes the numbers)."""
    peft = pytest.importorskip("peft")
    import copy

    policy = copy.deepcopy(hf_policies["llama"])
    batch = batch_for(policy, 11)
    with torch.no_grad():
        before = policy.score(*batch).logprobs
    peft.inject_adapter_in_model(peft.LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"]), policy.model)
    head = policy.output_head()
    assert type(head) is not torch.nn.Linear and policy.fusable_head() is None
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(0))
    assert_score_equals_unfused(policy, seed=11)
    with torch.no_grad():
        after = policy.score(*batch).logprobs
    assert (after - before).abs().max() > 1e-2  # the adapter counts: a fused call that skipped it would differ
