"""A task of one's own: sequence classification on the built-in GPT, trained by `gradaccum
train` without a line of gradaccum changed.

    gradaccum train --task examples.custom_task:MajorityClass --max-steps 40 --seq-len 32

Each example is a sequence of --seq-len random tokens, labelled 1 when more of them are in the
upper half of the vocabulary than in the lower, else 0. The model is the built-in GPT as
`--model` builds it; the class is read from its last position's logits over two class ids (0
and 1), so the checkpoint and the export stay the built-in model's. The loss of a micro-batch
is its sequences' cross-entropy summed, and its count is its sequences: the engine divides
once by the window's sequences over every micro-batch and rank, so a step is the big batch's
mean whatever the micro-batch, k or number of ranks (docs/tasks.md).
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F

from gradaccum.data.tokens import DataInfo
from gradaccum.train.tasks import BatchRequest, TaskBase, TaskData, TaskRules

VOCAB = 64
"""Token ids of the examples, and the model's vocabulary."""
CLASSES = (0, 1)
"""The ids whose last-position logits are the class scores."""
ACCUM_STEPS = 16
"""Micro-batches a step when neither --accum-steps nor --tokens-per-step is given."""


class MajorityRules(TaskRules):
    """Its defaults: 16 sequences a micro-batch, ACCUM_STEPS micro-batches a step."""

    defaults = {"micro_batch": 16, "lr": 1e-3, "eval_every": 20, "max_steps": 60}


def make_examples(count: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, seq_len) token ids and their labels, the same for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (count, seq_len), generator=gen)
    labels = ((ids >= VOCAB // 2).sum(1) * 2 > seq_len).long()
    return ids, labels


def summed_loss(model, micro: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy summed over the micro-batch's sequences, their number)."""
    logits = model(micro["input_ids"])[:, -1, list(CLASSES)]
    if logits.dtype != torch.float64:
        logits = logits.float()
    loss = F.cross_entropy(logits, micro["labels"], reduction="sum")
    return loss, torch.tensor(micro["labels"].numel())


class Stream:
    """The training sequences, `micro_batch` a micro-batch, in an order drawn from the seed
    for each pass; rank r takes micro-batches r, r + world, ... of the order (the same windows
    on any number of ranks when micro-batch x world is the same)."""

    def __init__(self, ids, labels, micro_batch: int, seed: int, rank: int, world: int):
        self.ids, self.labels, self.seed = ids, labels, seed
        self.micro_batch, self.rank, self.world = micro_batch, rank, world
        self.position = 0
        """Sequences taken over all ranks."""

    def set_micro_batch(self, micro_batch: int) -> None:
        self.micro_batch = micro_batch

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        n, b = len(self.labels), self.micro_batch
        start = self.position + self.rank * b
        self.position += b * self.world
        rows = [self._order(i // n)[i % n] for i in range(start, start + b)]
        return {"input_ids": self.ids[rows], "labels": self.labels[rows]}

    def _order(self, epoch: int) -> list[int]:
        gen = torch.Generator().manual_seed(self.seed * 1000 + epoch)
        return torch.randperm(len(self.labels), generator=gen).tolist()

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict, other_data: bool = False) -> None:
        self.position = int(state["position"])


class MajorityClass(TaskBase):
    """Sequence classification: does the upper half of the vocabulary hold the majority?"""

    rules = MajorityRules

    def load_data(self) -> TaskData:
        seq_len, seed = self.config.seq_len, self.config.seed
        train, val = make_examples(4096, seq_len, seed), make_examples(512, seq_len, seed + 1)
        digest = hashlib.sha256(train[0].numpy().tobytes() + val[0].numpy().tobytes())
        tokens = (len(train[1]) + len(val[1])) * seq_len
        info = DataInfo(f"majority of {VOCAB} ids", VOCAB, None, tokens,
                        len(train[1]) * seq_len, len(val[1]) * seq_len, None,
                        digest.hexdigest())  # fmt: skip
        return TaskData(train, val, info)

    def batch_request(self, data: TaskData, model, say) -> BatchRequest:
        """k = ACCUM_STEPS micro-batches a step unless --accum-steps or --tokens-per-step
        (sequences x --seq-len) says otherwise."""
        request = BatchRequest.of(self.config)
        if request.accum_steps is None and request.tokens_per_step is None:
            return request.but(accum_steps=ACCUM_STEPS)
        return request

    def stream(self, data: TaskData, micro_batch: int) -> Stream:
        rank, world = self.rank_info.rank, self.rank_info.world_size
        return Stream(*data.train, micro_batch, self.config.seed, rank, world)

    def loss(self, model, micro: dict, weight: float):
        return summed_loss(model, micro)

    def evaluate(self, model, data: TaskData, micro_batch: int) -> tuple[dict, list[str]]:
        """The held-out cross-entropy per sequence and the accuracy."""
        ids, labels = data.val
        was = model.training
        model.eval()
        loss, right = 0.0, 0
        device = self.rank_info.device
        with torch.no_grad():
            for i in range(0, len(labels), micro_batch):
                micro = {"input_ids": ids[i : i + micro_batch].to(device),
                         "labels": labels[i : i + micro_batch].to(device)}  # fmt: skip
                s, _ = summed_loss(model, micro)
                logits = model(micro["input_ids"])[:, -1, list(CLASSES)]
                loss += float(s)
                right += int((logits.argmax(-1) == micro["labels"]).sum())
        model.train(was)
        n = len(labels)
        fields = {"eval_loss": loss / n, "accuracy": right / n}
        return fields, [f"eval loss {loss / n:.4f}, accuracy {right}/{n} ({right / n:.3f})"]

    def eval_fingerprint(self, data: TaskData) -> str:
        return hashlib.sha256(data.val[0].numpy().tobytes()).hexdigest()

    def record(self, result, window) -> tuple[dict, list[str]]:
        return {"sequences": result.tokens}, [f"{result.tokens} seq"]
