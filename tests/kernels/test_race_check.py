"""The shared TPU race-detection assertion (kvjax.testing.asserts.assert_no_races)."""

from __future__ import annotations

import numpy as np
import pytest

from kvjax.testing import asserts
from pallas_kernels import zero_blocks


def test_unavailable_race_detection_fails(monkeypatch):
    monkeypatch.setattr(asserts, "races_found", lambda: None)
    with pytest.raises(AssertionError, match="race detection is unavailable"):
        asserts.assert_no_races("pallas_tpu")
    asserts.assert_no_races("reference")  # not a TPU-interpreted call: nothing to check


def test_a_found_race_fails(monkeypatch):
    monkeypatch.setattr(asserts, "races_found", lambda: True)
    with pytest.raises(AssertionError, match="detected a race"):
        asserts.assert_no_races("pallas_tpu")


def test_race_state_is_real_after_a_tpu_interpret_call():
    zero_blocks([np.ones((2, 2), np.float32)], np.array([1], np.int32), backend="pallas_tpu")
    assert asserts.races_found() is False
    asserts.assert_no_races("pallas_tpu")
