"""Checkpoint directory rules without torch.distributed: newest complete, pruning, checksums, fingerprints."""

from __future__ import annotations

import json

import pytest

from meshplan.runtime.weights import files as cf


def _ckpt(d, step: int, *, manifest: bool = True, tmp: bool = False):
    name = cf.step_name(step)
    p = d / (cf.TMP_PREFIX + name if tmp else name)
    p.mkdir(parents=True)
    (p / "__0_0.distcp").write_bytes(bytes(range(200)))
    if manifest:
        cf.write_manifest(p, {"step": step, "files": cf.hash_files(p, cf.data_files(p))})
    return p


def test_newest_complete_ignores_temp_and_manifestless(tmp_path) -> None:
    assert cf.newest_complete(tmp_path / "absent") is None
    _ckpt(tmp_path, 2)
    _ckpt(tmp_path, 4)
    _ckpt(tmp_path, 6, manifest=False)  # half-written under the final name (cannot happen via save)
    _ckpt(tmp_path, 8, tmp=True)  # interrupted save
    (tmp_path / "latest").write_text("step-000008\n")  # a stale marker is not trusted
    assert cf.newest_complete(tmp_path) == tmp_path / "step-000004"
    assert [s for s, _ in cf.complete_checkpoints(tmp_path)] == [2, 4]


def test_commit_is_rename_and_replaces(tmp_path) -> None:
    t = _ckpt(tmp_path, 3, tmp=True)
    final = tmp_path / cf.step_name(3)
    cf.commit(t, final)
    assert not t.exists() and cf.read_manifest(final)["step"] == 3
    t2 = _ckpt(tmp_path, 3, tmp=True)
    (t2 / "extra.bin").write_bytes(b"x")
    cf.commit(t2, final)
    assert (final / "extra.bin").is_file()
    assert not any(p.name.startswith(cf.TMP_PREFIX) for p in tmp_path.iterdir())


def test_prune_keeps_newest_k_and_removes_temp(tmp_path) -> None:
    for s in (1, 2, 3, 4, 5):
        _ckpt(tmp_path, s)
    _ckpt(tmp_path, 6, tmp=True)
    cf.prune(tmp_path, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000004", "step-000005"]
    cf.prune(tmp_path, 0)  # keep all
    assert len(cf.complete_checkpoints(tmp_path)) == 2


def test_verify_files_finds_zeroed_bytes_and_truncation(tmp_path) -> None:
    p = _ckpt(tmp_path, 1)
    expected = cf.read_manifest(p)["files"]
    assert cf.verify_files(p, expected, expected) == []
    data = bytearray((p / "__0_0.distcp").read_bytes())
    data[10:20] = bytes(10)
    (p / "__0_0.distcp").write_bytes(bytes(data))
    assert "checksum mismatch" in cf.verify_files(p, expected, expected)[0]
    (p / "__0_0.distcp").write_bytes(bytes(data[:50]))
    assert "has 50 bytes" in cf.verify_files(p, expected, expected)[0]


def test_read_manifest_errors(tmp_path) -> None:
    with pytest.raises(cf.CheckpointError, match="no meshplan.json"):
        cf.read_manifest(tmp_path)
    (tmp_path / cf.MANIFEST).write_text("{not json")
    with pytest.raises(cf.CheckpointError, match="unreadable manifest"):
        cf.read_manifest(tmp_path)
    (tmp_path / cf.MANIFEST).write_text(json.dumps({"x": 1}))
    with pytest.raises(cf.CheckpointError, match="no 'step'"):
        cf.read_manifest(tmp_path)


def test_fingerprint_diff_names_the_tensor() -> None:
    a = {"w": [[4, 4], "float32"], "b": [[4], "float32"]}
    assert cf.fingerprint_diff(a, dict(a)) == []
    b = {"w": [[8, 4], "float32"], "c": [[4], "float32"]}
    diff = cf.fingerprint_diff(a, b)
    assert any("only in the checkpoint" in x and "'b'" in x for x in diff)
    assert any("only in this model" in x and "'c'" in x for x in diff)
    assert "w: [4, 4] float32 in the checkpoint, [8, 4] float32 in this model" in diff
