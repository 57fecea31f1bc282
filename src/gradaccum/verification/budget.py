"""What `gradaccum verify` can take on this machine: the longest --seq-len, the memory of the
window's float64 big batch, and the memory of each rank of --world-size. Arithmetic only: no
torch at import (`cli/verify.py` reads MAX_SEQ_LEN while the parser is built)."""

from __future__ import annotations

from gradaccum.utils.errors import BadInput

MAX_SEQ_LEN = 4096
"""Longest --seq-len, in tokens. Verify's float64 big batch costs about the square of the
length: k 4 x 4 sequences took 10 s at 1024 tokens, 50 s at 2048 and 262 s at 4096 on 2 CPU
cores (tiny preset); at the same growth 8192 would take about 20 minutes."""
RANK_BYTES_PER_PARAMETER = 48  # stated in VerifySettings.world_size
"""Memory of one rank of --world-size per model parameter, in bytes: 12 fp32 copies (the
parameters, their gradients, DDP's bucket, AdamW's two moments, and what rank 0 records for
the comparison: the parameters before each of the 2 windows and after, the 2 gradients,
and the copy that carries them back)."""


def reference_bytes(tokens: int, info) -> int:
    """Peak memory of verify on a window of `tokens` positions, in bytes: 8 bytes x (18 x
    layers x width + 3 x vocab) per token, what the float64 big batch keeps for backward
    (fitted to the whole run's peak on the tiny preset: 2.6 GB at 4 x 4 x 2048 tokens,
    4.9 GB at 4 x 4 x 4096, 66 kB a token against the 80 kB this gives)."""
    return 8 * tokens * (18 * info.layers * info.hidden + 3 * info.vocab_size)


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g}" if n < 1e12 else f"{n / 1e9:,.0f}"


def check_fits(info, sizes: dict) -> None:
    """The window's float64 reference and the ranks of --world-size must fit this machine:
    refused here, before any of the work. `info`: the model's `ModelInfo`; `sizes`: the
    window's (`cli/verify.parse_sizes`)."""
    # the ranks module loads torch: imported when the check runs, not with MAX_SEQ_LEN
    from gradaccum.verification.ranks import available_memory_bytes, rank_capacity

    k, rows, seq = sizes["k"], sizes["micro_batch"], sizes["seq_len"]
    need, available = reference_bytes(k * rows * seq, info), available_memory_bytes()
    if available is not None and need > available:
        per_token = reference_bytes(1, info)
        raise BadInput(
            f"--k {k} x --micro-batch {rows} x --seq-len {seq}: verify's float64 big batch "
            f"of {k * rows * seq:,} tokens needs about {_gb(need)} GB "
            f"({per_token / 1e3:.0f} kB a token for this model), {_gb(available)} GB "
            f"available; at most {available // per_token:,} tokens here"
        )
    world = sizes["world_size"]
    limit, rule = rank_capacity(RANK_BYTES_PER_PARAMETER * info.params)
    if world > limit:
        raise BadInput(
            "--world-size", world, f"more ranks than this machine holds; at most {limit}: {rule}"
        )
