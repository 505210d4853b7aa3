"""The library API's input checks (glm_ep/interop.py), called directly: a layer index is an integer and never a
boolean; a torch tensor is refused, naming its device, where it is on one glm_ep cannot read (meta, ...)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from glm_ep import interop
from glm_ep.errors import InputError

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("i", [True, False, np.bool_(True)], ids=["True", "False", "np.bool_"])
def test_a_boolean_layer_index_is_not_an_integer(i) -> None:
    """True is 1 to ``operator.index``: it was refused as 'out of range' (of 0..3, which holds 1)."""
    with pytest.raises(InputError) as e:
        interop.layer_index(i, 4)
    assert str(e.value) == f"site index {i!r} is not an integer; expected 0..3"


@pytest.mark.parametrize("i,index", [(0, 0), (3, 3), (np.int64(2), 2), (np.uint8(1), 1), (np.int32(0), 0)])
def test_python_and_numpy_integers_are_layer_indices(i, index: int) -> None:
    got = interop.layer_index(i, 4)
    assert got == index and type(got) is int


@pytest.mark.parametrize("i,named", [
    (4, "site index 4 is out of range; the model has layers 0..3"),
    (-1, "site index -1 is out of range; the model has layers 0..3"),
    (1.0, "site index 1.0 is not an integer; expected 0..3"),
    ("1", "site index '1' is not an integer; expected 0..3"),
])
def test_other_bad_layer_indices(i, named: str) -> None:
    with pytest.raises(InputError, match=re.escape(named)):
        interop.layer_index(i, 4)


def test_a_meta_tensor_is_refused_naming_its_device() -> None:
    """A meta tensor has no values: copying it out raised torch's own NotImplementedError."""
    x = torch.empty(2, 128, dtype=torch.bfloat16, device="meta")
    with pytest.raises(InputError) as e:
        interop.check_input(x, 128)
    assert str(e.value) == "input is a torch tensor on device 'meta'; expected a CPU or CUDA tensor"


def test_a_cpu_tensor_passes_the_check_and_crosses_to_the_backend() -> None:
    class Host:  # what to_backend asks of the NumPy backend
        name = "cpu"

        @staticmethod
        def asarray(a):
            return np.asarray(a)

    x = torch.arange(256, dtype=torch.float32).reshape(2, 128).to(torch.bfloat16)
    assert interop.check_input(x, 128) == "torch"
    got = interop.to_backend(x, "torch", Host())
    assert got.dtype == interop.BF16 and got.shape == (2, 128)
    assert np.array_equal(got.astype(np.float32), x.float().numpy())


def test_the_api_refuses_both_with_an_input_error(tiny_checkpoint) -> None:
    """The user's calls: ``mlp.site(True, x)`` and a meta tensor, through glm_ep.load on one rank."""
    import glm_ep
    from mpi4py import MPI

    mlp = glm_ep.load(tiny_checkpoint, comm=MPI.COMM_SELF)
    x = np.zeros((2, mlp.hidden_size), dtype=interop.BF16)
    with pytest.raises(InputError, match=re.escape("site index True is not an integer")):
        mlp.site(True, x)
    meta = torch.empty(2, mlp.hidden_size, dtype=torch.bfloat16, device="meta")
    with pytest.raises(InputError, match=re.escape("torch tensor on device 'meta'; expected a CPU or CUDA tensor")):
        mlp.site(0, meta)
    assert mlp.site(np.int64(0), x).shape == (2, mlp.hidden_size)
