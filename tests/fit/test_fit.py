"""`gradaccum fit`: the search, the memory it measures, recovery from out-of-memory, the CLI.

Memory is checked against a measurement the test makes itself: a plain training step by hand
(no engine, no fit code) with its own saved-tensor hook, plus parameters, gradients and AdamW
state counted from the model and the optimizer.
"""

from __future__ import annotations

import copy
import json
import weakref

import pytest
import torch

from gradaccum import fit
from gradaccum.cli import COMMANDS, main
from gradaccum.fit import search as fit_search
from gradaccum.models.gpt import GPT, GPTConfig
from gradaccum.models.loss import causal_lm_loss

SEQ = 32
VOCAB = 64


def tiny_model() -> torch.nn.Module:
    """The built-in GPT, smaller than its `tiny` preset: the probes run many steps."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=2, n_embd=32))


def make_batch(micro_batch: int) -> dict:
    rows = torch.randint(
        0, VOCAB, (micro_batch, SEQ + 1), generator=torch.Generator().manual_seed(1)
    )
    return {"input_ids": rows[:, :-1].contiguous(), "labels": rows[:, 1:].contiguous()}


@pytest.fixture(autouse=True)
def short_timing(monkeypatch):
    # Speed is not under test here: time each candidate with the fewest steps.
    monkeypatch.setattr(fit.probe, "TIMED_SECONDS", 0.0)


_MEASURED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def step_bytes(model: torch.nn.Module, micro_batch: int) -> int:
    known = _MEASURED.setdefault(model, {})
    if micro_batch not in known:
        known[micro_batch] = _step_bytes(model, micro_batch)
    return known[micro_batch]


def _step_bytes(model: torch.nn.Module, micro_batch: int) -> int:
    """Bytes of one training step on a copy, counted by hand: 4-byte parameters and gradients,
    AdamW's state, and every storage autograd saved for backward (parameters excluded)."""
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
    own = {p.untyped_storage().data_ptr() for p in m.parameters()}
    saved: dict[int, int] = {}

    def pack(x):
        st = x.untyped_storage()
        if st.data_ptr() not in own:
            saved[st.data_ptr()] = st.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss, n = causal_lm_loss(m, make_batch(micro_batch))
    (loss / n).backward()
    opt.step()
    n_params = sum(p.numel() for p in m.parameters())
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    return 4 * n_params + 4 * n_params + state + sum(saved.values())


def search(model, budget, **kw):
    kw.setdefault("try_checkpointing", False)
    return fit.find_micro_batch(
        model,
        make_batch,
        causal_lm_loss,
        seq_len=SEQ,
        tokens_per_step=64 * SEQ,
        memory_budget=budget,
        **kw,
    )


def test_budget_bounds_the_search_by_measured_memory():
    model = tiny_model()
    five, six = step_bytes(model, 5), step_bytes(model, 6)
    budget = (five + six) // 2  # micro-batch 5 fits, 6 does not
    result = search(model, budget)
    probed = [c.micro_batch for c in result.candidates]
    assert probed == [1, 2, 4, 8, 6, 5]  # double, then bisect between 4 and 8
    for c in result.candidates:
        assert c.fits == (step_bytes(model, c.micro_batch) <= budget), c
    assert step_bytes(model, result.micro_batch) <= budget
    largest = max(c.micro_batch for c in result.candidates if c.fits)
    assert largest == 5
    first_too_big = min(c.micro_batch for c in result.candidates if not c.fits)
    assert first_too_big == 6 and step_bytes(model, 6) > budget
    # k = round(2048 / (micro x 32)), the global batch it really gives
    k = max(1, round(64 / result.micro_batch + 1e-9))
    assert result.accum_steps == k
    assert result.global_batch_tokens == result.micro_batch * SEQ * k


def test_measured_terms_match_a_hand_count():
    model = tiny_model()
    result = search(model, None, max_micro_batch=2)
    use = next(c.memory for c in result.candidates if c.micro_batch == 2)
    n_params = sum(p.numel() for p in model.parameters())
    n_tensors = len(list(model.parameters()))
    assert use.params == 4 * n_params and use.grads == 4 * n_params
    assert use.optimizer == 8 * n_params + 4 * n_tensors  # two moments, one fp32 step each
    assert use.peak == step_bytes(model, 2)


def test_out_of_memory_mid_step_is_recovered():
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []

    def loss_fn(m, batch):
        loss = causal_lm_loss(m, batch)  # the forward has run: its tensors are allocated
        calls.append(batch["input_ids"].shape[0])
        if batch["input_ids"].shape[0] >= 6:
            raise torch.OutOfMemoryError("injected")
        return loss

    result = fit.find_micro_batch(
        model, make_batch, loss_fn, seq_len=SEQ, tokens_per_step=64 * SEQ, try_checkpointing=False
    )
    why = {c.micro_batch: c.why for c in result.candidates}
    assert why == {1: "", 2: "", 4: "", 8: "out of memory", 6: "out of memory", 5: ""}
    assert max(c.micro_batch for c in result.candidates if c.fits) == 5
    assert all(c.memory is None for c in result.candidates if not c.fits)
    # the probes after the failures ran full steps; the model is as it was, no gradient left
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert all(p.grad is None for p in model.parameters())


def test_nothing_fits_says_what_micro_batch_1_needs():
    model = tiny_model()
    with pytest.raises(fit.NothingFits) as info:
        search(model, step_bytes(model, 1) - 1)
    assert info.value.needs == step_bytes(model, 1)
    assert "micro-batch 1" in str(info.value) and "\n" not in str(info.value)


def test_checkpointing_measures_less_and_is_restored():
    model = tiny_model()
    result = search(model, None, max_micro_batch=4, try_checkpointing=True)
    mem = {(c.micro_batch, c.checkpointing): c.memory.activations for c in result.candidates}
    assert mem[(4, True)] < mem[(4, False)]
    assert model.activation_checkpointing is False


def test_largest_fitting_doubles_then_bisects():
    probed = []

    def fits(size):
        probed.append(size)
        return size <= 37

    assert fit.largest_fitting(fits, cap=1000) in (36, 37)
    assert probed[:7] == [1, 2, 4, 8, 16, 32, 64]
    assert all(size > 37 or size <= 37 for size in probed)
    probed.clear()
    assert fit.largest_fitting(lambda s: probed.append(s) or True, cap=100) == 100
    assert probed == [1, 2, 4, 8, 16, 32, 64, 100]
    assert fit.largest_fitting(lambda s: False, cap=100) == 0


def _cand(micro, tps, peak, noise=0.03, checkpointing=False):
    use = fit.MemoryUse(0, 0, 0, 0, peak, peak, "saved tensors")
    return fit.Candidate(micro, checkpointing, True, "", use, tps, noise)


def test_choose_fastest_then_headroom_within_noise():
    fast = _cand(64, 1000.0, 900)
    close = _cand(32, 980.0, 500)  # 2% slower: within the 3% noise, less memory
    slow = _cand(16, 800.0, 300)
    assert fit.choose([slow, close, fast]) is close
    quiet = _cand(64, 1000.0, 900, noise=0.01)
    assert fit.choose([slow, close, quiet]) is quiet
    # noise never excuses more than MAX_NOISE = 5%: 6% slower is slower, however noisy
    noisy = _cand(64, 1000.0, 900, noise=0.5)
    assert fit.choose([slow, noisy]) is noisy
    assert fit.choose([_cand(32, 940.0, 500), noisy]) is noisy
    assert fit.choose([_cand(32, 960.0, 500), noisy]) is not noisy  # 4%: excused
    assert fit.choose([fit.Candidate(8, False, False, "out of memory")]) is None


def test_choose_pays_for_the_exact_batch_only_within_the_noise():
    # 125 sequences of 128 tokens per step: 25 x k 5 lands exactly, 32 x k 4 = 128 sequences
    # (+2.4%), 64 x k 2 too; for 100 sequences 64 x k 2 = 128 is +28%.
    target = fit_search.Target(125 * 128, 128)
    exact, off = _cand(25, 950.0, 500), _cand(32, 1000.0, 600)
    assert fit.choose([exact, off], target) is off  # 5% faster, past the 3% noise
    assert fit.choose([exact, off], target, tolerance=0.02) is exact  # +2.4% is past 2%
    assert fit.choose([exact, off], target, tolerance=0.0) is exact
    as_fast = _cand(25, 985.0, 700)  # within the noise: the exact batch, despite more memory
    assert fit.choose([as_fast, off], target) is as_fast
    hundred = fit_search.Target(100 * 128, 128)
    far = _cand(64, 2000.0, 900)  # twice as fast, but 28% off
    assert fit.choose([_cand(50, 1000.0, 700), far], hundred) is not far
    assert fit.choose([_cand(50, 1000.0, 700), far], hundred, tolerance=0.3) is far
    # nothing within the tolerance: the closest to the target
    assert fit.choose([_cand(64, 2000.0, 9), _cand(96, 900.0, 9)], hundred, 0.0).micro_batch == 96


def _speed(peak_at: int):
    """Tokens/s of a micro-batch of 128-token sequences on a machine whose throughput rises
    to `peak_at` and falls 25% over the next 93 sizes, as small-model CPU runs do."""

    def tokens_per_s(micro: int) -> float:
        rise = min(1.0, micro / peak_at) ** 0.3
        return 24_000 * rise * max(0.5, 1 - 0.25 * max(0, micro - peak_at) / 93)

    return tokens_per_s


def _fake_search(sequences: int, fits_up_to: int, speed, tolerance=fit_search.BATCH_TOLERANCE):
    """The search and the choice with probes and timings from functions: nothing run, nothing
    timed."""
    target = fit_search.Target(sequences * 128, 128)

    def probe(micro, checkpointing):
        fits = micro <= fits_up_to
        use = fit.MemoryUse(0, 0, 0, 0, micro, micro, "saved tensors") if fits else None
        return fit.Candidate(micro, checkpointing, fits, "" if fits else "over budget", use)

    def time_it(cand):
        cand.tokens_per_s = speed(cand.micro_batch)

    found = fit_search.search(probe, time_it, target, sequences, False, lambda: False)
    return target, found, fit.choose(found, target, tolerance)


@pytest.mark.parametrize(
    "sequences", [127, 125, 122, 2 * 157], ids=["prime", "5^3", "2x61", "2x157"]
)
@pytest.mark.parametrize("peak_at", [32, 24, 48])
@pytest.mark.parametrize("fits_up_to", [1000, 40])
def test_awkward_targets_get_within_5_percent_of_the_fastest_size(sequences, peak_at, fits_up_to):
    speed = _speed(peak_at)
    target, found, chosen = _fake_search(sequences, fits_up_to, speed)
    assert abs(target.deviation(chosen.micro_batch)) <= fit_search.BATCH_TOLERANCE
    timed = [c for c in found if c.tokens_per_s]
    allowed = [c for c in timed if abs(target.deviation(c.micro_batch)) <= 0.05]
    assert chosen.tokens_per_s >= 0.95 * max(c.tokens_per_s for c in allowed)
    # and against every size that fits within the tolerance, measured or not (the curve is
    # known here); with room above the peak, against every size that fits at all
    sizes = range(1, min(sequences, fits_up_to) + 1)
    best = max(speed(m) for m in sizes if abs(target.deviation(m)) <= 0.05)
    assert chosen.tokens_per_s >= 0.95 * best
    if fits_up_to > peak_at:
        assert chosen.tokens_per_s >= 0.95 * max(c.tokens_per_s for c in timed)
        assert chosen.tokens_per_s >= 0.95 * max(speed(m) for m in sizes)
    # what the search added: landing sizes next to the fastest doubling, none past the fit
    assert all(c.micro_batch <= fits_up_to for c in timed)
    # --batch-tolerance 0: the global batch is the target, exactly where it can be
    _, _, exact = _fake_search(sequences, fits_up_to, speed, tolerance=0.0)
    assert target.deviation(exact.micro_batch) == 0 or not any(
        sequences % c.micro_batch == 0 for c in timed
    )


def test_fit_takes_a_faster_size_off_the_exact_batch_and_says_so(monkeypatch, capsys):
    # 125 sequences of 32 tokens per step: only 1, 5, 25 and 125 divide it. Throughput (set
    # here, not timed) peaks at 32 and is 25% lower at 125: taking 125 for its exact batch
    # costs 25%, as `fit --tokens-per-step 16k --seq-len 128` measured 19% on CPU.
    speed = _speed(32)

    def fake_time(self, cand):
        cand.tokens_per_s, cand.noise = speed(cand.micro_batch) * SEQ / 128, 0.03

    monkeypatch.setattr(fit.probe._Prober, "time", fake_time)
    result = fit.find_micro_batch(
        tiny_model(), make_batch, causal_lm_loss, seq_len=SEQ, tokens_per_step=125 * SEQ,
        try_checkpointing=False,
    )  # fmt: skip
    timed = [c.tokens_per_s for c in result.candidates if c.tokens_per_s]
    assert result.tokens_per_s >= 0.95 * max(timed)
    assert abs(result.target_deviation) <= 0.05
    text = fit.render_table(result)
    if abs(result.target_deviation) > 0.01:  # off the target: said, with the exact size's speed
        assert "off the target, within --batch-tolerance 5%" in text, text
        assert "as fast as the fastest size landing within 1%" in text


@pytest.fixture
def fit_command(monkeypatch):
    monkeypatch.setitem(COMMANDS, "fit", "fit")


@pytest.mark.parametrize(
    "args",
    [
        ["--memory-budget", "abc"],
        ["--memory-budget", "-1GB"],
        ["--seq-len", "0"],
        ["--tokens-per-step", "16", "--seq-len", "32"],
        ["--model", "nope"],
        ["--model", "tiny", "--model-config", "x.json"],
        ["--memory-budget", "1MB", "--seq-len", "32"],
        ["--batch-tolerance", "abc"],
        ["--batch-tolerance", "-0.1"],
        ["--batch-tolerance", "60%"],
        ["--batch-tolerance", "nan"],
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(fit_command, capsys, args):
    code = main(["fit", *args])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("gradaccum: error: --"), err


def test_cli_json_fields(fit_command, capsys):
    code = main(["fit", "--seq-len", "32", "--tokens-per-step", "256", "--json"])
    out, err = capsys.readouterr()
    assert code == 0
    d = json.loads(out)
    assert set(d) == {
        "micro_batch",
        "accum_steps",
        "checkpointing",
        "tokens_per_s",
        "peak_memory_gb",
        "global_batch_tokens",
        "target_deviation",
        "batch_tolerance",
        "memory",
        "lora",
        "base_quant",
        "candidates",
    }
    for c in d["candidates"]:
        assert set(c) == {"micro_batch", "checkpointing", "fits", "tokens_per_s", "peak_memory_gb"}
    assert d["micro_batch"] * 32 * d["accum_steps"] == d["global_batch_tokens"]
    assert d["accum_steps"] == round(256 / (32 * d["micro_batch"]))


def test_table_marks_the_choice_and_states_the_global_batch():
    cands = [
        _cand(8, 900.0, 100),
        _cand(16, 1000.0, 200),
        fit.Candidate(32, False, False, "over budget"),
    ]
    result = fit.FitResult(16, 3, False, 1000.0, cands[1].memory, 128, 1, 6000, 10**9, cands)
    text = fit.render_table(result)
    chosen = [line for line in text.splitlines() if "<- chosen" in line]
    assert len(chosen) == 1 and "16" in chosen[0] and "2,048" in chosen[0]
    assert "no (over budget)" in text
    # 16 x 128 x 3 = 6,144 tokens against a target of 6,000: +2.40%
    assert "global batch 6,144 tokens" in text and "+2.40%" in text
