"""ClusterSpec (cost_models.hardware): presets, validation naming the field, JSON round trip, profiles."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from meshplan.cost_models.hardware import PRESETS, VISIBLE_MEM_BYTES, ClusterSpec, resolve_cluster

DATASHEET = {  # FORMULAS.md "Hardware": bf16 TFLOP/s, memory GB, HBM TB/s, NVLink bidirectional GB/s
    "a100-40g": (312, 40, 1.555, 600),
    "a100-80g": (312, 80, 2.039, 600),
    "h100": (989, 80, 3.35, 900),
    "h200": (989, 141, 4.8, 900),
    "v100": (125, 32, 0.9, 300),
}


@pytest.mark.parametrize("name", sorted(DATASHEET))
def test_presets_match_datasheet(name: str) -> None:
    tflops, mem_gb, hbm, nvlink = DATASHEET[name]
    c = ClusterSpec.preset(name, num_nodes=2)
    assert c.num_devices == 16 and c.devices_per_node == 8 and c.num_nodes == 2
    assert c.peak("bf16") == tflops * 1e12 and c.peak("fp16") == tflops * 1e12
    # allocatable bytes, not the datasheet's decimal GB: 80 GB parts are 80 GiB of HBM less what the driver keeps
    assert c.mem_bytes == VISIBLE_MEM_BYTES[name] and 0.97 * mem_gb * 2**30 < c.mem_bytes < mem_gb * 2**30
    assert c.mem_bw_bytes_per_s == pytest.approx(hbm * 1e12)
    assert c.intra_bw_bytes_per_s == pytest.approx(nvlink / 2 * 1e9)  # per direction
    assert c.inter_bw_bytes_per_s < c.intra_bw_bytes_per_s
    assert c.source


def test_network_figures() -> None:
    assert ClusterSpec.preset("a100-80g").inter_bw_bytes_per_s == 25e9  # HDR 200 Gb/s per GPU
    assert ClusterSpec.preset("h100").inter_bw_bytes_per_s == 50e9  # NDR 400 Gb/s per GPU
    assert set(PRESETS) == set(DATASHEET)
    assert ClusterSpec.preset("V100", devices_per_node=16).devices_per_node == 16  # DGX-2


def test_preset_errors() -> None:
    with pytest.raises(ValueError, match="unknown cluster preset"):
        ClusterSpec.preset("tpu-v5")
    with pytest.raises(ValueError, match="num_nodes"):
        ClusterSpec.preset("h100", num_nodes=0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_devices", 0), ("num_devices", 12), ("devices_per_node", 0), ("peak_flops", {}),
        ("peak_flops", {"bf16": -1.0}), ("mem_bytes", 0), ("mem_bw_bytes_per_s", float("nan")),
        ("intra_bw_bytes_per_s", -5.0), ("inter_bw_bytes_per_s", float("inf")), ("intra_latency_s", -1e-6),
        ("inter_latency_s", float("nan")), ("kernel_floor_s", -1.0), ("matmul_efficiency", 0.0),
        ("mem_efficiency", 1.5), ("comm_efficiency", -0.1), ("mem_reserved_bytes", 10**12), ("name", ""),
    ],
)  # fmt: skip
def test_bad_values_name_the_field(field: str, value: object) -> None:
    c = ClusterSpec.preset("h100", num_nodes=2)
    with pytest.raises(ValueError, match=rf"ClusterSpec\.{field}"):
        dataclasses.replace(c, **{field: value})


def test_json_round_trip_and_file(tmp_path: Path) -> None:
    for name in PRESETS:
        c = ClusterSpec.preset(name, num_nodes=3)
        assert ClusterSpec.from_json(c.to_json()) == c
    c = dataclasses.replace(
        ClusterSpec.preset("h200"), extra={"measured": {"x": [1, 2]}}, matmul_efficiency=0.6
    )
    path = tmp_path / "cluster.json"
    c.save(path)
    assert ClusterSpec.load(path) == c
    assert json.loads(path.read_text())["name"] == "h200"


def test_json_errors(tmp_path: Path) -> None:
    d = ClusterSpec.preset("h100").to_dict()
    with pytest.raises(ValueError, match="unknown fields.*bogus"):
        ClusterSpec.from_dict({**d, "bogus": 1})
    del d["mem_bytes"]
    with pytest.raises(ValueError, match="missing fields.*mem_bytes"):
        ClusterSpec.from_dict(d)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ClusterSpec.load(bad)


def test_resolve_cluster_preset_profile_and_spec(tmp_path: Path) -> None:
    assert resolve_cluster("a100-80g", 64).num_devices == 64
    assert resolve_cluster("a100-80g", 64).num_nodes == 8
    assert resolve_cluster("h100", 4).num_nodes == 1  # part of one node
    # a measured profile (2 devices per "node") works wherever a preset does
    prof = ClusterSpec(
        name="local", num_devices=2, devices_per_node=2, peak_flops={"fp32": 1e11}, mem_bytes=8 * 10**9,
        mem_bw_bytes_per_s=1e10, intra_bw_bytes_per_s=1e9, intra_latency_s=1e-4, inter_bw_bytes_per_s=1e9,
        inter_latency_s=1e-4, matmul_efficiency=1.0, mem_efficiency=1.0, comm_efficiency=1.0,
        source="measured",
    )  # fmt: skip
    path = tmp_path / "profile.json"
    prof.save(path)
    for ref in (path, str(path), prof):
        r = resolve_cluster(ref, 8)
        assert r.num_devices == 8 and r.num_nodes == 4 and r.peak("bf16") == 1e11
    with pytest.raises(ValueError, match="whole number"):
        resolve_cluster(path, 3)
    with pytest.raises(ValueError, match="does not exist"):
        resolve_cluster(tmp_path / "missing.json", 2)
    with pytest.raises(ValueError, match="world_size"):
        resolve_cluster("h100", 0)
