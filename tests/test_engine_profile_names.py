"""A run naming an engine version the repo has no profile for is costed with its family's profile
(``cost_models.engine_profiles.resolve``), said in one line; a case's own engine conventions from
older formats are ignored, not fatal (``commands.published_estimate.case_notes``); Megatron's
distributed optimizer shards over dp x cp (``EngineProfile.shard_over_cp``)."""

from __future__ import annotations

import copy
import logging

import pytest

from meshplan.commands.published_estimate import case_notes, case_profile, case_setup
from meshplan.cost_models.engine_profiles import FAMILIES, LINEAGES, PROFILES, profile, resolve
from meshplan.cost_models.published import load_published_cases

CASES = {c["id"]: c for c in load_published_cases()}


def test_a_profile_name_is_itself_and_says_nothing() -> None:
    for name, p in PROFILES.items():
        assert resolve(name) == (p, "")
    assert {n for lineage in LINEAGES.values() for n, _ in lineage} <= set(PROFILES)


@pytest.mark.parametrize(("named", "used", "how"), [
    ("megatron-lm-2022.03", "megatron-lm-2021", "latest not newer"),  # before sequence parallelism (2022-05)
    ("megatron-lm-2022.09", "megatron-lm-2022", "latest not newer"),
    ("megatron-lm-2023.09", "megatron-lm-2023", "latest not newer"),
    ("megatron-lm-2024.03+flash", "megatron-core-2023.12+flash", "latest not newer"),  # --use-flash-attn runs
    ("megatron-lm-2023.09+flash", "megatron-lm-2023+flash", "latest not newer"),
    # from core_v0.6.0 Transformer Engine's attention is the default: --use-flash-attn selects nothing more
    ("megatron-lm-2024.06+flash", "megatron-core-2024.04", "transformer_engine"),
    ("megatron-lm-2024+flash", "megatron-core-2024", "transformer_engine"),  # a year covers its months
    ("megatron-core+flash", "megatron-core-2026", "the newest"),
    ("megatron-lm-2024", "megatron-core-2024", "latest not newer"),  # one lineage with Megatron-Core
    ("megatron-core-2025", "megatron-core-2024", "latest not newer"),
    ("megatron-core-2027", "megatron-core-2026", "latest not newer"),
    ("megatron-lm-2019", "megatron-lm-2020", "the earliest"),  # older than every profile
    ("megatron-lm-2023+zero3", "megatron-lm-2021+zero3", "latest not newer"),  # a variant keeps its variant
    ("torchtitan-2025.09", "torchtitan-2025.06", "latest not newer"),
    ("torchtitan-2025.03", "torchtitan-2024.12", "latest not newer"),
    ("torchtitan-2024.06", "torchtitan-2024.04", "latest not newer"),
    ("torchtitan-2024", "torchtitan-2024.12", "latest not newer"),  # a year covers its months
    ("torchtitan-2024.02", "torchtitan-2024.04", "the earliest"),
    ("deepspeed-2023", "deepspeed-2026", "the earliest"),
    ("megatron-lm-2024.03", "megatron-core-2023.12", "latest not newer"),  # core_v0.4.0-0.5.0: Megatron-Core DDP, cp
    ("megatron-lm-2024.07", "megatron-core-2024.04", "latest not newer"),  # core_v0.6.0-0.7.0: TE layers by default
    ("megatron-lm-2023.11", "megatron-lm-2023", "latest not newer"),  # before core_v0.4.0 (2023-12)
    ("nemo-2025.06", "nemo-2024", "NeMo's recipes"),  # NeMo 2.0's own recipes until the 25.11 containers
    ("nemo-24.09", "nemo-2024", "NeMo's recipes"),  # a container's YY.MM
    ("nemo-25.11", "megatron-bridge-2025", "NeMo's recipes"),  # Megatron-Bridge from 25.11
    ("nemo-2023", "nemo-2024", "the earliest"),
    ("megatron-bridge-2026", "megatron-bridge-2025", "latest not newer"),
    ("megatron-lm", "megatron-core-2026", "the newest"),  # no version: the newest of the family
    ("torchtitan", "torchtitan-2026", "the newest"),
    ("nemo", "megatron-bridge-2025", "the newest"),
    ("Megatron-LM 2022", "megatron-lm-2022", "latest not newer"),  # as a paper spells it
    ("NeMo_24.07", "nemo-2024", "NeMo's recipes"),
])  # fmt: skip
def test_an_engine_version_without_a_profile_takes_its_family_s_latest_not_newer(named: str, used: str,
                                                                                 how: str) -> None:
    p, note = resolve(named)
    assert p.name == used
    assert repr(named) in note and repr(used) in note and how in note and "\n" not in note


def test_a_profile_added_later_joins_its_family(monkeypatch: pytest.MonkeyPatch) -> None:
    later = PROFILES["torchtitan-2024.12"].but(name="torchtitan-2025.10")
    monkeypatch.setitem(PROFILES, "torchtitan-2025.10", later)
    assert resolve("torchtitan-2025.11")[0] is later
    assert resolve("torchtitan-2025.09")[0].name == "torchtitan-2025.06"


def test_profile_logs_the_resolution_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="meshplan.engine_profiles"):
        assert profile("megatron-core-2031").name == "megatron-core-2026"
        profile("megatron-core-2031")
    said = [r.getMessage() for r in caplog.records if "megatron-core-2031" in r.getMessage()]
    assert len(said) == 1 and "'megatron-core-2026'" in said[0]


@pytest.mark.parametrize("bad", ["titan", "foo-2024", "torchtitan-abc", "megatron-lm-2021+zero4"])
def test_an_unknown_family_or_variant_is_a_one_line_error_listing_the_families(bad: str) -> None:
    with pytest.raises(ValueError) as e:
        resolve(bad)
    msg = str(e.value)
    assert "\n" not in msg and repr(bad) in msg
    if "+" not in bad:
        assert msg.startswith("unknown engine profile") and all(f in msg for f in FAMILIES)


def _older_format(case: dict, engine: str) -> dict:
    """``case`` as an older case format wrote it: its engine by family and version, and engine
    conventions set per case (the profile's own value and another), a run flag restating its default."""
    c = copy.deepcopy(case)
    c["engine"] = engine
    c["expert_config"].update(pp_buffers="torch", state_layout="megatron", pp_scatter_gather=True, fsdp=False,
                              ddp_impl="torch")  # fmt: skip
    c["training"].update(sp_saves="gathered", loss_kernel="fused", attention_impl="unfused", grad_accum=4)
    return c


def test_case_setup_ignores_the_conventions_an_older_case_sets_and_says_so() -> None:
    base = CASES["mcore-mixtral-8x7b-h100-64gpu-ep8-pp4"]  # megatron-core-2024
    old = _older_format(base, "megatron-core-2025")
    new_setup, old_setup = case_setup(base), case_setup(old)
    assert old_setup == new_setup  # the profile's conventions, the same run flags (ddp_impl torch: the row's own)
    assert case_profile(old) == PROFILES["megatron-core-2024"].with_run_flags(ddp_impl="torch") == case_profile(base)
    notes = case_notes(old)
    assert "'megatron-core-2024'" in notes[0]
    ignored = {n.split(" = ")[0] for n in notes[1:]}
    # only those differing from the profile's are said (megatron-core-2024: pp_buffers 'megatron',
    # sp_saves 'shard', attention 'flash'); its own state layout and loss kernel are silent
    assert ignored == {"expert_config.pp_buffers", "training.sp_saves", "training.attention_impl",
                       "expert_config.pp_scatter_gather"}  # fmt: skip
    assert case_notes(base) == []


@pytest.mark.parametrize(("fsdp", "kind"), [("FULL_SHARD (ZeRO-3)", "fsdp"), (True, "fsdp"), ("SHARD_GRAD_OP", "zero2"),
                                            ("HYBRID_SHARD", "hsdp"), ("NO_SHARD", "ddp")])  # fmt: skip
def test_an_older_case_s_fsdp_field_is_its_dp_kind(fsdp: object, kind: str) -> None:
    old = copy.deepcopy(CASES["mpt-7b-h100-8gpu-seq2048"])  # the rows that once gave only "fsdp"
    del old["expert_config"]["dp_kind"]
    old["expert_config"]["fsdp"] = fsdp
    assert case_setup(old)["dp_kind"] == kind
    assert any(n.startswith("expert_config.fsdp") and repr(kind) in n for n in case_notes(old))
    del old["expert_config"]["fsdp"]
    assert case_setup(old)["dp_kind"] == "ddp" and case_notes(old) == []


def test_a_run_flag_an_older_case_sets_is_used() -> None:
    old = _older_format(CASES["megsc21-1.7b-a100-32gpu"], "megatron-lm-2022.03")
    assert case_profile(old).ddp_impl == "torch" != PROFILES["megatron-lm-2021"].ddp_impl
    assert case_setup(old)["profile"].name == "megatron-lm-2021"


def test_megatron_s_distributed_optimizer_shards_over_dp_and_cp() -> None:
    from meshplan.loading import load_graph
    from meshplan.planner.api import estimate_graph

    for name in ("megatron-core-2024", "megatron-core-2026", "megatron-bridge-2025"):
        assert PROFILES[name].shard_over_cp and "shard_over_cp" in dict(PROFILES[name].sources)
    for name in ("megatron-lm-2020", "megatron-lm-2021", "megatron-deepspeed-2022"):  # no CP in these versions
        assert not PROFILES[name].shard_over_cp
    g, p = load_graph("gpt-tiny"), PROFILES["megatron-core-2026"]
    kw = {"tp": 1, "pp": 1, "dp": 2, "cp": 2, "micro_batch_size": 2, "global_batch_size": 8, "cluster": "h100"}
    for kind, share in (("zero1", 0.5), ("ddp", 1.0)):  # the distributed optimizer's states over 4 ranks, not 2
        over, apart = (estimate_graph(g, 4, profile=q, dp_kind=kind, **kw).predicted.mem_breakdown
                       for q in (p, p.but(shard_over_cp=False)))  # fmt: skip
        assert over["optimizer"] == pytest.approx(share * apart["optimizer"])
        assert over["grads"] == apart["grads"] and over["params"] == apart["params"]


def test_megatron_core_0_4_to_0_7_profiles_differ_from_23_06_only_where_their_source_does() -> None:
    # core_v0.4.0-0.5.0: Megatron-Core DDP and cp over the legacy local layers (23.06's kernels);
    # core_v0.6.0-0.7.0: Transformer Engine layers by default (fused attention, cuDNN on Hopper)
    from meshplan.loading import load_graph
    from meshplan.planner.api import estimate_graph

    g = load_graph("gpt-tiny")
    kw = {"tp": 1, "pp": 1, "dp": 2, "micro_batch_size": 2, "global_batch_size": 8, "cluster": "h100"}

    def run(name: str, **extra: object):
        return estimate_graph(g, 2 * int(extra.get("cp", 1)), profile=name, dp_kind="zero1", **kw, **extra).predicted

    lm23, c4 = run("megatron-lm-2023"), run("megatron-core-2023.12")
    assert (c4.step_s, c4.peak_mem_bytes) == (lm23.step_s, lm23.peak_mem_bytes)  # no cp: the same engine
    assert run("megatron-core-2023.12", cp=2).mem_breakdown["optimizer"] < run("megatron-lm-2023", cp=2).mem_breakdown["optimizer"]
    c6 = run("megatron-core-2024.04")
    assert max(c6.peak_mem_bytes) < max(lm23.peak_mem_bytes)  # TE's fused attention saves no scores
    for name in ("megatron-core-2023.12", "megatron-core-2023.12+flash", "megatron-core-2024.04"):
        p = PROFILES[name]
        assert p.shard_over_cp and p.dp_kinds == ("none", "ddp", "zero1") and p.ddp_impl == "local"
        assert any(tag in dict(p.sources)["ddp_impl"] for tag in ("--overlap-grad-reduce",))


def test_published_not_fit_switches_each_engine_convention_alone_on_meshplan_s_profile() -> None:
    # benchmarks/published_not_fit.py: one mechanism at a time, 16-bit weights as one (layout, gradient
    # dtype and autocast's cache together: a 16-bit gradient on fp32 parameters is refused)
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "published_not_fit.py"
    spec = importlib.util.spec_from_file_location("published_not_fit", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    base = profile("meshplan")
    for name in ("nemo-2024", "megatron-bridge-2025", "megatron-core-2024", "torchtitan-2024.12"):
        own = PROFILES[name]
        found = mod.mechanisms(base, own)
        names = [n for n, _ in found]
        assert "dp_kinds" not in names and len(names) == len(set(names))
        for _, changes in found:
            base.but(**changes)  # each switch alone is a profile that costs
        moved = {f for _, ch in found for f in ch}
        assert moved == {f for f in moved if getattr(own, f) != getattr(base, f)}
    assert "state_layout+main_grads+autocast_cache" in [n for n, _ in mod.mechanisms(base, PROFILES["nemo-2024"])]
