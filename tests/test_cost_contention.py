"""NCCL's SMs taken from overlapped compute (cost_models/contention.py) and where the planner charges it."""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.cost_models.contention import comm_sm_fraction, overlap_slowdown_s
from meshplan.cost_models.hardware import NCCL_MAX_CHANNELS, ClusterSpec

H100 = ClusterSpec.preset("h100")


def test_presets_take_nccls_channel_cap_of_the_sms():
    assert H100.comm_sms == NCCL_MAX_CHANNELS == 32
    assert comm_sm_fraction(H100) == pytest.approx(32 / 132)
    assert comm_sm_fraction(ClusterSpec.preset("a100-80g")) == pytest.approx(32 / 108)
    assert comm_sm_fraction(dataclasses.replace(H100, comm_sms=0)) == 0.0
    assert comm_sm_fraction(dataclasses.replace(H100, sm_count=0)) == 0.0  # unknown GPU: not modelled


def test_slowdown_is_the_sm_share_of_the_hidden_comm_or_of_the_compute_inside_it():
    f = 32 / 132
    # compute outlasts the collective: it loses f of the collective's duration
    assert overlap_slowdown_s(0.010, 0.100, H100) == pytest.approx(0.010 * f)
    # compute entirely inside the collective: it runs at 1 - f of its speed
    assert overlap_slowdown_s(0.100, 0.010, H100) == pytest.approx(0.010 / (1 - f) - 0.010)
    assert overlap_slowdown_s(0.0, 0.1, H100) == 0.0 and overlap_slowdown_s(0.1, 0.0, H100) == 0.0


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="comm_sms"):
        dataclasses.replace(H100, comm_sms=132)
    with pytest.raises(ValueError, match="hidden_comm_s"):
        overlap_slowdown_s(-1.0, 1.0, H100)
