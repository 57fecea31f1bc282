"""A setting's value read from the command line's text or a file's typed value alike, refused
in one wording per rule."""

import pytest

from gradaccum.train.config import TrainConfig
from gradaccum.utils.errors import BadInput


@pytest.mark.parametrize("value", [0, -3, "0", "-3", "-4M"])
def test_zero_and_negative_counts_are_refused_in_the_same_words(value):
    with pytest.raises(BadInput) as err:
        TrainConfig(lora_rank=value)
    assert str(err.value) == f"--lora-rank {str(value).strip()}: must be a whole number >= 1"


@pytest.mark.parametrize("value", [-1, "-1", "-2k"])
def test_a_negative_count_where_zero_is_allowed_is_named_as_negative(value):
    with pytest.raises(BadInput) as err:
        TrainConfig(save_every=value)
    assert str(err.value) == f"--save-every {value}: must not be negative"


@pytest.mark.parametrize("value", [1.5, "1.5", "nan", True])
def test_a_lora_dropout_outside_its_range_is_one_rule(value):
    with pytest.raises(BadInput, match="--lora-dropout"):
        TrainConfig(lora_rank=4, lora_dropout=value)
    assert TrainConfig(lora_rank=4, lora_dropout="0.1").lora_dropout == 0.1
