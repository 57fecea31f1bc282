"""Hugging Face folders read from disk: every weight layout loads with the weights as stored
(compared with the files read directly, and with transformers' own from_pretrained), bf16
stays bf16, and every bad folder is one line naming --init-from and the path."""

from __future__ import annotations

import json
import os

import pytest
import torch

from gradaccum.models import hf_folder
from gradaccum.models.build import build_model
from gradaccum.utils.errors import BadInput

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

FORMATS = {
    "safetensors": {},
    "sharded safetensors": {"max_shard_size": "20KB"},
    "pytorch_model.bin": {"safe_serialization": False},
}


def tensors_on_disk(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weight files, read with safetensors or torch.load itself."""
    names = sorted(os.listdir(folder))
    out = {}
    for name in names:
        path = os.path.join(folder, name)
        if name.endswith(".safetensors"):
            out.update(safetensors_torch.load_file(path))
        elif name.endswith(".bin"):
            out.update(torch.load(path, weights_only=True))
    return out


def reference_model(folder: str) -> torch.nn.Module:
    """The model built from config.json with the files' tensors put in by hand (no
    from_pretrained): only tied weights may be absent from the files."""
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_config(config)
    state = tensors_on_disk(folder)
    dtype = next(iter(state.values())).dtype
    model = model.to(dtype)
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= {"lm_head.weight"}  # tied to the token embedding
    return model.eval()


def logits(model, ids):
    with torch.no_grad():
        return model.eval()(ids).logits.float()


def ids(vocab=320, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (2, 24), generator=g)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("layout", list(FORMATS))
def test_each_layout_loads_the_stored_weights(make_hf_folder, arch, layout):
    folder = make_hf_folder(arch, seed=1, **FORMATS[layout])
    checked = hf_folder.read_folder(folder)
    assert checked.layout == layout
    if layout == "sharded safetensors":
        assert len(checked.weight_files) > 1
    model, info = build_model(init_from=folder, vocab_size=300, seq_len=64)
    assert info.kind == "hf" and info.vocab_size == 320 and info.seq_len == 64
    assert model.training  # ready to train, as every build_model path returns it
    x = ids()
    want = logits(reference_model(folder), x)
    theirs = logits(
        transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True), x
    )
    got = logits(model, x)
    assert (got - want).abs().max().item() <= 1e-5
    assert (got - theirs).abs().max().item() <= 1e-5


@pytest.mark.parametrize("layout", ["safetensors", "sharded safetensors"])
def test_bf16_weights_stay_bf16_bit_for_bit(make_hf_folder, layout):
    folder = make_hf_folder("llama", dtype=torch.bfloat16, **FORMATS[layout])
    model, _ = build_model(init_from=folder)
    stored = tensors_on_disk(folder)
    params = dict(model.named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in params.values())
    for name, tensor in stored.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(params[name], tensor), name
    upcast, _ = build_model(init_from=folder, dtype="fp32")
    for name, p in upcast.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, stored[name].float()), name


def test_the_projects_own_checkpoint_of_an_hf_model_still_loads(tmp_path, make_hf_folder):
    # config.json (a Hugging Face config) and model.pt, as train/rundir/checkpoint.py writes them
    source, _ = build_model(init_from=make_hf_folder("gpt2", seed=2))
    torch.save(source.state_dict(), tmp_path / "model.pt")
    (tmp_path / "config.json").write_text(json.dumps(source.config.to_dict()))
    loaded, info = build_model(init_from=str(tmp_path))
    assert info.source == f"checkpoint {tmp_path}"
    for (n, a), (_, b) in zip(
        loaded.state_dict().items(), source.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("dtype, want", [("auto", torch.bfloat16), ("fp32", torch.float32)])
def test_a_checkpoint_of_a_loaded_folder_rebuilds_in_the_dtype_loaded(
    tmp_path, make_hf_folder, dtype, want
):
    # What train/rundir/checkpoint.py writes for an HF model: model.pt and ModelInfo.config.
    source, info = build_model(init_from=make_hf_folder("llama", dtype=torch.bfloat16), dtype=dtype)
    torch.save(source.state_dict(), tmp_path / "model.pt")
    (tmp_path / "config.json").write_text(json.dumps(info.config))
    again, _ = build_model(init_from=str(tmp_path))
    for (n, a), (_, b) in zip(again.state_dict().items(), source.state_dict().items(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), n
    assert {p.dtype for p in again.parameters()} == {want}


class RunsCode:
    """A pickle that would create a file when unpickled without weights_only."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_that_runs_code_is_refused_not_run(make_hf_folder, tmp_path):
    folder = make_hf_folder("gpt2", safe_serialization=False)
    marker = tmp_path / "ran"
    torch.save(
        {"transformer.wte.weight": RunsCode(str(marker))}, os.path.join(folder, "pytorch_model.bin")
    )
    with pytest.raises(BadInput) as err:
        build_model(init_from=folder)
    assert str(err.value).startswith(
        f"--init-from {folder}: pytorch_model.bin weights are not readable"
    )
    assert not marker.exists()
    # the same file read without weights_only runs it: the check above can see code run
    torch.load(os.path.join(folder, "pytorch_model.bin"), weights_only=False)
    assert marker.exists()


def one_line(err) -> str:
    line = str(err.value)
    assert "\n" not in line and len(line) < 400, line
    return line


def test_a_folder_without_config_json(make_hf_folder):
    folder = make_hf_folder("gpt2")
    os.remove(os.path.join(folder, "config.json"))
    with pytest.raises(BadInput) as err:
        build_model(init_from=folder)
    assert one_line(err) == f"--init-from {folder}: no config.json in it"


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_folder_without_weights(make_hf_folder, arch):
    folder = make_hf_folder(arch)
    os.remove(os.path.join(folder, "model.safetensors"))
    with pytest.raises(BadInput) as err:
        build_model(init_from=folder)
    assert one_line(err).startswith(
        f"--init-from {folder}: holds no weights (expected model.safetensors"
    )


def test_a_shard_named_in_the_index_but_missing(make_hf_folder):
    folder = make_hf_folder("llama", max_shard_size="20KB")
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    os.remove(os.path.join(folder, shards[1]))
    with pytest.raises(BadInput) as err:
        build_model(init_from=folder)
    assert one_line(err) == (
        f"--init-from {folder}: {shards[1]}, named in model.safetensors.index.json, is missing"
    )


@pytest.mark.parametrize(
    "index, needle",
    [
        ("{not json", "model.safetensors.index.json is not readable JSON"),
        ('{"metadata": {}}', "model.safetensors.index.json has no weight_map"),
        (
            '{"weight_map": {"a": "../elsewhere.safetensors"}}',
            "model.safetensors.index.json names '../elsewhere.safetensors', not a file",
        ),
    ],
)
def test_a_damaged_index(make_hf_folder, index, needle):
    folder = make_hf_folder("gpt2", max_shard_size="20KB")
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        f.write(index)
    with pytest.raises(BadInput) as err:
        build_model(init_from=folder)
    assert one_line(err).startswith(f"--init-from {folder}: {needle}")


def test_a_damaged_shard_and_a_missing_tensor(make_hf_folder):
    folder = make_hf_folder("llama", max_shard_size="20KB")
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    shard = weight_map["model.layers.0.mlp.up_proj.weight"]
    with open(os.path.join(folder, shard), "wb") as f:
        f.write(b"\x07" * 64)
    with pytest.raises(BadInput) as err:
        build_model(init_from=folder)
    assert one_line(err).startswith(
        f"--init-from {folder}: sharded safetensors weights are not readable"
    )

    single = make_hf_folder("llama")
    state = safetensors_torch.load_file(os.path.join(single, "model.safetensors"))
    del state["model.layers.0.mlp.up_proj.weight"]
    safetensors_torch.save_file(state, os.path.join(single, "model.safetensors"), {"format": "pt"})
    with pytest.raises(BadInput) as err:
        build_model(init_from=single)
    assert one_line(err) == (
        f"--init-from {single}: weights do not match config.json: 1 missing "
        "(model.layers.0.mlp.up_proj.weight)"
    )


def test_a_tensor_of_the_wrong_shape(make_hf_folder):
    folder = make_hf_folder("llama")
    path = os.path.join(folder, "model.safetensors")
    state = safetensors_torch.load_file(path)
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    safetensors_torch.save_file(state, path, {"format": "pt"})
    with pytest.raises(BadInput) as err:
        build_model(init_from=folder)
    assert one_line(err).startswith(f"--init-from {folder}: weights do not match config.json")


def _bert_folder(tmp_path, vocab_size: int, layers: int) -> str:
    folder = str(tmp_path / "bert")
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    transformers.BertForMaskedLM(config).save_pretrained(folder)
    return folder


def test_an_encoder_folder_is_refused_naming_its_architecture(tmp_path):
    folder = _bert_folder(tmp_path, vocab_size=300, layers=2)
    with pytest.raises(BadInput) as err:
        build_model(init_from=folder)
    assert one_line(err).startswith(
        f"--init-from {folder}: model_type bert builds BertLMHeadModel, which reads later tokens"
    )


def test_an_encoder_with_a_vocabulary_too_small_is_refused_for_its_architecture(tmp_path):
    # The data's 512 ids do not fit BERT's 100 either; the architecture is what no vocabulary
    # would fix, so it is named first.
    folder = _bert_folder(tmp_path, vocab_size=100, layers=1)
    with pytest.raises(BadInput) as err:
        build_model(init_from=folder, vocab_size=512, seq_len=32)
    assert one_line(err).startswith(f"--init-from {folder}: model_type bert builds ")
    assert "vocabulary holds" not in one_line(err)


def test_an_encoder_decoder_folder_is_no_causal_lm(tmp_path):
    folder = str(tmp_path / "t5")
    config = transformers.T5Config(
        vocab_size=300, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2
    )
    transformers.T5ForConditionalGeneration(config).save_pretrained(folder)
    with pytest.raises(BadInput) as err:
        build_model(init_from=folder)
    assert one_line(err).startswith(f"--init-from {folder}: not a causal LM (")


def test_a_folder_that_does_not_fit_the_data(make_hf_folder):
    folder = make_hf_folder("gpt2")
    with pytest.raises(BadInput) as err:
        build_model(init_from=folder, vocab_size=1000)
    assert one_line(err) == (
        f"--init-from {folder}: the data has 1000 token ids but the model's vocabulary holds 320"
    )
    with pytest.raises(BadInput, match="exceed the model's 64 positions"):
        build_model(init_from=folder, seq_len=65)


def test_nothing_is_fetched_from_the_network(make_hf_folder, monkeypatch):
    # Any connection attempt fails the test: a local folder loads with the network cut.
    import socket

    def no_network(*args, **kwargs):
        raise AssertionError("a network connection was attempted")

    folder = make_hf_folder("llama", max_shard_size="20KB")
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    model, _ = build_model(init_from=folder)
    assert model is not None
