"""The traced-graph cache (meshplan.tracing.cache): hits, keys, damage, and identical plans."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshplan.loading import load_graph
from meshplan.planner.api import plan_graph
from meshplan.tracing import cache as C

FACTORY = '''
import torch
from meshplan.models.gpt import GPT, GPTConfig

def model():
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd={width}, block_size=16, vocab_size=64))
'''


def _strip_timing(plan) -> dict:
    d = json.loads(plan.to_json())
    for k in list(d["solver"]):
        if k in ("seconds", "split_seconds"):
            d["solver"][k] = 0.0
    d["notes"] = [re.sub(r"[0-9.]+ s\b", "T s", n) for n in d.get("notes", [])]  # solver wall times
    return d


def test_zoo_graph_cached_and_plans_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = C.GraphCache(tmp_path)
    first = load_graph("gpt-tiny", cache=store)  # a miss: traced, then stored
    assert len(list(tmp_path.glob("zoo-*.json"))) == 1

    import meshplan.trace

    def boom(*a, **k):
        raise AssertionError("a cache hit must not trace")

    monkeypatch.setattr(meshplan.trace, "trace_model", boom)
    hit = load_graph("gpt-tiny", cache=store)
    assert hit == first
    a = plan_graph(first, 2, cluster="h100", global_batch_size=4)
    b = plan_graph(hit, 2, cluster="h100", global_batch_size=4)
    assert _strip_timing(a) == _strip_timing(b)
    # another sequence length is another graph; a factory has no key before it is built
    assert C.spec_key("gpt-tiny", 8) != C.spec_key("gpt-tiny", None)
    assert C.spec_key("models.py:make", None) is None


def test_graph_json_text_is_asdicts(tmp_path: Path) -> None:
    """ModelGraph.to_json skips asdict's deep copy; the stored text must be exactly asdict's."""
    g = load_graph("gpt-tiny", cache=C.GraphCache(tmp_path), use_cache=False)
    g.meta["probe"] = {"nested": [C.GraphCache.__name__, (1, 2)], "node": g.nodes[0]}  # a dataclass in meta too
    assert g.to_json() == json.dumps(g.to_dict())


def test_factory_key_follows_the_model(tmp_path: Path) -> None:
    store = C.GraphCache(tmp_path / "cache")
    f = tmp_path / "mymodel.py"
    f.write_text(FACTORY.format(width=32))
    g1 = load_graph(f"{f}:model", cache=store)
    g2 = load_graph(f"{f}:model", cache=store)
    assert g1 == g2 and len(list(store.directory.glob("model-*.json"))) == 1
    load_graph(f"{f}:model", cache=store, use_cache=False)  # --no-cache: traced, nothing stored
    assert len(list(store.directory.glob("model-*.json"))) == 1
    f.write_text(FACTORY.format(width=64))  # a different shape: a different key, a new trace
    g3 = load_graph(f"{f}:model", cache=store)
    assert len(list(store.directory.glob("model-*.json"))) == 2
    assert g3.param_count > g1.param_count


def test_damaged_entry_is_ignored(tmp_path: Path) -> None:
    store = C.GraphCache(tmp_path)
    key = C.spec_key("gpt-tiny", None)
    assert key is not None
    store.path(key).write_text("{not json")
    g = load_graph("gpt-tiny", cache=store)
    assert store.get(key) == g  # replaced by a good one


def test_cache_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MESHPLAN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert C.cache_dir() == tmp_path / "meshplan" / "graphs"
    with pytest.raises(ValueError, match="bad cache key"):
        C.GraphCache(tmp_path).path("../x")


def test_zoo_hit_imports_no_torch(tmp_path: Path) -> None:
    store = C.GraphCache(tmp_path)
    g = load_graph("gpt-tiny", cache=store)
    code = (
        "import sys; from meshplan.tracing.cache import GraphCache; from meshplan.loading import load_graph; "
        f"g = load_graph('gpt-tiny', cache=GraphCache({str(tmp_path)!r})); "
        "print(len(g.nodes), 'torch' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), *sys.path])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == [str(len(g.nodes)), "False"]


def test_meta_build_skips_init_only_on_meta() -> None:
    import torch

    from meshplan.models.meta_init import skip_init_on_meta

    with torch.device("meta"), skip_init_on_meta():
        lin = torch.nn.Linear(4, 3)
    assert lin.weight.is_meta and tuple(lin.weight.shape) == (3, 4)
    with skip_init_on_meta():  # real tensors are initialised as usual
        torch.manual_seed(0)
        a = torch.nn.Linear(4, 3)
    torch.manual_seed(0)
    b = torch.nn.Linear(4, 3)
    assert torch.equal(a.weight, b.weight) and bool(a.weight.abs().sum() > 0)


def test_factory_hit_keeps_this_specs_name(tmp_path: Path) -> None:
    """Two factories building the same model share one cache entry (the key is the structure);
    each spec's graph still carries the name its own trace gives it, hit or miss."""
    store = C.GraphCache(tmp_path / "cache")
    f = tmp_path / "mymodel.py"
    f.write_text(FACTORY.format(width=32) + "\n\ndef other():\n    return model()\n")
    traced = load_graph(f"{f}:other", cache=store, use_cache=False)
    first = load_graph(f"{f}:model", cache=store)  # a miss: stored under the structure's key
    hit = load_graph(f"{f}:other", cache=store)  # the same key: a hit
    assert len(list(store.directory.glob("*.json"))) == 1
    assert hit.model_name == traced.model_name
    assert first.model_name == load_graph(f"{f}:model", cache=store, use_cache=False).model_name
