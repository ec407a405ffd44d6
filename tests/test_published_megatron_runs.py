"""The large Megatron-family runs of the published reference: Megatron-LM SC'21 Table 1 (Narayanan et
al. 2021: GPT 1.7B..1T on 32..3072 A100-80GB) and BigScience BLOOM-176B (Megatron-DeepSpeed, 384 A100).

The SC'21 rows carry the table's figures and the run script's configuration (``examples/sc21/
run_table_1.sh``: microbatch, DDP wrapper, full recompute, layers per virtual pipeline stage);
the step time is derived from the achieved TFLOP/s by the paper's eq. 3. Tested: the rows load
with their configuration, ``case_setup`` gives it to ``estimate_graph`` (interleaving, Megatron's
own DDP, the even layer split, the scatter/gather of stage sends), and one row traced at 12 small
layers is costed with exactly that configuration (the full shapes run in
``benchmarks/published_cases.py --only megsc21``); BLOOM's logged step time agrees with its logged
TFLOP/s under eq. 3 and its cluster's Omni-Path bandwidth reaches the ClusterSpec.
"""

from __future__ import annotations

import copy

import pytest

from meshplan.commands.published_estimate import case_cluster, case_setup
from meshplan.cost_models import formulas as F
from meshplan.cost_models.engine_profiles import MESHPLAN
from meshplan.cost_models.hardware import ClusterSpec
from meshplan.cost_models.published import load_published_cases

SC21 = [c for c in load_published_cases() if c["id"].startswith("megsc21-")]


def test_the_ten_table_1_rows_load_with_their_configuration() -> None:
    assert [c["model"]["params_b"] for c in SC21] == [1.7, 3.6, 7.5, 18.4, 39.1, 76.1, 145.6, 310.1, 529.6, 1008.0]
    for c in SC21:
        m, ex, tr = c["model"], c["expert_config"], c["training"]
        assert ex["tp"] * ex["pp"] * ex["dp"] == c["cluster"]["n_gpus"], c["id"]
        assert tr["global_batch"] % (ex["dp"] * tr["micro_batch"]) == 0, c["id"]
        assert m["seq_len"] == 2048 and m["vocab"] == 51200 and m["ffn_hidden"] == 4 * m["hidden"]
        # eq. 2 gives the table's parameter count from the shape (the table prints one decimal)
        assert F.gpt_param_count(m["layers"], m["hidden"], m["vocab"], m["seq_len"]) / 1e9 == pytest.approx(
            m["params_b"], rel=0.01, abs=0.05
        )
        # the step time is the table's TFLOP/s through eq. 3, to the precision it is stored at
        flops = F.megatron_flops_per_iteration(tr["global_batch"], m["seq_len"], m["layers"], m["hidden"], m["vocab"])
        step = flops / (c["measured"]["tflops_per_gpu"] * 1e12 * c["cluster"]["n_gpus"])
        assert c["measured"]["step_time_s"] == pytest.approx(step, abs=1e-3)
        assert "run_table_1.sh" in c["source"] and "Assumed" in c["notes"]


def test_case_setup_gives_the_script_configuration() -> None:
    by = {c["id"]: c for c in SC21}
    small = case_setup(by["megsc21-1.7b-a100-32gpu"])
    assert (small["tp"], small["pp"], small["dp"], small["micro_batch_size"]) == (1, 1, 32, 16)
    assert small["profile"].ddp_impl == "torch" and small["recompute"] == "full" and small["dtype"] == "fp16"
    inter = case_setup(by["megsc21-530b-a100-2520gpu"])
    assert (inter["tp"], inter["pp"], inter["dp"], inter["micro_batch_size"]) == (8, 35, 9, 1)
    assert inter["schedule"] == "interleaved-1f1b" and inter["virtual_stages"] == 3
    prof = inter["profile"]
    assert prof.ddp_impl == "local" and prof.split_rule == "even" and inter["dp_kind"] == "ddp"
    assert prof.pp_scatter_gather is True and prof.name == "megatron-lm-2021"
    from meshplan.commands.published_estimate import same_mechanisms

    assert same_mechanisms(by["megsc21-530b-a100-2520gpu"]) == {
        "recompute": ("full", "none"), "dp_kinds": ("ddp",), "schedules": ("1f1b", "interleaved-1f1b"),
        "split_rule": "even", "fixed": {"sequence_parallel": False, "cp": 1}}
    # 39B and 1T: the paper's interleaved schedule (the script gives them no virtual-stage flag); 1T's two
    # layers per rank admit only two chunks of one layer
    one_t = case_setup(by["megsc21-1t-a100-3072gpu"])
    assert one_t["schedule"] == "interleaved-1f1b" and one_t["virtual_stages"] == 2 and one_t["pp"] == 64
    spec = case_cluster(by["megsc21-1t-a100-3072gpu"])
    assert spec.num_devices == 3072 and spec.mem_bytes == ClusterSpec.preset("a100-80g").mem_bytes


def test_an_interleaved_row_is_costed_with_its_configuration() -> None:
    from meshplan.commands.published_estimate import estimate_case
    from meshplan.loading import case_graph

    case = copy.deepcopy(next(c for c in SC21 if c["id"] == "megsc21-76b-a100-1024gpu"))
    # 4 ranks x 3 chunks of 1 layer: the row's pp4 interleaving at 12 layers, a short sequence
    case["model"].update(layers=12, seq_len=256, hidden=1024, heads=8, ffn_hidden=4096)
    r = estimate_case(case, case_graph(case))
    plan = r["plan"]
    assert (plan.tp, plan.pp, plan.dp, plan.micro_batch_size) == (8, 4, 32, 2)
    assert plan.schedule == "interleaved-1f1b" and plan.recompute == "full" and plan.dtype == "fp16"
    assert r["fits"] and r["meas_tok"] > 0 and r["pred_tok"] > 0
    assert plan.predicted.bubble_s > 0 and plan.predicted.dp_comm_s > 0  # local DDP: exposed after backward


def test_torch_ddp_of_megatron_2021_reduces_the_fp16_gradients() -> None:
    """--DDP-impl torch wraps Megatron's Float16Module (the model's parameters in fp16), so its buckets hold
    fp16 gradients: the profile's grad_reduce "param" moves half the bytes an fp32 reduce would."""
    from meshplan.commands.published_estimate import case_profile, estimate_case
    from meshplan.loading import case_graph

    case = copy.deepcopy(next(c for c in SC21 if c["id"] == "megsc21-1.7b-a100-32gpu"))
    case["model"].update(layers=2, seq_len=256, hidden=256, heads=4, ffn_hidden=1024)
    prof = case_profile(case)
    assert prof.ddp_impl == "torch" and prof.grad_reduce == "param"
    g = case_graph(case)
    half = estimate_case(case, g)["plan"].predicted.comm_bytes["all_reduce"]
    full = estimate_case(case, g, profile=prof.but(grad_reduce="fp32"))["plan"].predicted.comm_bytes["all_reduce"]
    assert half == pytest.approx(full / 2, rel=1e-6)


def test_megatron_scatter_gather_sends_a_tp_slice_and_gathers_it_in_the_node() -> None:
    """``estimate_graph(pp_scatter_gather=True)``: without SP each tp rank sends 1/tp of the stage's
    boundary activation over the link and the receiving tp group all-gathers it over NVLink
    (SC'21 §4.1); under SP the activation is already 1/tp per rank and nothing changes."""
    from planner_fixtures import gpt_graph

    from meshplan.cost_models.comm import collective_time_s, p2p_time_s
    from meshplan.cost_models.hardware import ClusterSpec
    from meshplan.planner.api import estimate_graph

    g = gpt_graph(layers=4, h=2048, heads=16, seq=2048)
    spec = ClusterSpec.preset("a100-80g", num_nodes=2, devices_per_node=2)  # pipeline ranks on two nodes
    kw = dict(tp=2, pp=2, dp=1, global_batch_size=8, micro_batch_size=1, cluster=spec, dtype="fp16")
    whole = estimate_graph(g, 4, sequence_parallel=False, **kw)
    split = estimate_graph(g, 4, sequence_parallel=False, profile=MESHPLAN.but(pp_scatter_gather=True), **kw)
    sb = whole.stages[0].send_bytes
    assert sb > 0 and split.stages[0].send_bytes == sb
    assert whole.stages[0].send_s == pytest.approx(p2p_time_s(sb, spec, crosses_nodes=True))
    want = p2p_time_s(sb / 2, spec, crosses_nodes=True) + collective_time_s("all_gather", sb, 2, spec, ranks_per_node=2)
    assert split.stages[0].send_s == pytest.approx(want) and want < whole.stages[0].send_s
    assert split.predicted.compute_s == whole.predicted.compute_s
    sp = [estimate_graph(g, 4, sequence_parallel=True, profile=MESHPLAN.but(pp_scatter_gather=f), **kw).stages[0].send_s for f in (False, True)]
    assert sp[0] == sp[1]


def test_bloom_row_carries_its_log_line_and_its_cluster() -> None:
    from meshplan.cost_models.hardware import ClusterSpec

    c = next(c for c in load_published_cases() if c["id"] == "bloom-176b-a100-384gpu")
    m, tr = c["model"], c["training"]
    flops = F.megatron_flops_per_iteration(tr["global_batch"], m["seq_len"], m["layers"], m["hidden"], m["vocab"])
    assert flops / (c["measured"]["step_time_s"] * c["cluster"]["n_gpus"]) / 1e12 == pytest.approx(149.77, abs=0.05)
    setup = case_setup(c)
    assert (setup["tp"], setup["pp"], setup["dp"], setup["micro_batch_size"]) == (4, 12, 8, 2)
    assert setup["dp_kind"] == "zero1" and setup["recompute"] == "full" and setup["dtype"] == "bf16"
    assert setup["profile"].split_rule == "fewer_first_last" and not setup["profile"].pp_scatter_gather
    spec = case_cluster(c)
    assert spec.inter_bw_bytes_per_s == pytest.approx(6.25e9)  # 4 x 100 Gb/s Omni-Path per 8-GPU node
    assert ClusterSpec.preset("a100-80g").inter_bw_bytes_per_s > spec.inter_bw_bytes_per_s


def test_table_2_rows_pair_zero3_with_ptdp_and_agree_with_the_days_column() -> None:
    """SC'21 Table 2: the same models and batches under ZeRO-3 without model parallelism (costed as
    fsdp over every GPU) and under PTD-P (tp 8 inside the node, pp across); each row's step time
    reproduces the table's 'days for 300B tokens' column within its rounding."""
    t2 = [c for c in load_published_cases() if c["id"].startswith("megsc21t2-")]
    assert len(t2) == 12
    for c in t2:
        m, tr, ex = c["model"], c["training"], c["expert_config"]
        setup = case_setup(c)
        if "zero3" in c["id"]:
            assert (setup["tp"], setup["pp"], setup["dp"]) == (1, 1, c["cluster"]["n_gpus"]) and setup["dp_kind"] == "fsdp"
        else:
            assert (setup["tp"], setup["pp"]) in ((8, 12), (8, 35)) and setup["micro_batch_size"] == 1
            p = setup["profile"]
            assert p.ddp_impl == "local" and p.pp_scatter_gather and p.split_rule == "even"
        days = 300e9 / (tr["global_batch"] * m["seq_len"]) * c["measured"]["step_time_s"] / 86400
        want = float(c["measured"]["other"]["check"].split(": ")[1].split(" days")[0])
        assert days == pytest.approx(want, abs=1.0), c["id"]
        assert ex["dp"] * ex["tp"] * ex["pp"] == c["cluster"]["n_gpus"]


def test_korthikanti_rows_agree_with_the_readme_mfu_and_the_table_5_increase() -> None:
    # Korthikanti et al. 2022 Table 5 (rows korth22-*): the 'present work' time and configuration give the MFU
    # Megatron-LM's README prints at 841f789f (41.5 / 51.4 / 56.0 / 56.3 %); the 'full recompute' time over it
    # gives Table 5's throughput increase
    rows = {c["id"]: c for c in load_published_cases() if c["id"].startswith("korth22-")}
    assert len(rows) == 8
    for rid, c in rows.items():
        m, tr, ex = c["model"], c["training"], c["expert_config"]
        assert ex["tp"] * ex["pp"] * ex["dp"] == c["cluster"]["n_gpus"] and ex["dp"] == 1
        assert ex["sequence_parallel"] == rid.endswith("sp-selective")
        mfu = 100 * F.model_flops_per_iteration(tr["global_batch"], m["seq_len"], m["layers"], m["hidden"], m["vocab"]) / (
            c["measured"]["step_time_s"] * c["cluster"]["n_gpus"] * 312e12)
        if rid.endswith("sp-selective"):
            assert mfu == pytest.approx(c["measured"]["mfu_pct"], abs=0.25), rid
            full = rows[rid.replace("sp-selective", "full")]["measured"]["step_time_s"]
            increase = c["measured"]["other"]["throughput_increase_pct_present_over_full"]
            assert 100 * (full / c["measured"]["step_time_s"] - 1) == pytest.approx(increase, abs=0.15), rid


def test_the_pipelined_h100_rows_that_ran_are_predicted_to_fit() -> None:
    # the Megatron-LM README's H100 table (f2e5db4), 462B at TP 8, PP 16, 64 microbatches per pipeline: it ran, so
    # under its own engine's conventions and under meshplan's 16-bit-weight layout it must be predicted to fit
    from meshplan.commands.published_estimate import estimate_case
    from meshplan.loading import case_graph

    c = next(c for c in load_published_cases() if c["id"].startswith("mcore08-gpt-462b"))
    assert not c["measured"]["other"]["time_comparable"]  # microbatch and interleaving unpublished
    g = case_graph(c)
    for prof in (None, "meshplan-bf16"):
        r = estimate_case(c, g, profile=prof)
        assert r["fits"], (prof, r["peak_gib"])
