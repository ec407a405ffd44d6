"""Measuring this machine: the one place outside ``trace.py``, ``tracing/`` and ``runtime/`` that runs torch.

``cost_models/`` stays pure (shapes and a ClusterSpec in, seconds and bytes out); what it needs
from a real machine is measured here and handed over as a ClusterSpec JSON that
``cost_models.hardware.ClusterSpec.from_json`` loads. torch is imported inside the measuring
functions only, so importing this package is cheap.

- ``machine.py``: ``profile_machine(...)`` (``meshplan profile``), ``check_profile``, the timers
  (``median_time_s``) and the per-quantity measurements;
- ``comm.py``: collectives across spawned processes and the alpha-beta fit;
- ``budget.py``: the ``--budget`` split over the measurements, deadlines and progress lines.
- ``links.py``: the links between devices of a one-device profile (``--nproc 1``), derived;
- ``provenance.py``: "measured: how" / "derived: from what" for every figure of a profile;
- ``local.py``: ``--cluster local`` (this machine, profiled once, cached, replicated to N devices).
"""

from __future__ import annotations

from meshplan.profile.machine import check_profile, median_time_s, profile_machine

__all__ = ["check_profile", "median_time_s", "profile_machine"]
