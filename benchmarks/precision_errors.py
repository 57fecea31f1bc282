"""How far the engine's window gradient lands from a reference, in each precision.

For k micro-batches of ragged length (padding labels -100):
- fp32: the engine against one forward/backward over all micro-batches at once (fp32), for an
  MLP and a small GPT, k in {1, 2, 8, 32};
- bf16 parameters, k = 64: the gradient handed to the optimizer against the float64 sum of the
  same per-micro-batch bf16 gradients, three ways: the fp32 buffer handed to fp32 master
  weights, the fp32 buffer rounded once to bf16, and plain bf16 accumulation;
- fp16 / bf16 autocast on fp32 parameters: against the fp32 big-batch gradient.
Error = max over parameters of |g - g_ref| / |g_ref|. Several seeds; the largest is printed.

    python benchmarks/precision_errors.py
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from reference import (  # noqa: E402
    GradRecorder,
    big_batch_grads,
    exact_fp64_sum,
    make_gpt,
    make_mlp,
    max_rel_error,
    ragged_batches,
    token_loss,
)

from gradaccum import Accumulator  # noqa: E402
from gradaccum.utils.atomic import exit_on_disk_full, write_text_atomic

SEEDS = range(3)


def engine_grads(model, data, **kwargs):
    model = copy.deepcopy(model)
    opt = GradRecorder(model.parameters())
    Accumulator(model, opt, **kwargs).step(data, token_loss)
    return opt.seen[0]


def main() -> int:
    results: dict[str, float] = {}

    def worst(key, value):
        results[key] = max(results.get(key, 0.0), value)

    for seed in SEEDS:
        for kind, make in (("mlp", make_mlp), ("gpt", make_gpt)):
            for k in (1, 2, 8, 32):
                model = make(seed)
                data = ragged_batches(kind, k, seed=100 * seed + k)
                err = max_rel_error(engine_grads(model, data), big_batch_grads(model, data))
                worst("fp32_vs_big_batch", err)
        model = make_mlp(seed).to(torch.bfloat16)
        data = ragged_batches("mlp", 64, seed=1000 + seed, dtype=torch.bfloat16)
        ref = exact_fp64_sum(model, data)
        worst(
            "bf16_fp32_buffer_master_weights",
            max_rel_error(engine_grads(model, data, master_weights=True), ref),
        )
        worst("bf16_fp32_buffer_rounded_once", max_rel_error(engine_grads(model, data), ref))
        worst(
            "bf16_accumulation",
            max_rel_error(engine_grads(model, data, accum_dtype=torch.bfloat16), ref),
        )
        model = make_gpt(seed)
        data = ragged_batches("gpt", 8, seed=2000 + seed)
        want = big_batch_grads(model, data)
        for precision in ("bf16", "fp16"):
            err = max_rel_error(engine_grads(model, data, precision=precision), want)
            worst(f"{precision}_autocast_vs_fp32", err)
    ratio = results["bf16_accumulation"] / results["bf16_fp32_buffer_master_weights"]
    for key, value in results.items():
        print(f"{key:36s} {value:.2e}")
    print(f"bf16 accumulation error / fp32 buffer error (k = 64): {ratio:.3g}x")
    out = os.path.join(os.path.dirname(__file__), "results", "precision_errors.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    write_text_atomic(out, json.dumps({**results, "bf16_ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(exit_on_disk_full(main, os.path.basename(__file__)))
