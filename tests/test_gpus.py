"""`--nproc gpu`: CUDA_VISIBLE_DEVICES read as CUDA reads it, checked against torch.cuda's own NVML
path on the same inputs (torch's functions are pure given the variable and NVML's answers)."""

import os

import pytest
import torch.cuda

from elastic_nb.kernel import gpus
from elastic_nb.kernel.gpus import Gpu, parse_visible_devices, visible_gpu_count

pytestmark = pytest.mark.unit

UUIDS = ["GPU-1a2b3c4d-0000", "GPU-1a2b9999-0000", "GPU-77aa0000-0000", "GPU-88bb0000-0000"]

VALUES = [
    "0",
    "0,1",
    "1,0",
    "0,1,2,3",
    "3,2",
    "",
    "-1",
    "0,-1,2",
    "0,1,-1,2",
    "0,abc,1",
    "abc",
    "0,0",
    "1,2,1",
    "0,7",
    "7,0",
    " 1, 2",
    "1gpu2,2ampere",
    "+1",
    "01",
    "2,3,4,5,6",
    "GPU-77aa",
    "GPU-77aa,GPU-88bb",
    "GPU-1a2b",
    "GPU-1a2b3c4d,GPU-77aa",
    "GPU-77aa,GPU-77aa",
    "GPU-zzzz,GPU-77aa",
    "GPU-77aa,0",
    "GPU-88bb,GPU-1a2b9",
]


@pytest.mark.parametrize("value", VALUES)
def test_the_variable_parses_as_torch_parses_it(monkeypatch, value):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    assert parse_visible_devices(value) == torch.cuda._parse_visible_devices()


@pytest.mark.parametrize("value", [*VALUES, None])
def test_the_count_is_what_torch_counts_through_nvml(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", lambda: len(UUIDS))
    monkeypatch.setattr(torch.cuda, "_raw_device_uuid_nvml", lambda: list(UUIDS))
    expected = torch.cuda._device_count_nvml()
    found = [Gpu(uuid=u, mig=False) for u in UUIDS]
    env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    assert visible_gpu_count(env, gpus=lambda: found) == expected


def test_mig_is_counted_by_cuda_itself_with_the_jobs_environment():
    asked = []

    def cuda_count(env):
        asked.append(dict(env))
        return 3

    found = [Gpu(UUIDS[0], mig=False), Gpu(UUIDS[1], mig=True)]
    # A visible GPU in MIG mode: NVML's device list cannot say what CUDA enumerates.
    assert visible_gpu_count({}, gpus=lambda: found, cuda_count=cuda_count) == 3
    # Only GPU 0 visible, no MIG on it: NVML's answer stands, CUDA is not asked.
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    assert visible_gpu_count(env, gpus=lambda: found, cuda_count=cuda_count) == 1
    # MIG devices named in the variable.
    env = {"CUDA_VISIBLE_DEVICES": "MIG-aaaa,MIG-bbbb", "X": "1"}
    assert visible_gpu_count(env, gpus=lambda: found, cuda_count=cuda_count) == 3
    assert asked == [{}, env]


def test_the_real_driver_agrees_with_torch():
    # 0 on a machine without an NVIDIA driver (NVML and libcuda absent); torch's count on a GPU one.
    expected = torch.cuda.device_count()
    assert visible_gpu_count() == expected
    assert gpus._count_with_cuda(dict(os.environ)) == expected
