"""What travels between the kernel and the ranks: tensors always on the CPU."""

from __future__ import annotations

import pickle

import pytest
import torch

from elastic_nb.common import pickling

pytestmark = pytest.mark.unit


def test_cpu_tensors_and_parameters_travel_as_they_are() -> None:
    p = torch.nn.Parameter(torch.arange(3.0))
    t, q = pickle.loads(pickling.dumps((torch.ones(2), p)))
    assert torch.equal(t, torch.ones(2)) and isinstance(q, torch.nn.Parameter)
    assert q.requires_grad and torch.equal(q.detach(), p.detach())


@pytest.mark.cuda
def test_a_cuda_tensor_travels_on_the_cpu() -> None:
    # A pushed tensor restored on cuda:0 in every rank would put N CUDA contexts on GPU 0.
    t, p = pickle.loads(
        pickling.dumps((torch.ones(2, device="cuda"), torch.nn.Parameter(torch.ones(2).cuda())))
    )
    assert t.device.type == "cpu" and p.device.type == "cpu"
    assert isinstance(p, torch.nn.Parameter) and p.requires_grad


def test_a_model_on_the_meta_device_travels_as_it_is() -> None:
    # Built without memory, to be materialised in each rank: there is no data to move.
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    back = pickle.loads(pickling.dumps(model))
    assert back.weight.device.type == "meta" and back.weight.shape == (4, 4)
