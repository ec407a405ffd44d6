"""Whether a run's measured step time can be set against the plan's prediction.

A plan costed for an H100 preset and run on this CPU (or a 2-rank gloo test of an 8-GPU plan on
one laptop) predicts a machine that is not the one measured: a percentage between the two would
read as a cost-model error. ``not_comparable_reason`` says when that is so; the run's end line
then reads ``predicted for <cluster>; measured on <device>: not comparable``.

Comparable when the plan's cluster is
- a profile measured by ``meshplan profile`` on this host (``extra.host``; profiles from before the
  host was recorded: same device name), or
- a GPU preset and every rank runs on a GPU of that preset (``hardware.preset_for_gpu_name``), or
- unknown (an empty cluster, e.g. a hand-written plan): no claim is made either way.
torch-free; the caller says what the device is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshplan.cost_models.hardware import preset_for_gpu_name


def not_comparable_reason(cluster: Mapping[str, Any], *, device_type: str, device_name: str, host: str) -> str:
    """"" when comparable; else ``predicted for <cluster>; measured on <device>: not comparable``."""
    name = str(cluster.get("name") or "")
    if not name:
        return ""
    extra = cluster.get("extra") or {}
    if extra.get("measured"):
        same = extra.get("host") == host if extra.get("host") else extra.get("device") == device_name
    else:
        same = device_type == "cuda" and preset_for_gpu_name(device_name) == name
    if same:
        return ""
    where = f"{device_type} ({device_name})" if device_name and device_name != device_type else device_type
    return f"predicted for {name}; measured on {where}: not comparable"


def local_device(torch: Any) -> tuple[str, str, str]:
    """(device type, device name, host) of this process, for ``not_comparable_reason``."""
    import platform

    if torch.cuda.is_available():
        return "cuda", torch.cuda.get_device_name(0), platform.node()
    return "cpu", platform.processor() or platform.machine(), platform.node()
