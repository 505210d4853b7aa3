"""Lab test (kernels_u): an absent row's x left uncopied leaks nothing. Copied into tests/cuda to run (its
conftest): cp .devrun/test_union_stale.py tests/cuda/test_lab_union_stale.py;
python .devrun/kdir.py kernels_u pytest -q tests/cuda/test_lab_union_stale.py"""
import numpy as np
import pytest
from glm_ep.mlp import routing
from _cuda import E, TOP_K, backend, both, dev, host, moe_weights, poisoned, requires_cuda
from helpers import BF16, rand_bf16
from test_cuda_union import check_moe_union

pytestmark = [pytest.mark.cuda, requires_cuda]


@pytest.mark.parametrize("max_warps", [3, 0])
def test_union_ring_stale_x_never_reaches_a_present_row(rng, max_warps):
    """A batch of NaN rows that all chose the same experts fills every x row of the ring's stages with NaN; the
    next batch (rows sharing few experts: most of an entry's rows absent) must still match NumPy exactly."""
    from glm_ep.backend.cuda import CudaBackend, RingConfig

    be = CudaBackend(0, RingConfig(union_max_rows=8, min_items_per_sm=0, max_warps=max_warps),
                     stream=backend().stream)
    h, m = 2048, 1024
    cu, nu = both(moe_weights(rng, h=h, m=m, start=0, count=E), be)
    same = np.tile(np.arange(TOP_K, dtype=np.int32) * 3, (8, 1))
    nan_x = dev(np.full((8, h), np.nan, BF16))
    nan_act = dev(np.full((8, TOP_K, m), np.nan, BF16))
    u_eid, u_slot = (dev(a) for a in routing.union_table(same))
    glu = [poisoned((8, TOP_K, m), BF16) for _ in range(3)]
    be.moe_gate_up_act_union(nan_x, cu, u_eid, u_slot, 1.0, *glu)
    be.moe_gemv_union(nan_act, cu.down, u_eid, u_slot, poisoned((8, TOP_K, h), BF16), True)
    assert np.isnan(host(glu[0]).astype(np.float32)).all()  # the NaN batch ran
    ids = np.stack([rng.choice(E, TOP_K, replace=False) for _ in range(8)]).astype(np.int32)
    check_moe_union(rng, cu, nu, ids, np.ones_like(ids, bool), h, m, "after a NaN batch", be)
