"""Each published run's model (``meshplan/data/published_cases.json``) as a ``meshplan plan`` factory.

    meshplan plan benchmarks/models/published_case.py:llama3_405b_h100_8192gpu_seq8k -n 8192 ...

The factory name is the case id with every character that cannot be in a Python name replaced
by ``_`` (``factory_name``); the factory builds ``models.published.case_model(case)``, the zoo
GPT / Llama / MoE of the run's shape that ``benchmarks/published_cases.py`` traces in process,
so a whole ``meshplan plan`` command plans the same graph. Names are resolved on attribute access
(a module ``__getattr__``), so the file lists no case.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any


def factory_name(case_id: str) -> str:
    """``"llama3-405b-h100-8192gpu-seq8k"`` -> ``"llama3_405b_h100_8192gpu_seq8k"``."""
    name = re.sub(r"\W", "_", case_id)
    return name if not name[:1].isdigit() else "_" + name


def _cases_by_name() -> dict[str, dict[str, Any]]:
    from meshplan.cost_models.published import load_published_cases

    return {factory_name(c["id"]): c for c in load_published_cases()}


def __getattr__(name: str) -> Callable[[], Any]:
    case = _cases_by_name().get(name) if not name.startswith("__") else None
    if case is None:
        raise AttributeError(f"no published case whose factory name is {name!r} (see factory_name)")

    def model() -> Any:
        from meshplan.models.published import case_model

        return case_model(case)

    model.__name__ = name
    return model
