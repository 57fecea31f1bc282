"""`gradaccum train`: train a causal LM at a fixed tokens-per-step budget.

With no flags it trains the built-in `tiny` GPT on the built-in Markov corpus, 192 steps of
8,192 tokens, writing to runs/<date>-<time>. Measured on 2 CPU cores shared with other work:
207 s with OMP_NUM_THREADS=1 (load average 5.0), 817 s and 1,089 s with torch's 2 threads
(load 5.3 to 5.6, where the threads wait for each other); 64 and 89 s on idle 2-core
machines earlier (README, Measured).

Progress: a bar on a terminal; in a log, a line about 10 s in, then every tenth of the run or
every 30 s, whichever comes first. A line's tokens/s is that of the steps since the line
before (their tokens over their seconds); the bar's, a moving average over about 10 steps.

Values come from, later ones winning: the defaults; on --resume the checkpoint's own
settings; the --config TOML file (keys are the flag names, with - or _); the command line.
On --resume a setting that differs from the checkpoint's is either applied and printed in one
line, or refused naming its flag.
Exit codes: 0 when training ended or SIGTERM stopped it after saving; 130 when Ctrl-C
stopped it after saving (a second Ctrl-C does not wait for the save); 2 on bad input.
Under torchrun the ranks save and exit 0 after a SIGTERM, and torchrun itself exits 1 (its
agent reports the signal it received): the checkpoint is in --out/checkpoints all the same.
"""

from __future__ import annotations

import argparse

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from ..train.config import FLAGS, merge_settings
from ..utils.errors import BadInput, first_line, flag_name
from . import flags
from .common import run_of


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(
        name,
        help="train a causal LM at a fixed tokens-per-step budget",
        description=__doc__.split("\n", 1)[1].strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for key, spec in FLAGS.items():
        if key in flags.SHARED:  # the flag as every command has it; TrainConfig reads it
            flags.SHARED[key](p, config=spec)
        elif spec.kind == "bool":
            p.add_argument(
                flag_name(key),
                dest=key,
                action="store_true",
                default=argparse.SUPPRESS,
                help=spec.help,
            )
        else:
            p.add_argument(
                flag_name(key),
                dest=key,
                default=argparse.SUPPRESS,
                metavar=spec.metavar,
                help=spec.help,
            )
    p.add_argument(
        "--config",
        dest="config_file",
        metavar="FILE.toml",
        default=None,
        help="TOML file whose keys are these flags; the command line wins",
    )
    p.set_defaults(run=run_of("train_run"))


def read_toml(path: str) -> dict:
    """The flags a TOML file sets, by field name; unknown keys are refused, all named."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise BadInput("--config", path, "no such file") from None
    except IsADirectoryError:
        raise BadInput("--config", path, "is a folder, expected a TOML file") from None
    except UnicodeDecodeError:
        raise BadInput("--config", path, "not UTF-8 text, expected a TOML file") from None
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise BadInput("--config", path, f"not a readable TOML file ({first_line(err)})") from None
    values, unknown = {}, []
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in FLAGS:
            unknown.append(key)
        else:
            values[name] = value
    if unknown:
        s = "s" if len(unknown) > 1 else ""
        raise BadInput("--config", path, f"unknown key{s} {', '.join(sorted(unknown))}")
    return values


def given_values(args: argparse.Namespace) -> dict:
    """What this invocation asks: the --config file under the command line (both untyped
    until TrainConfig reads them)."""
    from_file = read_toml(args.config_file) if args.config_file else {}
    on_line = {k: v for k, v in vars(args).items() if k in FLAGS}
    return merge_settings(from_file, on_line)
