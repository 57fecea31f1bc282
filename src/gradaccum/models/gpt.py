"""The built-in GPT (`--model NAME`, its presets `gradaccum.utils.choices.BUILTIN_MODELS`).

It is nanoGPT's: token and position embeddings, pre-LayerNorm blocks of causal
self-attention (`F.scaled_dot_product_attention`) and a GELU MLP, a final LayerNorm and an
output head tied to the token embedding. Given `document_ids` (several documents packed in one
row, `gradaccum.data.sft.packing`), attention is restricted to each document by a boolean
block-causal mask, and positions restart at each document, so every document's logits are
those it would have alone. `GPT.decode` gives the same logits a few positions at a time,
keeping each block's attention keys and values (a KV cache), for sampling. Its parameter
count is

    V*C + T*C + L*(12*C*C + 13*C) + 2*C        (V vocab, T seq_len, L layers, C width)

with the tied head counted once. With `n_expert` E > 0 every block's MLP is a mixture of E
such MLPs with a bias-free router (`gradaccum.models.experts`, top-`expert_top_k` routing), and
the count is

    V*C + T*C + L*(4*C*C + 8*C + E*C + E*(8*C*C + 5*C)) + 2*C

of which a token runs through the same with k experts in place of E in the last term (the
router's E*C stays: `GPT.active_params`). Building it from a preset, or a Hugging Face model
from a config or a folder instead, is `gradaccum.models.build.build_model`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from gradaccum.models.document_mask import block_causal_mask, positions_from_documents
from gradaccum.models.experts import MoE, MoEOutput

# The `model_type` written into config.json for this GPT, so a checkpoint folder says which
# kind of model it holds (Hugging Face configs carry their own model_type).
GPT_MODEL_TYPE = "gradaccum-gpt"

KVCache = tuple[torch.Tensor, torch.Tensor]
"""One block's cached attention keys and values, (b, heads, positions, C / heads) each
(`GPT.decode`)."""


@dataclass
class GPTConfig:
    vocab_size: int
    """Tokens in the vocabulary, the end-of-document token included."""
    seq_len: int
    """Longest sequence the model reads, in tokens (size of the position embedding)."""
    n_layer: int
    """Transformer blocks."""
    n_head: int
    """Attention heads per block; must divide n_embd."""
    n_embd: int
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention and MLP outputs (0 keeps runs exact)."""
    n_expert: int = 0
    """Experts per block's MLP (mixture of experts); 0: one dense MLP, as GPT-2."""
    expert_top_k: int = 2
    """Experts each token is routed to, at most n_expert (read only when n_expert > 0)."""
    router_aux_coef: float = 0.01
    """Coefficient of the router's load-balancing loss (`gradaccum.moe.balance`), as
    Hugging Face's `router_aux_loss_coef`."""

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig: n_embd {self.n_embd} not divisible by n_head {self.n_head}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")
        self._check_experts()

    def _check_experts(self) -> None:
        for name in ("n_expert", "expert_top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"GPTConfig.{name} must be a whole number >= 0, got {value!r}")
        if self.n_expert and not 1 <= self.expert_top_k <= self.n_expert:
            raise ValueError(
                f"GPTConfig.expert_top_k {self.expert_top_k} must be between 1 and n_expert "
                f"{self.n_expert}"
            )
        coef = self.router_aux_coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not coef >= 0:
            raise ValueError(f"GPTConfig.router_aux_coef must be >= 0, got {coef!r}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """mask: None (causal) or a (b, 1, T, T) bool, True where a query may attend a key."""
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=mask is None,
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.c_proj(y))

    def decode(self, x: torch.Tensor, past: KVCache | None) -> tuple[torch.Tensor, KVCache]:
        """Attention of x's t new positions (b, t, C) over the cached keys and values of the
        positions before them (`past`, (b, heads, P, C / heads) each, or None for none) and
        their own: (the output (b, t, C), the keys and values of all P + t positions)."""
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        if past is not None:
            k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
        p = k.shape[2] - t
        # New position i (absolute p + i) sees keys 0 .. p + i. SDPA's is_causal aligns the
        # mask to the top left, right only when there is no past; one new token sees all.
        mask = None
        if p and t > 1:
            mask = torch.ones(t, p + t, dtype=torch.bool, device=x.device).tril(diagonal=p)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=p == 0 and t > 1,
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.c_proj(y)), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        if cfg.n_expert:
            self.mlp = MoE(cfg.n_embd, cfg.n_expert, cfg.expert_top_k, lambda: MLP(cfg))
        else:
            self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the block's output, its router logits (b * T, E); None for a dense MLP)."""
        x = x + self.attn(self.ln_1(x), mask)
        if isinstance(self.mlp, MoE):
            y, router_logits = self.mlp(self.ln_2(x))
            return x + y, router_logits
        return x + self.mlp(self.ln_2(x)), None

    def decode(self, x: torch.Tensor, past: KVCache | None) -> tuple[torch.Tensor, KVCache]:
        """`forward` for x's new positions given the cache of the ones before them (see
        `CausalSelfAttention.decode`): (the block's output, the updated cache). The MLP, dense
        or mixture of experts, acts on each position alone, so it needs no cache."""
        y, cache = self.attn.decode(self.ln_1(x), past)
        x = x + y
        h = self.mlp(self.ln_2(x))
        return x + (h[0] if isinstance(self.mlp, MoE) else h), cache


class GPT(nn.Module):
    """A decoder-only transformer: `model(input_ids (b, T) long) -> logits (b, T, vocab)`,
    optionally `position_ids` / `document_ids` (b, T) long for packed rows (see `forward`)."""

    reads_document_ids = True
    """`forward` takes document_ids (`gradaccum.models.loss.packed_inputs` hands them)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.activation_checkpointing = False
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled down so the residual stream's variance does not
        # grow with depth.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:  # the MoE router has none
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def set_activation_checkpointing(self, enabled: bool = True) -> None:
        """Recompute each block's activations in backward instead of keeping them."""
        self.activation_checkpointing = bool(enabled)

    def num_params(self) -> int:
        """Parameters, the tied output head counted once (it is the token embedding)."""
        return sum(p.numel() for p in self.parameters())

    def active_params(self) -> int:
        """Parameters one token runs through: `num_params` less the experts it is not routed
        to (each MoE block's E - k experts); `num_params` for a dense model."""
        cfg = self.config
        if not cfg.n_expert:
            return self.num_params()
        expert = sum(p.numel() for p in self.blocks[0].mlp.experts[0].parameters())
        return self.num_params() - cfg.n_layer * (cfg.n_expert - cfg.expert_top_k) * expert

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        output_router_logits: bool = False,
    ) -> torch.Tensor | MoEOutput:
        """Logits (b, T, vocab) of input_ids (b, T).

        position_ids (b, T): each token's position (default 0 .. T-1, or restarting at each
        document when document_ids is given); every one must be < seq_len, and without them
        T must be <= seq_len. document_ids (b, T): each token's document, each document's
        tokens consecutive; attention then stays within the document (causal, SDPA with a
        boolean block mask). Without both: causal attention over the whole row, as always.
        output_router_logits: return a `MoEOutput` (`.logits`, `.router_logits`: a (b * T, E)
        tensor per MoE block, empty for a dense model) instead of the logits alone."""
        x, router_logits = self._trunk(input_ids, position_ids, document_ids)
        # The head is the token embedding itself (tied), so there is no second V x C matrix.
        logits = F.linear(self.ln_f(x), self.wte.weight)
        return MoEOutput(logits, router_logits) if output_router_logits else logits

    def router_logits(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The router logits `forward(..., output_router_logits=True)` gives, without the
        final LayerNorm and the output head (the MoE balance's routing pass)."""
        return self._trunk(input_ids, position_ids, document_ids)[1]

    def decode(
        self, input_ids: torch.Tensor, cache: list[KVCache] | None, start_pos: int
    ) -> tuple[torch.Tensor, list[KVCache]]:
        """Incremental decoding with a key/value cache: the logits (b, t, vocab) of input_ids
        (b, t), the tokens at positions start_pos .. start_pos + t - 1 of rows whose earlier
        start_pos tokens are held in `cache` (one (keys, values) pair per block, as this
        returns; None when start_pos is 0), and the cache of all start_pos + t positions.
        The logits are those `forward` gives at those positions for the whole rows (causal
        attention, positions from 0; no packed documents). start_pos + t must be <= seq_len.
        Used for sampling (`gradaccum.grpo.sampling`): each new token costs one position's
        work instead of a forward over the whole row."""
        t = input_ids.shape[1]
        if start_pos + t > self.config.seq_len:
            raise ValueError(
                f"decoding positions up to {start_pos + t}: longer than seq_len "
                f"{self.config.seq_len}"
            )
        if (cache is None) != (start_pos == 0):
            raise ValueError(f"decode: a cache goes with start_pos > 0, got {start_pos}")
        positions = torch.arange(start_pos, start_pos + t, device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(positions))
        new_cache = []
        for i, block in enumerate(self.blocks):
            x, layer_cache = block.decode(x, None if cache is None else cache[i])
            new_cache.append(layer_cache)
        return F.linear(self.ln_f(x), self.wte.weight), new_cache

    def _trunk(self, input_ids, position_ids, document_ids):
        """(the residual stream after the last block (b, T, C), each MoE block's logits)."""
        t = input_ids.shape[1]
        if position_ids is None and document_ids is not None:
            position_ids = positions_from_documents(document_ids)
        if position_ids is None:
            if t > self.config.seq_len:
                raise ValueError(
                    f"sequence of {t} tokens is longer than seq_len {self.config.seq_len}"
                )
            position_ids = torch.arange(t, device=input_ids.device)
        mask = None if document_ids is None else block_causal_mask(document_ids)
        x = self.drop(self.wte(input_ids) + self.wpe(position_ids))
        router_logits = []
        for block in self.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x, logits = checkpoint(block, x, mask, use_reentrant=False)
            else:
                x, logits = block(x, mask)
            if logits is not None:
                router_logits.append(logits)
        return x, tuple(router_logits)
