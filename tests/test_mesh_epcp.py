"""The cp and ep mesh axes: world size, ep borrowing dp x cp ranks, plan JSON, old plans (#17)."""

from __future__ import annotations

import json

import pytest
from test_plan import make_plan

from meshplan.plan import MeshSpec, Plan


def test_cp_is_an_axis_ep_borrows_dp_cp():
    m = MeshSpec(("pp", "dp", "cp", "tp"), (2, 4, 2, 2), ep=8)
    assert m.world_size == 32  # ep does not multiply the world size
    assert (m.dp, m.cp, m.ep, m.tp, m.pp) == (4, 2, 8, 2, 2)
    assert m.degree("ep") == 8 and m.degree("cp") == 2
    assert MeshSpec(("dp", "tp"), (2, 2)).ep == 1


@pytest.mark.parametrize("ep", [3, 16, 0])
def test_ep_must_divide_dp_times_cp(ep):
    with pytest.raises(ValueError, match="divide dp x cp"):
        MeshSpec(("dp", "cp"), (4, 2), ep=ep)


def test_ep_may_span_tp_ranks_under_folding():
    # Megatron-Core's MoE parallel folding: ep | dp x cp x tp (costed; the runtime refuses it, epcp_rule)
    assert MeshSpec(("pp", "dp", "cp", "tp"), (2, 4, 2, 2), ep=16).ep == 16
    with pytest.raises(ValueError, match="dp x cp x tp = 16"):
        MeshSpec(("dp", "cp", "tp"), (4, 2, 2), ep=32)


def test_ep_is_not_an_axis_name():
    with pytest.raises(ValueError, match="not a mesh axis"):
        MeshSpec(("dp", "ep"), (2, 2))


def test_plan_round_trip_with_cp_ep_and_summary():
    p = make_plan(mesh=MeshSpec(("pp", "dp", "cp", "tp"), (2, 2, 2, 2), ep=4))
    q = Plan.from_json(p.to_json())
    assert q == p and q.cp == 2 and q.ep == 4
    assert "cp2 ep4" in p.summary()


def test_old_plan_without_ep_still_loads():
    d = json.loads(make_plan().to_json())
    d["mesh"].pop("ep")
    p = Plan.from_dict(d)
    assert p.ep == 1 and p.cp == 1 and "cp" not in p.summary()
