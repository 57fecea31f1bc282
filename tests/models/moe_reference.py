"""Mixture-of-experts models for the balance tests, ragged data, and the big-batch reference
of the load-balancing loss, computed here without the engine or `gradaccum.moe.balance`.

The reference: every example of the window padded into one float64 batch, one forward with
router logits, the cross-entropy summed over the targets divided by their count N, plus
coef * E * mean over layers of sum_i f[l,i] * P[l,i] over the real tokens (attention_mask 1)
of the whole window (or another f, or each micro-batch's own), one backward.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from gradaccum.models.gpt import GPT, GPTConfig

VOCAB = 37
COEF = 0.1  # larger than the usual 0.01, so that the balance term moves the gradient clearly
EXPERTS, TOP_K = 4, 2


def moe_gpt(seed: int = 0, coef: float = COEF) -> GPT:
    """The built-in GPT with 4 experts per block, top-2: 2 layers, width 32."""
    torch.manual_seed(seed)
    cfg = GPTConfig(
        vocab_size=VOCAB,
        seq_len=16,
        n_layer=2,
        n_head=2,
        n_embd=32,
        n_expert=EXPERTS,
        expert_top_k=TOP_K,
        router_aux_coef=coef,
    )
    return GPT(cfg)


def moe_config(kind: str, vocab_size: int = VOCAB, coef: float = COEF, **fields):
    """A tiny Hugging Face MoE config: 2 layers (unless `fields` say otherwise), width 32, 4
    experts, top-2; kind "mixtral", "qwen2_moe" (its shared expert included), "qwen3_moe" or
    "olmoe"."""
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=32,
        router_aux_loss_coef=coef,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    experts = {"num_experts": EXPERTS}
    kinds = {
        "mixtral": (transformers.MixtralConfig, {"num_local_experts": EXPERTS}),
        "qwen2_moe": (
            transformers.Qwen2MoeConfig,
            {**experts, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
        ),
        "qwen3_moe": (
            transformers.Qwen3MoeConfig,
            {**experts, "moe_intermediate_size": 32, "head_dim": 8},
        ),
        "olmoe": (transformers.OlmoeConfig, experts),
    }
    cls, own = kinds[kind]
    return cls(**{**common, **own, **fields})


def mixtral(seed: int = 0, coef: float = COEF):
    """A Hugging Face Mixtral from its config: 2 layers, width 32, 4 experts, top-2."""
    import transformers

    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(moe_config("mixtral", coef=coef))


def qwen2_moe(seed: int = 0, coef: float = COEF):
    """A Hugging Face Qwen2-MoE: 3 layers of which the middle one is dense (mlp_only_layers),
    width 32, 4 routed experts top-2 and a shared expert."""
    import transformers

    torch.manual_seed(seed)
    config = moe_config("qwen2_moe", coef=coef, num_hidden_layers=3, mlp_only_layers=[1])
    return transformers.Qwen2MoeForCausalLM(config)


MODELS = {"gpt": moe_gpt, "mixtral": mixtral, "qwen2_moe": qwen2_moe}


def moe_batches(count: int, seed: int, rows: int = 2, widest: int = 12) -> list[dict]:
    """`count` micro-batches of `rows` rows, each micro-batch as wide as its own longest row
    (4 .. widest tokens) and every row of its own length: padding at the end, attention_mask
    0 and label -100 there."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        width = int(torch.randint(4, widest + 1, (1,), generator=g))
        lengths = torch.randint(1, width + 1, (rows,), generator=g)
        lengths[0] = width
        real = torch.arange(width)[None, :] < lengths[:, None]
        ids = torch.randint(3, VOCAB, (rows, width), generator=g)
        labels = torch.randint(3, VOCAB, (rows, width), generator=g)
        out.append(
            {
                "input_ids": torch.where(real, ids, 0),
                "labels": torch.where(real, labels, -100),
                "attention_mask": real.long(),
            }
        )
    return out


def pad_cat(batches: list[dict]) -> tuple[dict, torch.Tensor]:
    """The batches as one, padded to the widest (ids 0, labels -100, mask 0), and each row's
    micro-batch."""
    width = max(b["input_ids"].shape[1] for b in batches)
    pads = {"input_ids": 0, "labels": -100, "attention_mask": 0}
    big = {}
    for key, pad in pads.items():
        parts = []
        for b in batches:
            t = b[key]
            parts.append(F.pad(t, (0, width - t.shape[1]), value=pad))
        big[key] = torch.cat(parts)
    owner = torch.cat([torch.full((b["input_ids"].shape[0],), m) for m, b in enumerate(batches)])
    return big, owner


def _figures(probs: list[torch.Tensor], chosen: torch.Tensor) -> tuple:
    """(f (L, E), P (L, E)) over the tokens `chosen` (a bool mask over rows of probs)."""
    n = int(chosen.sum())
    counts = torch.stack(
        [torch.bincount(p[chosen].topk(TOP_K).indices.flatten(), minlength=EXPERTS) for p in probs]
    ).double()
    sums = torch.stack([p[chosen].sum(0) for p in probs])
    return counts / n, sums / n, counts


def reference(model, batches: list[dict], shift: bool, mode: str = "global", f=None) -> dict:
    """The big batch's gradient of CE / N + LBL in float64, on a copy of `model`.

    mode "global": f and P of the whole window; "micro": sum over micro-batches of
    (T_m / T) * LBL(S_m); "given": the window's P with `f` (L, E) given.
    Returns grads (in model.parameters() order), lbl (LBL of the window, own f and P),
    aux (the balance term trained), f (the window's own), counts (L, E)."""
    model = copy.deepcopy(model).double()
    if hasattr(model, "set_experts_implementation"):  # grouped_mm takes no float64
        model.set_experts_implementation("eager")
    model.zero_grad(set_to_none=True)
    big, owner = pad_cat(batches)
    builtin = isinstance(model, GPT)
    inputs = {"input_ids": big["input_ids"]}
    if not builtin:
        inputs.update(attention_mask=big["attention_mask"], use_cache=False)
    out = model(**inputs, output_router_logits=True)
    logits, labels = out.logits, big["labels"]
    if shift:
        logits, labels = logits[:, :-1], labels[:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="sum")
    n = int((labels != -100).sum())
    real = big["attention_mask"].reshape(-1) == 1
    probs = [torch.softmax(r.double(), dim=-1) for r in out.router_logits]
    coef = model.config.router_aux_coef if builtin else model.config.router_aux_loss_coef
    layers = len(probs)
    f_w, p_w, counts = _figures(probs, real)
    lbl = coef * EXPERTS * (f_w.detach() * p_w).sum(1).mean()
    if mode == "global":
        aux = lbl
    elif mode == "given":
        aux = coef * EXPERTS * (f.double() * p_w).sum(1).mean()
    else:
        token_owner = owner.repeat_interleave(big["input_ids"].shape[1])
        total = int(real.sum())
        aux = 0.0
        for m in range(len(batches)):
            mine = real & (token_owner == m)
            f_m, p_m, _ = _figures(probs, mine)
            aux = aux + int(mine.sum()) / total * coef * EXPERTS * (f_m * p_m).sum(1).mean()
    (ce / n + aux).backward()
    assert layers == 2
    return {
        "grads": [p.grad for p in model.parameters()],
        "lbl": float(lbl.detach()),
        "aux": float(aux.detach()),
        "f": f_w,
        "counts": counts,
    }
