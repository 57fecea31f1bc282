"""`gradaccum train --task grpo`: RL fine-tuning on prompts, the GRPO family's loss exact over
the window and the ranks.

What differs from SFT, and only that, is here; the loop (`gradaccum.train.loop`) runs it:
- the prompts: the examples of --data (or the built-in instruction set), read as for SFT
  (`sft.load_data`), each cut at its first target token: the prompt, and its reference answer
  (the targets) as the `completion` column the rewards may read;
- the windows (`GRPOStream`): a generation takes --prompts-per-step x --steps-per-generation
  prompts of the data order (a new permutation each pass, seeded by --seed), deals them to the
  ranks (prompt j of the generation to rank j mod W, so each group stays on one rank), samples
  --num-generations completions of each with the current model (`grpo.sampling.sample`,
  seeded by (--seed, generation, j): the same completions on any number of ranks), scores
  them (`grpo.rewards`) and takes the advantages in each group (`rl.group_advantages`). The
  ranks then exchange their groups, so each holds the whole generation: window s of the
  generation trains on its prompts s x P .. (s + 1) x P - 1, each rank its own groups, in
  micro-batches of --micro-batch completions, longest first, each padded to its longest;
- on-policy (--steps-per-generation 1, the default) the loss takes its sampling log-probs
  from its own forward, detached (ratio 1); above 1 they are the model's at sampling time,
  kept with the generation (and in the checkpoint, so a resume continues exactly);
- the loss (`rl.PolicyLoss`, N `rl.counter`): summed over the window's completion tokens and
  divided once by the window's count over every micro-batch and rank, whatever the loss type;
- the record: rewards (mean, std, per function), completion lengths, the fraction of groups
  whose rewards are all equal (no gradient), clip fraction, entropy, and with --beta the KL.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from gradaccum import rl
from gradaccum.data.sft.builtin import builtin_rows
from gradaccum.data.sft.examples import IGNORE_INDEX, Example
from gradaccum.data.sft.windows import SFTBatches
from gradaccum.engine.precision import autocast_dtype
from gradaccum.grpo.rewards import RewardFn, load_rewards, probe, score
from gradaccum.grpo.sampling import sample
from gradaccum.parallel import collectives, devices
from gradaccum.train.config import TrainConfig
from gradaccum.train.grpo_plan import (  # noqa: F401 - the plan of a run, here too
    batch_request,
    length_line,
    plan_lines,
    prompts_per_step,
)
from gradaccum.train.settings import TASK_DEFAULTS
from gradaccum.utils.errors import BadInput


@dataclass(frozen=True)
class Prompt:
    """One prompt of the run: its tokens, its text, and its reference answer (the example's
    targets, without the end of text), the `completion` column of the rewards."""

    ids: list[int]
    text: str
    reference: str


def prompts_of(examples: list[Example], tokenizer, seq_len: int) -> list[Prompt]:
    """The examples cut at their first target: those that leave room for at least one
    completion token within seq_len."""
    found = []
    for e in examples:
        first = int(np.argmax(e.labels != IGNORE_INDEX))
        if first >= seq_len:
            continue
        ids = [int(i) for i in e.input_ids[:first]]
        answer = [int(i) for i in e.input_ids[first:] if int(i) != tokenizer.eos_id]
        found.append(Prompt(ids, tokenizer.decode(ids), tokenizer.decode(answer)))
    return found


def rewards_of(config: TrainConfig, prompts: list[Prompt]) -> list[RewardFn]:
    """--reward (or the built-in tasks' rewards), each called once on the first prompts before
    any generation (`rewards.probe`): BadInput naming --reward when one cannot be used."""
    found = load_rewards(config.reward, config.reward_weights)
    texts = [p.text for p in prompts[:2]]
    probe(found, texts, {"completion": [p.reference for p in prompts[:2]]})
    return found


def check_builtin_rewards(config: TrainConfig) -> None:
    """--reward probed on two prompts of the built-in set (`rewards_of`), without reading it
    all: the check a run on the built-in set makes before its SFT stage."""
    rows = builtin_rows(config.seed, n=2)
    probe(load_rewards(config.reward, config.reward_weights), [r["prompt"] for r in rows],
          {"completion": [r["completion"] for r in rows]})  # fmt: skip


@dataclass
class Group:
    """One prompt's completions, scored: what a generation holds per prompt."""

    prompt: list[int]
    completions: list[list[int]]
    stopped: list[bool]
    """Whether each completion ended with the end of text (else it hit the length limit)."""
    rewards: list[float]
    per_function: dict[str, list[float]]
    advantages: list[float]
    old_logprobs: list[torch.Tensor] | None = None
    """Each completion's log-probs at sampling time (--steps-per-generation > 1)."""
    ref_logprobs: list[torch.Tensor] | None = None
    """Each completion's log-probs under the reference model (--beta > 0)."""


@dataclass
class GRPOWindow:
    """What the loop trains on in one window, and what it records of it."""

    micro_batches: list[dict]
    shares: list[list[int]]
    """This rank's micro-batches as row numbers (empty: a stand-in with no completion)."""
    examples: int
    """Completions in the window over all ranks."""
    fields: dict
    """The window's record fields: rewards, lengths, groups of equal rewards, generation s."""


class GRPOStream:
    """The run's windows (module docstring), read by the loop as an SFT stream is: `next`,
    `position` (to rewind an abandoned window: it is generated again, the same), the
    micro-batch, `state_dict` / `load_state_dict`."""

    def __init__(self, config, prompts, tokenizer, rewards, model_of, micro_batch, rank_info,
                 reference=None):  # fmt: skip
        self.config, self.prompts, self.tokenizer = config, prompts, tokenizer
        self.rewards, self.model_of, self.micro_batch = rewards, model_of, micro_batch
        self.rank, self.world = rank_info.rank, rank_info.world_size
        self.device, self.reference = rank_info.device, reference
        self.per_step = prompts_per_step(config)
        self.slots = config.steps_per_generation
        self.order = SFTBatches(
            [_Length(p) for p in prompts],
            micro_batch=1,
            pad_id=0,
            examples_per_step=self.per_step * self.slots,
            seed=config.seed,
        )
        self.windows = 0
        self._generation: tuple[int, list[Group], float] | None = None

    @property
    def position(self) -> int:
        return self.windows

    @position.setter
    def position(self, value: int) -> None:
        self.windows = value

    def set_micro_batch(self, micro_batch: int) -> None:
        self.micro_batch = micro_batch

    def __iter__(self):
        return self

    def __next__(self) -> GRPOWindow:
        number, slot = divmod(self.windows, self.slots)
        seconds = 0.0
        if self._generation is None or self._generation[0] != number:
            t0 = time.perf_counter()
            self._generation = (number, self._generate(number), 0.0)
            seconds = time.perf_counter() - t0
        groups = self._generation[1][slot * self.per_step : (slot + 1) * self.per_step]
        self.windows += 1
        mine = [g for j, g in enumerate(groups) if j % self.world == self.rank]
        window = self._window(mine, groups)
        window.fields["generation_s"] = round(seconds, 3)
        return window

    # ---- a generation ----------------------------------------------------------------

    def _generate(self, number: int) -> list[Group]:
        """Generation `number`: its prompts sampled and scored, this rank's groups, then every
        rank's exchanged (each rank holds them all)."""
        self.order.position = number * self.per_step * self.slots
        indices = self.order.next_indices()
        model, config = self.model_of(), self.config
        mine = {}
        for j, i in enumerate(indices):
            if j % self.world != self.rank:
                continue
            prompt = self.prompts[i]
            seed = _seed(config.seed, number, j)
            eos = self.tokenizer.eos_id
            completions = sample(model, [prompt.ids], config.num_generations,
                                 config.max_completion_length, config.temperature, eos, seed)  # fmt: skip
            mine[j] = self._group(prompt, completions)
        self._logprobs(model, list(mine.values()))
        every = _gathered(mine, self.world)
        return [every[j] for j in range(len(indices))]

    def _group(self, prompt: Prompt, completions: list[list[int]]) -> Group:
        stopped, total, per_function = scored([prompt], completions, self.tokenizer, self.rewards)
        scale = self.config.scale_rewards == "group"
        advantages = rl.group_advantages(
            torch.tensor(total, dtype=torch.float64), len(completions), scale
        )
        return Group(prompt.ids, completions, stopped, total, per_function, advantages.tolist())

    def _logprobs(self, model, groups: list[Group]) -> None:
        """The sampling log-probs (--steps-per-generation > 1) and the reference's (--beta):
        taken now, in micro-batches as the window trains them."""
        wanted = [("old_logprobs", model, self.slots > 1),
                  ("ref_logprobs", self.reference, self.config.beta > 0)]  # fmt: skip
        for name, net, needed in wanted:
            if not needed:
                continue
            for group in groups:
                rows = [(group.prompt, c) for c in group.completions]
                setattr(group, name, self._row_logprobs(net, rows))

    @torch.no_grad()
    def _row_logprobs(self, model, rows) -> list[torch.Tensor]:
        found = []
        precision = autocast_dtype(self.config.precision)
        for start in range(0, len(rows), self.micro_batch):
            part = rows[start : start + self.micro_batch]
            batch = rl.collate(part, [0.0] * len(part), self.tokenizer.pad_id)
            with devices.autocast(self.device, precision):
                ids = batch["input_ids"].to(self.device)
                logprobs = rl.completion_logprobs(model, ids, self.config.temperature).float()
            for r, (prompt, completion) in enumerate(part):
                at = len(prompt) - 1
                found.append(logprobs[r, at : at + len(completion)].cpu())
        return found

    # ---- a window ----------------------------------------------------------------------

    def _window(self, mine: list[Group], groups: list[Group]) -> GRPOWindow:
        rows = [(g, c) for g in mine for c in range(len(g.completions))]
        rows.sort(key=lambda r: -(len(r[0].prompt) + len(r[0].completions[r[1]])))  # stable
        shares = [list(range(i, min(i + self.micro_batch, len(rows))))
                  for i in range(0, len(rows), self.micro_batch)]  # fmt: skip
        micro_batches = [self._micro_batch([rows[i] for i in s]) for s in shares]
        if not rows:  # no group on this rank: one row of no completion joins the collectives
            g = groups[0]
            stand_in = rl.collate([(g.prompt, g.completions[0])], [0.0], self.tokenizer.pad_id)
            stand_in["completion_mask"].zero_()
            micro_batches = [stand_in]
        fields = window_fields(groups)
        return GRPOWindow(micro_batches, shares, sum(len(g.completions) for g in groups), fields)

    def _micro_batch(self, rows: list[tuple[Group, int]]) -> dict:
        pairs = [(g.prompt, g.completions[c]) for g, c in rows]
        batch = rl.collate(pairs, [g.advantages[c] for g, c in rows], self.tokenizer.pad_id)
        width = batch["input_ids"].shape[1] - 1
        for name in ("old_logprobs", "ref_logprobs"):
            if getattr(rows[0][0], name) is None:
                continue
            values = torch.zeros(len(rows), width)
            for r, (g, c) in enumerate(rows):
                at = len(g.prompt) - 1
                values[r, at : at + len(g.completions[c])] = getattr(g, name)[c]
            batch[name] = values
        return batch

    # ---- checkpoint --------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The windows taken, and mid-generation (--steps-per-generation > 1) the generation
        itself: its completions and their sampling log-probs, which a later model could not
        give again."""
        state = {"windows": self.windows, "seed": self.config.seed, "prompts": len(self.prompts)}
        number, slot = divmod(self.windows, self.slots)
        if slot and self._generation is not None and self._generation[0] == number:
            state["generation"] = {"number": number,
                                   "groups": [_group_state(g) for g in self._generation[1]]}  # fmt: skip
        return state

    def load_state_dict(self, state: dict, other_data: bool = False) -> None:
        for key, now in (("seed", self.config.seed), ("prompts", len(self.prompts))):
            if not other_data and state[key] != now:
                raise ValueError(f"cannot resume the prompts: {key} was {state[key]}, now {now}")
        self.windows = int(state["windows"])
        saved = state.get("generation")
        if saved is not None:
            groups = [Group(**g) for g in saved["groups"]]
            self._generation = (int(saved["number"]), groups, 0.0)


@dataclass(frozen=True)
class _Length:
    """A prompt as the data order reads an example (only its length and targets)."""

    prompt: Prompt

    @property
    def length(self) -> int:
        return len(self.prompt.ids)

    num_targets = 1


def window_fields(groups: list[Group]) -> dict:
    """The record of a window's completions (all ranks'): reward mean and std, each reward
    function's mean, completion length (tokens) mean and max, the fraction that stopped, and
    the fraction of groups whose rewards are all equal (advantages 0: no gradient)."""
    rewards = [r for g in groups for r in g.rewards]
    lengths = [len(c) for g in groups for c in g.completions]
    fields = {
        "reward": float(np.mean(rewards)),
        "reward_std": float(np.std(rewards)),
        "completion_length": float(np.mean(lengths)),
        "completion_length_max": int(max(lengths)),
        "stopped": float(np.mean([s for g in groups for s in g.stopped])),
        "equal_reward_groups": float(np.mean([max(g.rewards) == min(g.rewards) for g in groups])),
    }
    for name in groups[0].per_function:
        fields[f"reward_{name}"] = float(np.mean([r for g in groups for r in g.per_function[name]]))
    return fields


EVAL_PROMPTS = 256
"""Held-out prompts (the first of the eval set) whose completions each evaluation samples."""
EVAL_GENERATION = 2**31 - 1
"""The generation number of the evaluations' sampling seed: one no run reaches, so the held-out
draws are never a training generation's, and the same at every evaluation."""


def scored(
    prompts: list[Prompt], completions: list[list[int]], tokenizer, rewards: list[RewardFn]
) -> tuple[list[bool], list[float], dict[str, list[float]]]:
    """The completions of `prompts` (the same number of each, prompt by prompt) scored:
    whether each ended with the end of text, its reward, and each reward function's values
    (`rewards.score`, given the text without the end of text)."""
    g = len(completions) // len(prompts)
    stopped = [bool(c) and c[-1] == tokenizer.eos_id for c in completions]
    texts = [
        tokenizer.decode(c[:-1] if s else c) for c, s in zip(completions, stopped, strict=True)
    ]
    columns = {"completion": [p.reference for p in prompts for _ in range(g)], "stopped": stopped}
    total, per_function = score(
        rewards, [p.text for p in prompts for _ in range(g)], texts, columns
    )
    return stopped, total, per_function


def evaluate_rewards(model, prompts: list[Prompt], tokenizer, rewards: list[RewardFn],
                     config: TrainConfig) -> tuple[dict, str]:  # fmt: skip
    """The rewards of --num-generations completions sampled (at --temperature, at most
    --max-completion-length tokens) from each held-out prompt of `prompts` (`eval_prompts`):
    the RL objective on prompts the run does not train on. The draws come from one seed, the
    same at every evaluation, so two evaluations differ by the policy alone. Returns the
    record's fields (eval_reward, eval_reward_<function>) and the words for the progress
    line."""
    if not prompts:
        return {}, ""
    g = config.num_generations
    completions = sample(model, [p.ids for p in prompts], g, config.max_completion_length,
                         config.temperature, tokenizer.eos_id,
                         _seed(config.seed, EVAL_GENERATION, 0))  # fmt: skip
    _, total, per_function = scored(prompts, completions, tokenizer, rewards)
    fields = {"eval_reward": float(np.mean(total))}
    for name, values in per_function.items():
        fields[f"eval_reward_{name}"] = float(np.mean(values))
    sampled = reward_words(fields, rewards, "eval_reward")
    return fields, f"; sampled reward {sampled}, {len(prompts)} x {g}"


def reward_words(fields: dict, rewards: list[RewardFn], key: str = "reward") -> str:
    """A record's reward `key` and each function's (`key`_<name>) for a progress line,
    "1.250 (exact 1.000, format 0.000)": every function, one that scored 0 too (where the
    reward comes from is what the line is read for)."""
    each = ", ".join(f"{r.name} {fields[f'{key}_{r.name}']:.3f}" for r in rewards)
    return f"{fields[key]:.3f} ({each})"


def eval_prompts(examples: list[Example], tokenizer, seq_len: int, count: int) -> list[Prompt]:
    """The held-out prompts each evaluation samples from: the first `count` (at most
    EVAL_PROMPTS, `eval_sizes`) of the eval set's examples."""
    return prompts_of(examples, tokenizer, seq_len)[: min(count, EVAL_PROMPTS)]


def eval_sizes(config: TrainConfig, total_steps: int, held_out: int) -> tuple[int, int]:
    """(prompts answered greedily, prompts sampled from) at each evaluation, of the `held_out`
    examples: --eval-prompts; not given, all of them (at most EVAL_PROMPTS sampled) for a run
    as long as the default one, whose figures docs/rl.md gives, and for a shorter run its
    share (at least 1 each): the evaluation, at the start and the end, would otherwise be most
    of a short run's time."""
    full = (held_out, min(held_out, EVAL_PROMPTS))
    if config.eval_prompts is not None:
        return min(config.eval_prompts, full[0]), min(config.eval_prompts, full[1])
    share = min(1.0, total_steps / TASK_DEFAULTS["grpo"]["max_steps"])
    return tuple(min(n, max(1, math.ceil(share * n))) for n in full)


def eval_line(config: TrainConfig, sizes: tuple[int, int], total_steps: int) -> str:
    """The opening line saying how much each evaluation answers and samples, and why."""
    greedy, sampled = sizes
    if config.eval_prompts is not None:
        why = f"--eval-prompts {config.eval_prompts}"
    elif total_steps < TASK_DEFAULTS["grpo"]["max_steps"]:
        why = (
            f"a {total_steps}-step run's share of the held-out prompts; --eval-prompts N to "
            "change, 0 for the held-out loss only"
        )
    else:
        why = "the full evaluation; --eval-prompts N for fewer, 0 for the held-out loss only"
    return (
        f"eval   {greedy} held-out prompts answered greedily, {sampled} x "
        f"{config.num_generations} completions sampled at each evaluation ({why})"
    )


def loss_fields(totals: dict[str, float], beta: float) -> dict:
    """The window's clip fraction, entropy (nats per token) and KL (with --beta), from this
    rank's `PolicyLoss.totals` summed over the ranks (one small all-reduce)."""
    summed = collectives.all_reduce_sum(torch.tensor([totals[k] for k in rl.TOTALS],
                                                     dtype=torch.float64))  # fmt: skip
    sums = dict(zip(rl.TOTALS, summed.tolist(), strict=True))
    tokens = max(sums["tokens"], 1.0)
    fields = {"clip_fraction": sums["clipped"] / tokens, "entropy": sums["entropy"] / tokens}
    if beta:
        fields["kl"] = sums["kl"] / tokens
    return fields


def _seed(seed: int, generation: int, j: int) -> int:
    """The sampling seed of prompt j of a generation: (--seed, generation, j) hashed."""
    state = np.random.SeedSequence([seed, generation, j, 0x6E0]).generate_state(2, np.uint32)
    return int(state[0]) << 31 | int(state[1]) >> 1


def _gathered(mine: dict[int, Group], world: int) -> dict[int, Group]:
    """Every rank's groups, by their place in the generation (each rank's own on one rank)."""
    if world == 1:
        return mine
    shares: list = [None] * world
    dist.all_gather_object(shares, mine)
    return {j: g for share in shares for j, g in share.items()}


def _group_state(group: Group) -> dict:
    return {k: v for k, v in vars(group).items()}


def check(config: TrainConfig, prompts: list[Prompt]) -> None:
    """BadInput when the data gives fewer prompts than one step takes."""
    need = prompts_per_step(config)
    if len(prompts) < need:
        raise BadInput(
            "--prompts-per-step",
            need,
            f"the data holds {len(prompts)} prompt(s) that leave room for a completion within "
            f"--seq-len {config.seq_len}",
        )
