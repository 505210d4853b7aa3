"""The roofline ``glm-ep bench --prefill`` sets each width against (no GPU): the bytes of the union of experts a
call's routing chose, the FLOPs, the bound, and the table rendered from them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from glm_ep.bench.common import expert_bytes, glm_model, sparse_bytes, sparse_flops, sparse_roofline
from glm_ep.bench.prefill import render

RECORDED = Path(__file__).resolve().parents[2] / "docs" / "perf" / "prefill_h200.json"


def test_bytes_count_each_chosen_expert_once():
    model = glm_model()
    ids = np.array([[0, 1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1, 0], [0, 1, 2, 3, 4, 5, 6, 100]])
    roof = sparse_roofline(model, ids, copy_gbs=1000.0, bf16_tflops=None)
    h = model.hidden_size
    assert roof.experts == 9
    assert roof.bytes_read == sparse_bytes(model, 9) + 2 * 3 * h * 2
    assert sparse_bytes(model, 9) - sparse_bytes(model, 8) == expert_bytes(model)
    assert roof.byte_floor_us == roof.bytes_read / 1e12 * 1e6 and roof.flop_floor_us is None
    assert roof.bound == "bytes" and roof.floor_us == roof.byte_floor_us


def test_flops_and_the_bound_switch_with_width():
    model = glm_model()
    h, m, k, e, s = (model.hidden_size, model.moe_intermediate_size, model.num_experts_per_tok,
                     model.n_routed_experts, model.shared_intermediate)
    assert sparse_flops(model, 1) == 2 * h * (e + 3 * k * m + 3 * s)
    assert sparse_flops(model, 64) == 64 * sparse_flops(model, 1)
    rng = np.random.default_rng(0)
    one = sparse_roofline(model, rng.permutation(e)[:k][None], copy_gbs=3000.0, bf16_tflops=700.0)
    wide = sparse_roofline(model, np.stack([rng.permutation(e)[:k] for _ in range(4096)]), 3000.0, 700.0)
    assert one.bound == "bytes" and one.flop_floor_us < one.byte_floor_us
    assert wide.experts == e and wide.bound == "FLOPs" and wide.floor_us == wide.flop_floor_us
    assert wide.pct(2 * wide.floor_us) == 50.0 and wide.pct(None) is None


def test_render_leads_with_the_roofline():
    data = json.loads(RECORDED.read_text())
    model = glm_model()
    meta = {**data["meta"], "gemm_tflops": 700.0}
    for i, r in enumerate(data["widths"]):
        ids = np.arange(r["rows"] * model.num_experts_per_tok).reshape(r["rows"], -1) % model.n_routed_experts
        roof = sparse_roofline(model, ids, meta["copy_gbs"], 700.0)
        r.update(roof_experts=roof.experts, roof_bytes=roof.bytes_read, roof_flops=roof.flops,
                 byte_floor_us=roof.byte_floor_us, flop_floor_us=roof.flop_floor_us, roof_floor_us=roof.floor_us,
                 roof_bound=roof.bound, hf_moe_us=r.get("hf_moe_us"))
    text = render(meta, data)
    assert text.index("against its roofline") < text.index("## Sparse site (router")
    for r in data["widths"]:
        pct = f"{100 * r['roof_floor_us'] / r['sparse_us']:.0f}%"
        assert f"| {r['roof_bound']} | {r['sparse_us']:.1f} | {pct} |" in text
    # a run recorded before the roofline renders without the section
    for r in data["widths"]:
        del r["roof_floor_us"]
    assert "against its roofline" not in render(meta, data)
