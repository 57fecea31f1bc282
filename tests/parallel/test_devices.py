"""The device chokepoint on CPU: which device a name resolves to, the collective backend per
kind, autocast, memory queries that CPU does not answer, and out-of-memory caught by type."""

from __future__ import annotations

import pytest
import torch

from gradaccum.parallel import devices


def test_cpu_is_always_available_and_unknown_kinds_are_named():
    assert devices.available("cpu") is True
    with pytest.raises(ValueError, match="unknown device kind 'tpu'"):
        devices.available("tpu")


def test_default_kind_is_the_first_accelerator_present(monkeypatch):
    present = {"cpu"}
    monkeypatch.setattr(devices, "available", lambda kind: kind in present)
    assert devices.default_kind() == "cpu"
    assert devices.resolve() == torch.device("cpu")
    present.add("xpu")
    assert devices.default_kind() == "xpu"
    present.add("cuda")  # cuda is preferred over xpu
    assert devices.default_kind() == "cuda"
    # "auto" and None pick it, indexed by the local rank
    assert devices.resolve("auto", local_rank=3) == torch.device("cuda", 3)
    assert devices.resolve(None) == torch.device("cuda", 0)


@pytest.mark.parametrize(
    "name, local_rank, want",
    [
        ("cpu", 5, torch.device("cpu")),  # one cpu device whatever the rank
        ("cuda", 2, torch.device("cuda", 2)),  # a kind alone gets the local rank
        ("cuda:1", 2, torch.device("cuda", 1)),  # an explicit index wins
        ("xpu", 1, torch.device("xpu", 1)),
        ("mps", 4, torch.device("mps")),
        (torch.device("cpu"), 0, torch.device("cpu")),
    ],
)
def test_resolve_names(name, local_rank, want):
    assert devices.resolve(name, local_rank=local_rank) == want


@pytest.mark.parametrize(
    "device, backend",
    [("cuda:0", "nccl"), ("cuda", "nccl"), ("xpu:1", "xccl"), ("cpu", "gloo"), ("mps", "gloo")],
)
def test_collective_backend_per_kind(device, backend):
    assert devices.distributed_backend(device) == backend


def test_autocast_on_cpu_changes_the_matmul_dtype_only_when_asked():
    cpu = torch.device("cpu")
    a, b = torch.randn(4, 8), torch.randn(8, 2)
    with devices.autocast(cpu, None):
        assert (a @ b).dtype == torch.float32
    with devices.autocast(cpu, torch.bfloat16):
        out = a @ b
    assert out.dtype == torch.bfloat16
    # the bf16 product is the fp32 one rounded: within bf16's 8 bits of mantissa
    exact = a.double() @ b.double()
    assert torch.allclose(out.double(), exact, rtol=2**-6, atol=2**-6 * exact.abs().max())


def test_cpu_reports_no_memory_figures():
    cpu = torch.device("cpu")
    assert devices.peak_memory_bytes(cpu) is None
    assert devices.total_memory_bytes(cpu) is None
    devices.set_current(cpu)  # no-ops on cpu: nothing to bind, wait for or free
    devices.synchronize(cpu)
    devices.reset_peak_memory(cpu)
    devices.empty_cache(cpu)
    assert devices.peak_memory_bytes(cpu) is None


def test_out_of_memory_is_caught_by_type_not_by_message():
    errors = devices.out_of_memory_errors()
    assert isinstance(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried 2 GiB"), errors)
    # a RuntimeError that merely mentions memory is not one
    assert not isinstance(RuntimeError("out of memory"), errors)


# ---- one --device check for every command ------------------------------------------------


@pytest.mark.parametrize("command", ["train", "fit", "bench"])
@pytest.mark.parametrize(
    "device, says",
    [
        ("cuda", "built without CUDA"),
        ("cuda:1", "built without CUDA"),
        ("mps", "built without MPS"),
        ("xpu", "no Intel XPU"),
        ("meta", "meta tensors hold no data"),
        ("npu", "torch_npu is not installed"),
        ("tpu", "unknown device; choose cpu, cuda"),
        ("cpu:3", "this machine has 1 cpu device(s): cpu:0"),
        ("cuda:one", "the index after ':' must be a whole number"),
    ],
)
def test_every_command_refuses_a_device_it_cannot_use_in_one_line(
    command, device, says, tmp_path, capsys
):
    from gradaccum.cli import main

    if torch.cuda.is_available() or torch.backends.mps.is_available():
        pytest.skip("this check is about a CPU-only build of torch")
    argv = [command, "--device", device]
    if command == "train":
        argv += ["--out", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"gradaccum: error: --device {device}: ") and says in err, err
    assert "privateuseone" not in err  # not torch's own list of device types
    if device == "npu":  # the kind is refused for what is missing, not listed as a choice
        assert "choose" not in err
    assert not (tmp_path / "run").exists()


def test_an_index_is_checked_against_the_devices_present(monkeypatch):
    from gradaccum.utils.errors import BadInput

    monkeypatch.setattr(devices, "available", lambda kind: kind in ("cpu", "cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for name in ("auto", "cpu", "cuda", "cuda:0", "cuda:1"):
        devices.check_device(name)
    with pytest.raises(
        BadInput,
        match=r"^--device cuda:2: this machine has 2 cuda device\(s\): "
        r"cuda:0 to cuda:1$",
    ):
        devices.check_device("cuda:2")
