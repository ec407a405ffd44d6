"""Op-level selective recompute (``Plan.recompute = "op"``): what the runtime re-runs and what the
cost model keeps agree (every other matmul of a block and its attention saved, the rest re-run)."""

from __future__ import annotations

import pytest
import runtime_cases as rc
import torch

from meshplan.errors import PlanMismatchError
from meshplan.plan.execution_rules import recompute_blocker
from meshplan.runtime.apply import recompute

MM = ("aten.mm.default", "aten.addmm.default")


def _backward_ops(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[str]:
    model.zero_grad(set_to_none=True)
    loss = rc.loss_fn(model(x), y)
    with rc.OpLog() as c:
        loss.backward()
    return c.ops


@pytest.mark.parametrize("build", [rc.tiny_llama, rc.tiny_gpt])
def test_op_recompute_reruns_every_second_matmul_and_keeps_gradients(build) -> None:
    x, y = rc.batches(1)[0]
    plain, wrapped = build(), build()
    mods, note = recompute.apply_recompute([wrapped], "op", pipelined=False, schedule="1f1b")
    assert mods[0] is wrapped and "op-level" in note
    blocks = [m for m in plain.modules() if isinstance(m, torch.nn.ModuleList)][0]
    linears = sum(isinstance(m, torch.nn.Linear) for m in blocks[0].modules())
    ops_plain = _backward_ops(plain, x, y)
    ops_op = _backward_ops(wrapped, x, y)
    rerun = sum(o in MM for o in ops_op) - sum(o in MM for o in ops_plain)
    # matmuls 2, 4, 6 ... of each block's forward are re-run in backward, 1, 3, 5 ... saved; the
    # block's last matmul never (torch stops re-running once every needed tensor is back)
    assert rerun == len(blocks) * len(range(2, linears, 2))
    assert not [o for o in ops_op if "scaled_dot_product" in o and "backward" not in o]  # attention saved
    assert any("rms_norm" in o or "layer_norm" in o or "mean" in o for o in ops_op)  # norms re-run
    for (n, p), (n2, q) in zip(plain.named_parameters(), wrapped.named_parameters()):
        assert recompute.clean_fqn(n2) == n
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)


def test_op_recompute_in_stage_graphs_reruns_what_it_does_at_pp1() -> None:
    """At pp > 1 each block of a stage graph is one selective region (block_checkpoint.py): the same
    matmuls re-run as at pp = 1 and the same gradients (the 2-rank pipeline cases: test_runtime_numerics)."""
    from meshplan.runtime.apply import split

    for build in (rc.tiny_llama, rc.tiny_gpt):
        x, y = rc.batches(1)[0]
        plain = build()
        gm = split.capture(build(), (x,)).gm
        gm.load_state_dict(plain.state_dict(), strict=False)
        for (n, p), q in zip(plain.named_parameters(), gm.parameters()):
            assert torch.equal(p, q), n
        mods, note = recompute.apply_recompute([gm], "op", pipelined=True, schedule="1f1b")
        assert "op-level" in note
        ops_plain = _backward_ops(plain, x, y)
        ops_op = _backward_ops(gm, x, y)
        blocks = [m for m in plain.modules() if isinstance(m, torch.nn.ModuleList)][0]
        linears = sum(isinstance(m, torch.nn.Linear) for m in blocks[0].modules())
        assert sum(o in MM for o in ops_op) - sum(o in MM for o in ops_plain) == len(blocks) * len(range(2, linears, 2))
        assert not [o for o in ops_op if "scaled_dot_product" in o and "backward" not in o]
        for p, q in zip(plain.parameters(), gm.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)


def test_op_recompute_refused_under_split_backward_and_without_blocks() -> None:
    assert "hands each saved op output out once" in recompute_blocker(pp=2, schedule="zero-bubble", recompute="op")
    assert recompute_blocker(pp=2, schedule="1f1b", recompute="op") == ""
    assert recompute_blocker(pp=1, schedule="1f1b", recompute="op") == ""
    with pytest.raises(PlanMismatchError, match="zbv"):
        recompute.apply_recompute([rc.tiny_gpt()], "op", pipelined=True, schedule="zbv")
    with pytest.raises(PlanMismatchError, match="nn.ModuleList"):
        recompute.apply_recompute([torch.nn.Linear(2, 2)], "op", pipelined=False, schedule="1f1b")
