"""`gradaccum train`: train a causal LM at a fixed tokens-per-step budget.

With no flags it trains the built-in `tiny` GPT on the built-in Markov corpus, 192 steps of
8,192 tokens, writing to runs/<date>-<time> (about a minute on 2 idle CPU cores; see
docs/pretraining.md). --task sft fine-tunes on instruction data (docs/fine-tuning.md).

Progress: a bar on a terminal; in a log, a line about 10 s in, then every tenth of the run or
every 30 s, whichever comes first. A line's tokens/s is that of the steps since the line
before (their tokens over their seconds); the bar's, a moving average over about 10 steps.

Values come from, later ones winning: the defaults; on --resume the checkpoint's own
settings; the --config file (YAML, TOML or JSON; keys are the flag names, with - or _, flat
or under each group's name; a run's own config.yaml is one); the command line.
On --resume a setting that differs from the checkpoint's is either applied and printed in one
line, or refused naming its flag.
Exit codes: 0 when training ended or SIGTERM stopped it after saving; 130 when Ctrl-C
stopped it after saving (a second Ctrl-C does not wait for the save); 2 on bad input.
Under torchrun the ranks save and exit 0 after a SIGTERM, and torchrun itself exits 1 (its
agent reports the signal it received): the checkpoint is in --out/checkpoints all the same.
"""

from __future__ import annotations

from gradaccum.settings.command import Command, part
from gradaccum.train.config import COMPONENTS, EXCLUSIVE
from gradaccum.train.settings import TASK_DEFAULTS

COMMAND = Command(
    name="train",
    help="train a causal LM at a fixed tokens-per-step budget",
    description=__doc__.split("\n", 1)[1].strip(),
    parts=tuple(part(c) for c in COMPONENTS),
    run="train_run",
    task_defaults=TASK_DEFAULTS,
    exclusive=EXCLUSIVE,
)
