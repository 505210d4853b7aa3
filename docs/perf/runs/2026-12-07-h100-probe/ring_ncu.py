"""Lab: the decode ring's gate + up and down + combine launches, 10 each over distinct layers (for ncu)."""
import sys
import numpy as np


def main() -> int:
    import cupy as cp
    from glm_ep.bench.common import BF16, glm_model, gpu_bf16, gpu_dense, gpu_nvfp4
    from glm_ep.bench.sweep_ring import E_LOCAL, _bench_backend
    from glm_ep.checkpoint.weights import ExpertWeights, MoeWeights
    model = glm_model()
    h, m, k, limit = model.hidden_size, model.moe_intermediate_size, model.num_experts_per_tok, model.swiglu_limit
    be = _bench_backend()
    s = be.stream
    L = 6
    with s:
        layers = [MoeWeights(gpu_bf16(cp, (E_LOCAL, h), h ** -0.5), cp.zeros(E_LOCAL, cp.float32), 0,
                             tuple(ExpertWeights(gpu_nvfp4(cp, m, h), gpu_nvfp4(cp, m, h), gpu_nvfp4(cp, h, m))
                                   for _ in range(E_LOCAL)),
                             gpu_dense(cp, model.shared_intermediate, h)) for _ in range(L)]
        sites = [be.upload_moe(w, limit) for w in layers]
        x = gpu_bf16(cp, (1, h), 1.0)
        ids = cp.asarray(np.random.default_rng(0).choice(E_LOCAL, k, replace=False).astype(np.int32))
        gate, up, act = (cp.zeros((k, m), BF16) for _ in range(3))
        act[:] = gpu_bf16(cp, (k, m), 0.5)
        routed, out = cp.zeros((k, h), BF16), cp.empty((1, h), BF16)
        wts = cp.full((1, k), 0.125, cp.float32)
        sh_act = gpu_bf16(cp, (1, model.shared_intermediate), 0.5)
        for i in range(10):
            be.moe_gate_up_act(x, sites[i % L].experts, ids, limit, gate, up, act)
        for i in range(10):
            be.moe_down_shared_combine(act, sites[i % L].experts.down, ids, routed, sh_act, sites[i % L].shared.down,
                                       wts, out, out)
        s.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
