"""``meshplan profile --nproc 1`` and ``--cluster local``: one device measured, the links derived and
marked so, the profile cached by host / torch version / device, N devices made from it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshplan.cost_models.hardware import ClusterSpec
from meshplan.profile import local
from meshplan.profile.provenance import FIGURES, missing_provenance, provenance_lines

MODEL = """
from meshplan.models.gpt import GPT, GPTConfig

def f():
    return GPT(GPTConfig(n_layer=4, n_head=4, n_embd=32, vocab_size=128, block_size=16))
"""

KEY = {"host": "laptop", "torch": "2.13.0", "device": "cpu:x86_64:2 threads"}


def fake_single(device_type: str = "cpu", device: str = "x86_64") -> ClusterSpec:
    """A one-device profile as ``profile_machine(nproc=1)`` writes it (figures made up)."""
    prov = {f: "measured: test" for f in FIGURES}
    prov.update({f"peak_flops.{dt}": "measured: test" for dt in ("fp32", "bf16")})
    prov.update({f: "derived: one device, no collective; a TCP loopback ping-pong, 4096-4194304 B"
                 for f in ("intra_bw_bytes_per_s", "intra_latency_s", "inter_bw_bytes_per_s", "inter_latency_s")})
    return ClusterSpec(
        name="local", num_devices=1, devices_per_node=1, peak_flops={"fp32": 8e10, "bf16": 4e10}, mem_bytes=16 << 30,
        mem_bw_bytes_per_s=2e10, intra_bw_bytes_per_s=2e9, intra_latency_s=2e-5, inter_bw_bytes_per_s=2e9,
        inter_latency_s=2e-5, matmul_efficiency=1.0, mem_efficiency=1.0, comm_efficiency=1.0, provenance=prov,
        extra={"device_type": device_type, "device": device, "cpu_threads": 2, "measured_at": "today"},
    )  # fmt: skip


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, object]:
    """profile_machine replaced by a counter returning ``fake_single()``; the cache in tmp_path."""
    import meshplan.profile.machine as machine

    state: dict[str, object] = {"calls": 0, "key": dict(KEY)}

    def fake_profile(**kw: object) -> ClusterSpec:
        assert kw["nproc"] == 1 and kw["budget_s"] is not None  # one device, bounded in time
        state["calls"] = int(state["calls"]) + 1  # type: ignore[call-overload]
        return fake_single()

    monkeypatch.setattr(machine, "profile_machine", fake_profile)
    monkeypatch.setattr(local, "machine_key", lambda: dict(state["key"]))  # type: ignore[call-overload]
    monkeypatch.setenv(local.DIR_ENV, str(tmp_path / "profiles"))
    return state


def test_cache_hit_does_not_measure_again(counted: dict[str, object]) -> None:
    said: list[str] = []
    first = local.local_cluster(4, say=said.append)
    second = local.local_cluster(2, say=said.append)
    assert counted["calls"] == 1
    assert "profiling this machine once" in said[0] and "profile from" in said[1]
    assert len(list(local.profile_dir().glob("local-*.json"))) == 1
    assert (first.num_devices, first.devices_per_node) == (4, 4) and (second.num_devices, second.devices_per_node) == (2, 2)


def test_cache_key_changes_with_torch_version_and_device(counted: dict[str, object]) -> None:
    local.local_cluster(1)
    counted["key"] = {**KEY, "torch": "2.14.0"}
    local.local_cluster(1)
    assert counted["calls"] == 2
    counted["key"] = {**KEY, "torch": "2.14.0", "device": "cuda:NVIDIA GeForce RTX 4070 Laptop GPU"}
    local.local_cluster(1)
    local.local_cluster(1)  # that one is cached now
    assert counted["calls"] == 3
    assert len({local.cache_path(k) for k in (KEY, {**KEY, "torch": "2.14.0"}, {**KEY, "host": "other"})}) == 3


def test_machine_key_names_host_torch_and_device() -> None:
    import torch

    key = local.machine_key()
    assert key["torch"] == torch.__version__ and key["host"] and key["device"].startswith(("cpu:", "cuda:"))


def test_cache_dir_follows_xdg_and_the_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(local.DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert local.profile_dir() == tmp_path / "meshplan" / "profiles"
    monkeypatch.setenv(local.DIR_ENV, str(tmp_path / "x"))
    assert local.profile_dir() == tmp_path / "x"
    monkeypatch.setenv(local.BUDGET_ENV, "0")
    with pytest.raises(ValueError, match="MESHPLAN_LOCAL_BUDGET"):
        local.budget_s()


def test_cpu_ranks_share_the_host_and_say_so() -> None:
    spec = local.replicate(fake_single(), 4)
    assert spec.peak_flops == {"fp32": 2e10, "bf16": 1e10} and spec.mem_bytes == 4 << 30
    assert spec.mem_bw_bytes_per_s == pytest.approx(5e9)
    assert spec.provenance["peak_flops.fp32"].startswith("derived") and "/ 4 ranks" in spec.provenance["mem_bytes"]
    line = spec.extra["local"]
    assert line.startswith("cluster local: 4 ranks sharing this host's CPU") and "derived" in line
    assert "\n" not in line
    one = local.replicate(fake_single(), 1)
    assert one.peak_flops == fake_single().peak_flops


def test_a_gpu_is_replicated() -> None:
    spec = local.replicate(fake_single("cuda", "NVIDIA GeForce RTX 4070 Laptop GPU"), 4)
    assert spec.peak_flops == fake_single().peak_flops and spec.mem_bytes == 16 << 30
    assert spec.extra["local"].startswith("cluster local: 4 x NVIDIA GeForce RTX 4070 Laptop GPU on one node")
    assert "replicated 4 times" in spec.extra["local"]
    with pytest.raises(ValueError, match="one-device profile"):
        local.replicate(spec, 2)


def test_provenance_is_checked_and_round_trips() -> None:
    spec = fake_single()
    assert ClusterSpec.from_json(spec.to_json()).provenance == spec.provenance
    assert set(spec.derived_figures()) == {"intra_bw_bytes_per_s", "intra_latency_s", "inter_bw_bytes_per_s",
                                           "inter_latency_s"}  # fmt: skip
    old = spec.to_dict()
    del old["provenance"]  # a profile written before provenance existed still loads
    assert ClusterSpec.from_dict(old).provenance == {}
    import dataclasses

    with pytest.raises(ValueError, match="not a ClusterSpec figure"):
        dataclasses.replace(spec, provenance={"bogus": "measured: x"})
    with pytest.raises(ValueError, match="must start with"):
        dataclasses.replace(spec, provenance={"mem_bytes": "guessed"})


def test_loopback_link_points() -> None:
    from meshplan.profile.links import loopback_points

    pts = loopback_points([4096, 1 << 20], reps=2)
    assert [n for n, _ in pts] == [4096, 1 << 20] and all(t > 0 for _, t in pts)
    assert [n for n, _ in loopback_points([4096, 1 << 20], reps=2, deadline=0.0)] == [4096]  # past the deadline


def test_profile_one_device_marks_derived_figures(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from meshplan.cli import main

    out = tmp_path / "p.json"
    assert main(["profile", "--nproc", "1", "--quick", "--matmul-sizes", "32", "--mem-test-bytes", "100000",
                 "--eager-shapes", "16:8", "--budget", "3", "-o", str(out)]) == 0  # fmt: skip
    text = capsys.readouterr().out
    spec = ClusterSpec.load(out)
    assert spec.num_devices == 1 and missing_provenance(spec) == []  # every figure says where it comes from
    assert spec.extra["collectives"] == {} and spec.derived_figures().keys() >= {
        "intra_bw_bytes_per_s", "intra_latency_s", "inter_bw_bytes_per_s", "inter_latency_s"}
    assert spec.provenance["peak_flops.fp16"].startswith("measured")  # measured, not copied from bf16
    assert "fp16" in spec.extra["matmul_flops_by_size"]
    assert "links (derived)" in text and "collectives alpha" not in text
    assert any(x.startswith("  DERIVED  intra_bw_bytes_per_s") for x in text.splitlines())
    assert any(x.startswith("  MEASURED peak_flops.fp16") for x in text.splitlines())
    assert provenance_lines(spec, derived_only=True) and all("DERIVED" in x for x in provenance_lines(spec, derived_only=True))


def test_plan_cluster_local_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture) -> None:
    """`meshplan plan MODEL.py:f -n 4 --cluster local`: measures this machine (tight budget), plans,
    says what the 4 devices are; a second plan reads the cached profile."""
    from meshplan.cli import main

    (tmp_path / "model.py").write_text(MODEL)
    monkeypatch.setenv(local.DIR_ENV, str(tmp_path / "profiles"))
    monkeypatch.setenv(local.BUDGET_ENV, "2")
    plan_json = tmp_path / "plan.json"
    argv = ["plan", f"{tmp_path / 'model.py'}:f", "-n", "4", "--cluster", "local", "-o", str(plan_json)]
    assert main(argv) == 0
    cap = capsys.readouterr()
    assert "profiling this machine once" in cap.err and "profile: [" in cap.err  # progress while measuring
    lines = cap.out.splitlines()
    what = [x for x in lines if x.startswith("cluster local: 4 ") and "links between devices derived" in x]
    assert len(what) == 1  # one line says what the 4 devices are
    assert any(x.startswith("cluster figures derived, not measured:") and "intra_bw_bytes_per_s" in x for x in lines)
    cluster = json.loads(plan_json.read_text())["cluster"]
    assert cluster["num_devices"] == 4 and cluster["devices_per_node"] == 4
    assert cluster["provenance"]["intra_bw_bytes_per_s"].startswith("derived")

    import meshplan.profile.machine as machine

    def no_measuring(**_kw: object) -> None:
        raise AssertionError("the cached profile should have been used")

    monkeypatch.setattr(machine, "profile_machine", no_measuring)
    assert main([*argv[:-2], "-q"]) == 0
    assert "cluster local: 4 " in capsys.readouterr().out


def test_python_api_takes_local(counted: dict[str, object]) -> None:
    from meshplan.cost_models.hardware import resolve_cluster
    from meshplan.planner.api import check_request

    spec = check_request(2, "local", None, None, None, None)[1]
    assert spec.name == "local" and spec.num_devices == 2 and counted["calls"] == 1
    with pytest.raises(ValueError, match="local \\(this machine\\)"):
        resolve_cluster("laptop", 2)  # the preset error names it


def test_one_known_gpu_takes_its_presets_links() -> None:
    from types import SimpleNamespace

    from meshplan.profile.links import single_device_links

    figures, why = single_device_links(SimpleNamespace(type="cuda"), "NVIDIA H100 80GB HBM3", 2, lambda _m: None)
    h100 = ClusterSpec.preset("h100")
    assert figures["intra_bw_bytes_per_s"] == h100.intra_bw_bytes_per_s
    assert figures["inter_latency_s"] == h100.inter_latency_s
    assert set(why) == set(figures) and all(v.startswith("derived: the h100 preset's") for v in why.values())


def test_capacity_sweeps_local_sizes(counted: dict[str, object]) -> None:
    import torch

    from meshplan.models.gpt import GPT, GPTConfig
    from meshplan.sizing.api import answer, ask
    from meshplan.trace import trace_model

    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=64, block_size=8))
    graph = trace_model(model, (torch.zeros(1, 8, dtype=torch.long),))
    said: list[str] = []
    rep = answer(graph, ask(tokens="1M", gpus="1-2", clusters="local"), progress=said.append)
    assert [(r.cluster, r.gpus) for r in rep.rows] == [("local", 1), ("local", 2)] and all(r.fits for r in rep.rows)
    assert rep.rows[1].tokens_per_s_per_gpu < rep.rows[0].tokens_per_s_per_gpu  # two ranks share one CPU
    assert any(x.startswith("cluster local: N ranks sharing this host's CPU") for x in said)
    assert counted["calls"] == 1


def test_autoparallel_plans_on_local(counted: dict[str, object]) -> None:
    import meshplan
    from meshplan.models.gpt import GPT, GPTConfig
    from meshplan.report.html import render_html

    plan = meshplan.autoparallel(GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=64, block_size=8)), 2,
                                 cluster="local", global_batch_size=4)  # fmt: skip
    assert plan.cluster["name"] == "local" and plan.cluster["num_devices"] == 2 and counted["calls"] == 1
    assert plan.cluster["extra"]["local"].startswith("cluster local: 2 ranks")
    page = render_html(plan)
    assert "cluster figures" in page and "intra_bw_bytes_per_s" in page  # the HTML report names the derived ones


def test_links_fall_back_to_the_memory_bandwidth(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from meshplan.profile import links

    def no_tcp(*_a: object, **_k: object) -> None:
        raise OSError("network is unreachable")

    monkeypatch.setattr(links, "loopback_points", no_tcp)
    figures, why = links.single_device_links(SimpleNamespace(type="cpu"), "cpu", 2, lambda _m: None, mem_bw=4e10)
    assert figures["intra_bw_bytes_per_s"] == 2e10 and figures["intra_latency_s"] == 0.0
    assert "half the measured copy bandwidth" in why["intra_bw_bytes_per_s"]
    with pytest.raises(OSError):
        links.single_device_links(SimpleNamespace(type="cpu"), "cpu", 2, lambda _m: None)


def test_one_gpu_is_not_profiled_as_a_cpu_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from meshplan.profile.machine import profile_machine

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="--nproc 2 needs 2 GPUs, this machine has 1: --nproc 1 profiles the GPU"):
        profile_machine(nproc=2)


def test_a_profile_measured_on_a_busy_machine_says_so(counted: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    import meshplan.profile.machine as machine
    from meshplan.profile.machine import check_profile

    busy = dataclasses.replace(fake_single(), extra={**fake_single().extra, "load_avg_1m": 9.5, "cpu_count": 2})
    assert any("busy (1-minute load 9.5 on 2 cores)" in w for w in check_profile(busy))
    idle = dataclasses.replace(busy, extra={**busy.extra, "load_avg_1m": 0.5})
    assert check_profile(idle) == []
    monkeypatch.setattr(machine, "profile_machine", lambda **_kw: busy)
    said: list[str] = []
    local.local_cluster(2, say=said.append)  # measured now
    local.local_cluster(2, say=said.append)  # read from the cache: still said
    assert sum("warning: measured while this machine was busy" in x for x in said) == 2


def test_estimate_refuses_a_bad_configuration_before_profiling(counted: dict[str, object], tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    from meshplan import cli

    bad = tmp_path / "job.toml"
    bad.write_text("[parallelism\n")  # not TOML
    rc = cli.main(["estimate", "gpt-tiny", "--from-torchtitan", str(bad), "-n", "2", "--cluster", "local", "--quiet"])
    assert rc != 0 and "not a torchtitan TOML job config" in capsys.readouterr().err
    assert counted["calls"] == 0  # the machine was never profiled
