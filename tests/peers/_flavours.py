"""Which kvjax implementations a ported peer test runs (see README.md here).

CI (``python -m pytest -q``) runs every peer test on the reference flavour
(``backend="reference"``, plain XLA) with CI-sized cases. ``KVJAX_PEER_SLOW=1``
adds the interpreted Pallas flavours (``"pallas_tpu"``: the TPU kernels in JAX's
TPU interpreter; ``"pallas_gpu"``: the GPU kernels interpreted as XLA) and the
peers' larger cases; without it those are skipped, with this reason.
"""

from __future__ import annotations

import os

import pytest

SLOW = os.environ.get("KVJAX_PEER_SLOW") == "1"
SLOW_REASON = "slow peer variant: set KVJAX_PEER_SLOW=1 (tests/peers/README.md)"


def slow(*values, id=None):
    """``pytest.param(*values)`` that runs only with ``KVJAX_PEER_SLOW=1``."""
    return pytest.param(*values, id=id, marks=pytest.mark.skipif(not SLOW, reason=SLOW_REASON))


def flavours(*interpreted: str):
    """``"reference"`` always, then each interpreted flavour behind the slow switch."""
    return ["reference"] + [slow(f) for f in interpreted]


def sized(ci, larger):
    """The CI values as they are, the peer's larger values behind the slow switch."""
    return list(ci) + [slow(v) if not isinstance(v, tuple) else slow(*v) for v in larger]
