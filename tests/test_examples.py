"""The examples the README and docs point to run as written (one process, one thread) and
print what they claim, checked against values computed apart from the code under test."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(name: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"  # tiny models: a second thread only waits on a shared machine
    return subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", name)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    ).stdout


def step_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("step ")]


@pytest.mark.slow  # runs the example in a process
def test_own_loop_example_runs_and_steps_once_per_window():
    lines = step_lines(run_example("own_loop.py"))
    # 32 micro-batches in windows of 8: four optimizer steps, eight micro-steps each
    assert [line.split(":")[0] for line in lines] == ["step 1", "step 2", "step 3", "step 4"]
    assert all("8 micro-steps" in line for line in lines)


@pytest.mark.slow  # runs the example in a process
def test_hf_own_loop_counts_the_shifted_targets_and_verifies():
    pytest.importorskip("transformers")
    out = run_example("hf_own_loop.py")
    lines = step_lines(out)
    # 12 micro-batches in windows of 4: three steps of four micro-steps
    assert [line.split(":")[0] for line in lines] == ["step 1", "step 2", "step 3"]
    for line in lines:
        engine, by_hand = map(
            int, re.search(r"over (\d+) targets \(counted by hand: (\d+)\)", line).groups()
        )
        assert engine == by_hand
        assert "4 micro-steps" in line
    # the window through the engine against the same window as one float64 batch
    passed, err = re.search(r"verify: passed (\w+), max rel err (\S+)", out).groups()
    assert passed == "True" and float(err) < 1e-5


@pytest.mark.slow  # runs the example in a process
def test_lora_example_trains_the_adapters_only():
    pytest.importorskip("peft")
    out = run_example("lora.py")
    trainable, total = map(int, re.search(r"trainable (\d+) of (\d+) parameters", out).groups())
    # rank r on c_attn (d -> 3d), attn c_proj (d -> d), c_fc (d -> 4d), mlp c_proj (4d -> d):
    # r x (in + out) each, 16 r d per block; 2 blocks of width 64 at rank 4
    assert trainable == 2 * 16 * 4 * 64
    # the GPT's own count (tied head counted once) plus the adapters
    d, vocab, seq, layers = 64, 256, 32, 2
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    assert total == vocab * d + seq * d + layers * block + 2 * d + trainable
    assert len(step_lines(out)) == 3
    base, adapters = map(
        float, re.search(r"base max change (\S+), adapters' B max (\S+)", out).groups()
    )
    assert base == 0.0  # the frozen base did not move
    assert adapters > 0.0  # B starts at zero: the adapters did


@pytest.mark.slow  # runs the example in a process
def test_packing_example_gives_the_same_gradient_in_every_mode():
    out = run_example("packing.py")
    targets = int(re.search(r"(\d+) targets\n", out).group(1))
    found = re.findall(
        r"^(none|window|padding-free): (\d+) micro-batches .*?, (\d+) targets, loss (\S+), "
        r"grad norm (\S+), rel err vs by hand (\S+)$",
        out,
        re.M,
    )
    assert [mode for mode, *_ in found] == ["none", "window", "padding-free"]
    for _mode, _batches, counted, _loss, _norm, err in found:
        assert int(counted) == targets
        assert float(err) < 1e-5  # against each example run alone, by hand
    losses = [float(loss) for *_, loss, _norm, _err in found]
    norms = [float(norm) for *_, norm, _err in found]
    assert max(losses) - min(losses) < 1e-5 * abs(losses[0])
    assert max(norms) - min(norms) < 1e-5 * abs(norms[0])


@pytest.mark.slow  # runs the example in a process
def test_moe_balance_example_trains_the_windows_lbl():
    out = run_example("moe_balance.py")
    lines = step_lines(out)
    assert len(lines) == 3
    for line in lines:
        aux, lbl, by_hand, load = map(
            float,
            re.search(r"aux (\S+), lbl (\S+) \(by hand (\S+)\), max load (\S+)", line).groups(),
        )
        assert abs(lbl - by_hand) <= 1e-5 * by_hand  # the window's LBL from its router logits
        assert abs(aux - lbl) <= 1e-5 * lbl  # "global" trains exactly the window's LBL
        assert 1.0 <= load <= 4 / 2  # between balanced and every token on the same 2 of 4
        assert "over 512 tokens" in line  # 4 micro-batches of 4 x 32 positions, all routed


# ---- issue 38 item 4: README's "Your own loop" snippets, as written --------------------------


def readme_blocks(heading: str) -> list[str]:
    """The ```python blocks of README.md's section `heading`, as written."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        section = f.read().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def test_the_readme_own_loop_snippets_run_on_the_models_they_are_for():
    import torch

    transformers = pytest.importorskip("transformers")
    from tests.reference import make_gpt, ragged_batches

    plain, with_hf = readme_blocks("Your own loop")
    # the first on the built-in GPT (logits out, labels already the next tokens)
    model = make_gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    loader = ragged_batches("gpt", 16, seed=0)
    names = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": loader}
    exec(plain, names)
    last = loader[8:]
    assert names["result"].micro_steps == 8 and not names["result"].skipped
    assert names["result"].tokens == sum(int((b["labels"] != -100).sum()) for b in last)
    # the second on a Hugging Face Llama (an output object, labels unshifted)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(1)
    loader = []
    for _ in range(16):
        ids = torch.randint(0, 64, (2, 12), generator=g)
        real = torch.arange(12)[None, :] < torch.randint(2, 13, (2, 1), generator=g)
        labels = ids.masked_fill(~real, -100)
        loader.append({"input_ids": ids, "labels": labels, "attention_mask": real.long()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    names = {"model": model, "optimizer": optimizer, "loader": loader}
    exec(with_hf, names)
    # each row's targets: its labels after the first, not padding (the first is predicted by
    # no position)
    want = sum(int((b["labels"][:, 1:] != -100).sum()) for b in loader[8:])
    assert names["result"].micro_steps == 8 and names["result"].tokens == want
