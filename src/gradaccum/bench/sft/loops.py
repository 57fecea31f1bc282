"""The contestants of `gradaccum bench --task sft`: how each loop turns a window of SFT examples
into micro-batches and one optimizer step.

Every contestant gets the same Hugging Face causal LM (a copy), the same windows of
`Example`s in the same order, `micro_batch` examples per micro-batch and k micro-batches per
step where it cuts by examples, and calls `tick()` after each optimizer step:
- TRL's `SFTTrainer` as a user sets it up: its own collator, padding each micro-batch to its
  longest (stream order), the loss summed over the window's targets / their count (exact).
  Two of its defaults are turned off for every TRL run: bf16 (all contestants run fp32) and
  gradient checkpointing (none of the others recomputes);
- TRL with `padding_free=True`: each micro-batch's examples flattened into one row, position
  ids restarting per example (its docs ask for flash attention; on sdpa the update error says
  whether transformers' packed-sequence mask kept the examples apart);
- the Transformers Trainer with `DataCollatorForSeq2Seq` (pads inputs and labels);
- the shortest hand loop: pad each micro-batch, its mean loss / k;
- gradaccum's `Accumulator` on `gradaccum.data.sft.packing.micro_batches` in each --packing mode.
The windows hold whole examples; the examples of a step are the same for all of them.
With --lora-rank / --base-bits the model handed to each is a copy of one model with peft's
LoRA layers on a frozen (4- or 8-bit) base (`adapters`): the optimizer holds the adapters,
and TRL and the Trainer train what requires grad, as they do a model from `get_peft_model`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gradaccum import hf
from gradaccum.bench.pretrain.loops import Contestant, Run
from gradaccum.bench.sft.data import PAD_ID, VOCAB
from gradaccum.data.sft.examples import Example
from gradaccum.data.sft.packing import bucket_lengths, micro_batches
from gradaccum.data.sft.windows import collate
from gradaccum.engine.accumulator import Accumulator
from gradaccum.utils.choices import PACKINGS

PEERS = ("trl", "trl-padding-free", "trainer")
"""The peers `--peers` takes with --task sft."""


@dataclass
class SFTSetup:
    """What every SFT contestant is given besides its model and optimizer."""

    device: torch.device
    micro_batch: int
    """Examples per micro-batch (where a contestant cuts by examples)."""
    accum_steps: int
    """Micro-batches per optimizer step (k) where it cuts by examples."""
    micro_batch_tokens: int
    """gradaccum window / padding-free: positions per micro-batch, padding included."""
    row_tokens: int
    """gradaccum padding-free: positions per row (the sequence length)."""
    workdir: str
    seed: int


def gradaccum_run(packing: str, model, optimizer, setup: SFTSetup) -> Run:
    """`micro_batches` in mode `packing`; padding-free with bucketed rows (rows as wide as
    the bucket of the example opening them: the train command's cut without --compile)."""
    acc = Accumulator(model, optimizer, count_tokens=hf.count_tokens)
    sizes = {
        "micro_batch": setup.micro_batch,
        "micro_batch_tokens": setup.micro_batch_tokens,
        "row_tokens": setup.row_tokens,
    }
    if packing == "padding-free":
        sizes["buckets"] = bucket_lengths(setup.row_tokens)

    def run(windows, tick):
        for window in windows:
            batches = micro_batches(window, packing, pad_id=PAD_ID, layout="unshifted", **sizes)
            acc.step([{k: v.to(setup.device) for k, v in b.items()} for b in batches], hf.loss_fn)
            tick()

    return run


def runs_of(window: Sequence[Example], micro_batch: int) -> list[list[Example]]:
    """The window cut into runs of micro_batch examples in stream order (what a loader of
    batch size micro_batch hands out)."""
    return [list(window[i : i + micro_batch]) for i in range(0, len(window), micro_batch)]


def hand_run(model, optimizer, setup: SFTSetup) -> Run:
    """Each micro-batch padded to its longest, its mean loss over its targets divided by k."""

    def run(windows, tick):
        for window in windows:
            runs = runs_of(window, setup.micro_batch)
            for part in runs:
                batch = {
                    k: v.to(setup.device) for k, v in collate(part, PAD_ID, "unshifted").items()
                }
                loss_sum, n = hf.loss_fn(model, batch)
                (loss_sum / n / len(runs)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            tick()

    return run


def hf_byte_tokenizer():
    """A transformers tokenizer of the bench's byte vocabulary (ids 0..255, EOS 256 also the
    pad), built here: the peers need one for its pad and EOS ids, nothing is downloaded."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<0x{i:02X}>": i for i in range(VOCAB - 1)} | {"<eos>": PAD_ID}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def _dataset(windows):
    """The windows' examples, in order, as a `datasets.Dataset` of token lists (tokenized
    already, so every peer trains on exactly the examples gradaccum does)."""
    from datasets import Dataset

    rows = [e for window in windows for e in window]
    return Dataset.from_dict(
        {
            "input_ids": [e.input_ids.tolist() for e in rows],
            "labels": [e.labels.tolist() for e in rows],
        }
    )


def _tick_callback(tick):
    from transformers import TrainerCallback

    class Tick(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            tick()

    return Tick()


def _common_args(setup: SFTSetup, windows) -> dict:
    """TrainingArguments shared by the Trainer and TRL: one step per window, our optimizer,
    the data in the given order, no clipping, nothing logged or saved."""
    import dataclasses

    from transformers import TrainingArguments

    if setup.device.type not in ("cpu", "cuda") or (setup.device.index or 0) != 0:
        raise RuntimeError(f"runs here on cpu or cuda:0 only, not {setup.device}")
    if "train_sampling_strategy" not in {f.name for f in dataclasses.fields(TrainingArguments)}:
        # older Trainers shuffle with no switch to turn it off: not the same examples per step
        raise RuntimeError("needs a transformers with train_sampling_strategy (5.x)")
    return {
        "output_dir": setup.workdir,
        "per_device_train_batch_size": setup.micro_batch,
        "gradient_accumulation_steps": setup.accum_steps,
        "max_steps": len(windows),
        "max_grad_norm": 0.0,
        "report_to": "none",
        "save_strategy": "no",
        "logging_strategy": "no",
        "disable_tqdm": True,
        "use_cpu": setup.device.type == "cpu",
        "dataloader_pin_memory": False,
        "train_sampling_strategy": "sequential",
        "seed": setup.seed,
    }


def _scheduler(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def trl_run(padding_free: bool, model, optimizer, setup: SFTSetup) -> Run:
    """TRL's SFTTrainer on the tokenized examples, its own collator."""
    from trl import SFTConfig, SFTTrainer

    def run(windows, tick):
        args = SFTConfig(
            **_common_args(setup, windows),
            bf16=False,
            gradient_checkpointing=False,
            padding_free=padding_free,
            max_length=None,  # tokenized and cut to seq_len already (padding-free asks for None)
        )
        trainer = SFTTrainer(
            model=model,
            args=args,
            train_dataset=_dataset(windows),
            processing_class=hf_byte_tokenizer(),
            optimizers=(optimizer, _scheduler(optimizer)),
            callbacks=[_tick_callback(tick)],
        )
        trainer.train()

    return run


def trainer_run(model, optimizer, setup: SFTSetup) -> Run:
    """The Transformers Trainer with a padding collator; the model's own loss, to which the
    Trainer passes the window's target count (`num_items_in_batch`)."""
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments

    def run(windows, tick):
        tokenizer = hf_byte_tokenizer()
        trainer = Trainer(
            model=model,
            args=TrainingArguments(**_common_args(setup, windows), remove_unused_columns=False),
            train_dataset=_dataset(windows),
            data_collator=DataCollatorForSeq2Seq(tokenizer, padding="longest"),
            optimizers=(optimizer, _scheduler(optimizer)),
            callbacks=[_tick_callback(tick)],
        )
        trainer.train()

    return run


def gradaccum_contestant(packing: str) -> Contestant:
    return Contestant(
        f"gradaccum-{packing}",
        f"gradaccum --packing {packing}",
        functools.partial(gradaccum_run, packing),
    )


SFT_CONTESTANTS = (
    *(gradaccum_contestant(p) for p in PACKINGS),
    Contestant("hand-loop", "hand loop (pad, mean / k)", hand_run, divides_by_k=True),
    Contestant(
        "trl",
        "TRL SFTTrainer (padded)",
        functools.partial(trl_run, False),
        needs=("trl", "datasets"),
    ),
    Contestant(
        "trl-padding-free",
        "TRL SFTTrainer padding_free",
        functools.partial(trl_run, True),
        needs=("trl", "datasets"),
    ),
    Contestant(
        "trainer",
        "Transformers Trainer (padding collator)",
        trainer_run,
        needs=("transformers", "accelerate", "datasets"),
    ),
)
"""In the order of the table: gradaccum's packing modes, the hand loop, then the peers."""
