"""A mixture of experts in `gradaccum train`: --moe-balance, the load-balancing loss trained
with each window (`gradaccum.moe.balance`), its figures in metrics.jsonl and the summary,
and its state in the checkpoint.

The mode: --moe-balance, or "global" (the big batch's loss, exactly) for an MoE model and
none for a dense one, whose windows stay as they are (`causal_lm_loss`, nothing else run).
A mode given for a dense model, or for a model that returns no router logits, is refused
before anything is written (`check`, from `parts` where the model is built).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gradaccum.moe import router
from gradaccum.moe.balance import Balance, BalanceStats
from gradaccum.train.config import TrainConfig
from gradaccum.utils.errors import BadInput, first_line

DEFAULT_MODE = "global"
"""The mode of an MoE model when --moe-balance is not given: the big batch's loss."""
STATE_KEY = "moe_balance"
"""Where trainer.pt keeps the balance's state (the previous window's f)."""
LOAD_DIGITS = 4
"""Decimals of each layer's load in metrics.jsonl (max over mean token fraction, >= 1)."""


def balance_mode(config: TrainConfig, model: torch.nn.Module) -> str | None:
    """The run's mode: --moe-balance, or DEFAULT_MODE for an MoE model and None for a dense
    one. BadInput when a mode is given for a model without MoE layers whose router logits
    are read (`models.router.moe_spec`)."""
    spec = router.moe_spec(model)
    if spec is not None:
        return config.moe_balance or DEFAULT_MODE
    if config.moe_balance is None:
        return None
    inner = router.core_model(model)
    cfg = getattr(inner, "config", None)
    experts = any(
        getattr(cfg, key, None) for key in ("n_expert", "num_local_experts", "num_experts")
    )
    read = "has experts whose router logits gradaccum does not read"
    why = read if experts else "has no mixture-of-experts layers"
    raise BadInput(
        "--moe-balance",
        config.moe_balance,
        f"{type(inner).__name__} ({_source(config)}) {why}; train an MoE model (--model "
        "tiny-moe, or a Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE) or leave "
        "--moe-balance out",
    )


def _source(config: TrainConfig) -> str:
    if config.resume:
        return f"the checkpoint in {config.out}"
    if config.model_config is not None:
        return f"--model-config {config.model_config}"
    if config.init_from is not None:
        return f"--init-from {config.init_from}"
    return f"--model {config.preset}"


def check(config: TrainConfig, model: torch.nn.Module) -> None:
    """The mode fits the model: `balance_mode`, and an MoE model's forward returns router
    logits for each of its MoE layers (one no-grad routing pass over two tokens), which the
    first window would otherwise find mid-run. BadInput if not."""
    mode = balance_mode(config, model)
    if mode is None:
        return
    spec, device = router.moe_spec(model), next(model.parameters()).device
    probe = {"input_ids": torch.zeros((1, 2), dtype=torch.long, device=device)}
    try:
        layers = len(router.routing_pass(model, probe))
    except ValueError as err:
        raise BadInput("--moe-balance", mode, first_line(err)) from None
    if layers != spec.layers:
        raise BadInput(
            "--moe-balance",
            mode,
            f"{spec.model_class} returned router logits of {layers} layers, not one per MoE "
            f"layer ({spec.layers}): gradaccum cannot balance it",
        )


class MoETraining:
    """The run's balance, one window at a time, for the loop: `begin_window` (the routing
    pass where the mode needs one, then the engine's window), `backward` per micro-step of
    `Window.run`, `end` with the window's result; `abandon` for a window dropped (a stop,
    out of memory). `stats` holds the last finished window's figures."""

    def __init__(self, balance: Balance):
        self.balance = balance
        self.stats: BalanceStats | None = None

    @property
    def mode(self) -> str:
        return self.balance.mode

    def opening_lines(self) -> list[str]:
        """What the run's balance is and costs, printed at the start."""
        spec = self.balance.spec
        cost = {
            "global": "a no-grad routing pass over each micro-batch before the backward passes",
            "micro": "no extra pass; each micro-batch balanced on its own",
            "global-previous": "no extra pass; the previous window's f (the first window's "
            "own, by a routing pass)",
        }[self.mode]
        return [
            f"moe    {spec.layers} MoE layers of {spec.n_expert} experts, top-{spec.top_k}, "
            f"load-balancing coefficient {spec.coef:g}; --moe-balance {self.mode}: {cost}"
        ]

    def begin_window(self, acc, model: torch.nn.Module, micro_batches: Sequence[dict]):
        """The engine's window over `micro_batches` (this rank's), with the balance's routed
        tokens and counts summed over ranks in the window's own first collective. The
        routing pass runs under the training forwards' autocast, so that it routes as they
        do (a bf16 router's top-k can differ from an fp32 one's)."""
        extra = self.balance.prepare(model, micro_batches, acc)
        window = acc.begin_window(micro_batches, extra_sums=extra)
        self.balance.begin(window)
        return window

    def backward(self, window, model: torch.nn.Module, micro: dict, weight: float) -> None:
        """One micro-batch: its cross-entropy and its term of the window's balance loss."""
        self.balance.backward(window, model, micro, weight)

    def end(self, result) -> None:
        """After the window finished (its StepResult): its figures into `stats`."""
        self.stats = self.balance.end(result)

    def abandon(self) -> None:
        self.balance.abandon()

    def record_fields(self) -> dict:
        """The last window's metrics.jsonl fields: moe_lbl (its load-balancing loss over the
        whole window, whatever the mode), moe_aux (the term it trained with), moe_load_max
        and moe_load (per MoE layer, max over mean token fraction: 1 when balanced)."""
        stats = self.stats
        if stats is None:
            return {}
        return {
            "moe_lbl": stats.lbl,
            "moe_aux": stats.aux_loss,
            "moe_load_max": round(stats.max_load, LOAD_DIGITS),
            "moe_load": [round(x, LOAD_DIGITS) for x in stats.load],
            # a routing pass that routed otherwise than the training forwards (dropout before
            # a router, router noise): "global"'s f was the pass's, not exact
            **({"moe_routing_agrees": False} if stats.routing_agrees is False else {}),
        }

    def progress(self) -> str:
        return "" if self.stats is None else f"lbl {self.stats.lbl:.3f}"

    def state_dict(self) -> dict:
        return self.balance.state_dict()

    def load_state_dict(self, trainer_state: dict, step: int) -> list[str]:
        """The balance's state from a checkpoint's `trainer_state`; a line when the mode
        differs from the one the run was trained with (applied from the next window)."""
        saved = trainer_state.get(STATE_KEY)
        if saved is None:
            return []
        self.balance.load_state_dict(saved)
        old = saved.get("mode")
        if old is None or old == self.mode:
            return []
        return [f"moe-balance {old} -> {self.mode} from step {step}"]


def make(config: TrainConfig, model: torch.nn.Module) -> MoETraining | None:
    """The run's balance (`balance_mode`); None for a dense model."""
    mode = balance_mode(config, model)
    return None if mode is None else MoETraining(Balance(model, mode))


def summary_fields(moe: MoETraining | None, records: list[dict]) -> dict:
    """The --json fields: moe_balance (the mode; None for a dense model), final_moe_lbl and
    final_moe_load_max of the last window."""
    last = [r for r in records if r.get("moe_lbl") is not None]
    return {
        "moe_balance": None if moe is None else moe.mode,
        "final_moe_lbl": last[-1]["moe_lbl"] if last else None,
        "final_moe_load_max": last[-1]["moe_load_max"] if last else None,
    }
