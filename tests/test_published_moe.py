"""The published expert-parallel (MoE) runs are costed as MoE models with their ep degree.

Each case whose ``expert_config.ep`` > 1 names its experts (``model.num_experts``, ``top_k``);
``models.published.case_model`` builds the zoo MoE Llama of that shape and
``planner.published_estimate.estimate_case`` costs it with the authors' ep. Traced here at 2
layers and a short sequence (the full shapes run in ``benchmarks/published_cases.py``).
"""

from __future__ import annotations

import copy

from meshplan.cost_models.published import load_published_cases
from meshplan.planner.published_estimate import case_setup

EP_CASES = [c for c in load_published_cases() if (c["expert_config"].get("ep") or 1) > 1]


def _small(case: dict) -> dict:
    c = copy.deepcopy(case)
    c["model"].update(layers=2, seq_len=128)
    return c


def test_ep_cases_name_their_experts_and_sources() -> None:
    assert len(EP_CASES) >= 1
    for c in EP_CASES:
        m, ex = c["model"], c["expert_config"]
        assert m["arch"] == "moe" and 1 <= m["top_k"] <= m["num_experts"], c["id"]
        assert c["source"] and c["notes"], c["id"]
        assert (ex["dp"] * (ex.get("cp") or 1)) % ex["ep"] == 0, c["id"]  # ep borrows dp x cp ranks
        assert case_setup(c)["ep"] == ex["ep"]


def test_ep_case_is_traced_as_a_moe_and_costed_with_its_ep() -> None:
    from meshplan.models.moe import MoELlama
    from meshplan.models.published import case_graph, case_model
    from meshplan.planner.published_estimate import estimate_case

    case = _small(EP_CASES[0])
    m = case["model"]
    model = case_model(case)
    assert isinstance(model, MoELlama)
    experts = model.blocks[0].moe.experts
    assert experts.num_experts == m["num_experts"] and model.blocks[0].moe.top_k == m["top_k"]
    g = case_graph(case)
    expert_params = 3 * m["hidden"] * m["ffn_hidden"]
    assert g.param_count > m["layers"] * m["num_experts"] * expert_params  # every expert's weights held
    r = estimate_case(case, g)
    plan = r["plan"]
    assert plan.ep == case["expert_config"]["ep"] and plan.predicted.ep_comm_s > 0
    assert f"ep{plan.ep}" in r["config"] and r["meas_tok"] > 0
