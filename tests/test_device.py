"""Device and dtype names, the synchronizing clock, and the device and dtype a chapter picks."""
import pytest
import torch

from minillm import build_model, now, resolve_device, resolve_dtype, synchronize
from minillm.device import pick_device


@pytest.fixture
def no_cuda(monkeypatch):
    """Pretend there is no GPU, so these tests run the same on a CPU-only machine and on a GPU one."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_auto_is_cuda_exactly_when_torch_sees_a_gpu():
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_cpu_names(no_cuda):
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == resolve_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.parametrize("name", ["cuda", "cuda:0", torch.device("cuda")])
def test_cuda_without_a_gpu_is_a_clear_error(no_cuda, name):
    with pytest.raises(ValueError, match=r"no CUDA device.*is_available\(\) is False.*'cpu' or 'auto'"):
        resolve_device(name)


def test_build_model_on_absent_cuda_fails_before_allocating(no_cuda):
    with pytest.raises(ValueError, match="no CUDA device"):
        build_model("tiny", device="cuda")


@pytest.mark.parametrize("name", ["tpu", "gpu", "mps", ""])
def test_unknown_device(name):
    with pytest.raises(ValueError, match=rf"unknown device '{name}'; choose one of \('auto', 'cpu', 'cuda'\)"):
        resolve_device(name)


def test_device_of_the_wrong_type():
    with pytest.raises(TypeError, match="device=0 must be a str or torch.device"):
        resolve_device(0)


@pytest.mark.parametrize("name, dtype, nbytes", [
    ("float32", torch.float32, 4), ("bfloat16", torch.bfloat16, 2), ("float16", torch.float16, 2),
])
def test_dtypes(name, dtype, nbytes):
    assert resolve_dtype(name) is resolve_dtype(dtype) is dtype
    assert torch.empty(1, dtype=resolve_dtype(name)).element_size() == nbytes


@pytest.mark.parametrize("bad, kind, words", [
    ("fp8", ValueError, ["'fp8'", "float32", "bfloat16", "float16"]),
    ("half", ValueError, ["'half'", "float16"]),
    (torch.int8, ValueError, ["torch.int8", "float32"]),
    (32, TypeError, ["dtype=32", "str or torch.dtype"]),
])
def test_unknown_dtype(bad, kind, words):
    with pytest.raises(kind) as info:
        resolve_dtype(bad)
    for word in words:
        assert word in str(info.value)


def test_clock_is_monotone_and_synchronize_is_a_no_op_on_cpu():
    synchronize("cpu")
    synchronize(torch.device("cpu"))
    times = [now("cpu") for _ in range(5)] + [now()]
    assert times == sorted(times)


def test_pick_device_without_a_gpu(no_cuda, capsys):
    device, dtype = pick_device()
    assert (device, dtype) == (torch.device("cpu"), torch.float32)
    assert capsys.readouterr().out.startswith("device: cpu (CPU, ")
    assert pick_device(verbose=False) == (device, dtype)
    assert capsys.readouterr().out == ""


@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU as torch's CUDA queries describe it: name and compute capability set by the test. Like torch,
    ``is_bf16_supported()`` says True below 8.0 too, as it does on a T4 that only emulates bfloat16."""
    def install(name: str, capability: tuple[int, int]):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    return install


@pytest.mark.parametrize("name, capability, dtype", [
    ("Tesla T4", (7, 5), torch.float16),  # Turing: bfloat16 only emulated
    ("Tesla V100-SXM2-16GB", (7, 0), torch.float16),
    ("NVIDIA A100-SXM4-80GB", (8, 0), torch.bfloat16),
    ("NVIDIA H200", (9, 0), torch.bfloat16),
])
def test_pick_device_gives_bfloat16_only_where_the_gpu_computes_it(fake_gpu, capsys, name, capability, dtype):
    fake_gpu(name, capability)
    assert pick_device() == (torch.device("cuda"), dtype)
    assert capsys.readouterr().out == f"device: cuda ({name}), dtype: {str(dtype).removeprefix('torch.')}\n"

