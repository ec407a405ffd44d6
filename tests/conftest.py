"""Suite-wide fixtures: the trace cache and local profiles go to temporary directories, never the user's ~/.cache."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True, scope="session")
def _private_trace_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    mp = pytest.MonkeyPatch()
    mp.setenv("MESHPLAN_CACHE_DIR", str(tmp_path_factory.mktemp("meshplan-cache")))
    mp.setenv("MESHPLAN_PROFILE_DIR", str(tmp_path_factory.mktemp("meshplan-profiles")))  # --cluster local
    yield
    mp.undo()
