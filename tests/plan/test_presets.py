import pytest

from gradaccum.plan.presets import MODEL_SHAPES, ModelShape, custom, preset

# Parameter counts the released checkpoints report (Hugging Face `num_parameters()`).
PUBLISHED = {
    "gpt2-124m": 124_439_808,
    "gpt2-350m": 354_823_168,
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_matches_published(name):
    assert preset(name).params == PUBLISHED[name]


def test_every_preset_is_checked():
    assert set(MODEL_SHAPES) == set(PUBLISHED)


def test_llama2_7b_by_hand():
    h, f, v, layers = 4096, 11008, 32000, 32
    attention = 4 * h * h  # q, k, v, o; 32 kv heads = 32 heads
    mlp = 3 * h * f  # gate, up, down
    norms = 2 * h  # two RMSNorms, no bias
    embeddings = 2 * v * h  # input embedding and untied output projection
    assert preset("llama2-7b").layer_params == attention + mlp + norms
    assert preset("llama2-7b").params == layers * (attention + mlp + norms) + embeddings + h


def test_llama2_70b_grouped_query_attention_by_hand():
    h, kv = 8192, 8 * (8192 // 64)  # 8 key/value heads of 128
    attention = 2 * h * h + 2 * h * kv
    assert preset("llama2-70b").layer_params == attention + 3 * h * 28672 + 2 * h


def test_gpt2_by_hand():
    h, v, positions = 768, 50257, 1024
    layer = (
        2 * (2 * h)  # two LayerNorms, weight and bias
        + (h * 3 * h + 3 * h)  # fused qkv with bias
        + (h * h + h)  # attention output projection
        + (h * 4 * h + 4 * h)  # MLP up
        + (4 * h * h + h)  # MLP down
    )
    shape = preset("gpt2-124m")
    assert shape.layer_params == layer
    assert shape.params == v * h + positions * h + 12 * layer + 2 * h  # tied output
    assert shape.largest_tensor == v * h


def test_custom_shape_is_gpt_style():
    layers, h, heads, v = 4, 256, 8, 1000
    shape = custom(layers, h, heads, v)
    # tied embeddings, 4h MLP, no biases: V h + L (4 h^2 + 8 h^2 + 2 h) + h
    assert shape.params == v * h + layers * (12 * h * h + 2 * h) + h


def test_preset_lookup_is_case_insensitive_and_lists_names():
    assert preset(" LLaMA2-7B ") is MODEL_SHAPES["llama2-7b"]
    with pytest.raises(KeyError, match="llama2-7b"):
        preset("llama9")


def test_shape_validation():
    with pytest.raises(ValueError, match="not divisible"):
        ModelShape("bad", 2, 100, 3, 10)
    with pytest.raises(ValueError, match="layers 0"):
        ModelShape("bad", 0, 64, 4, 10)
