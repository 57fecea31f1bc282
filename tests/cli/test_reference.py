"""docs/cli.md is what the settings generate: a flag added, renamed or re-described without
regenerating the page fails here."""

import os

from gradaccum.cli.reference import render

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_committed_cli_reference_is_the_generated_one():
    with open(os.path.join(ROOT, "docs", "cli.md")) as f:
        committed = f.read()
    assert committed == render(), "run: python -m gradaccum.cli.reference > docs/cli.md"


def test_the_reference_lists_every_flag_of_every_command():
    from gradaccum.cli import build_parser

    text = render()
    parser = build_parser()
    for name, sub in parser._subparsers._group_actions[0].choices.items():
        assert f"## gradaccum {name}" in text
        for action in sub._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help", "--config"):
                    assert f"`{flag}`" in text, (name, flag)
