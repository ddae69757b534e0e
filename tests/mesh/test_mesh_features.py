"""Serving over a mesh, continued from test_mesh.py (split off so that the two xdist workers of
``--dist loadfile`` share the mesh cases, each file's worker process one of two subprocesses):
--overlap, fp8, speculative decoding and the rpa layout on meshes, the compiled-in planted bug
(vLLM PR 39444) caught by the sanitizer, two processes given different workloads stopping, and
the two-process run repeated when its coordinator's port was taken."""

import pytest

from test_mesh import FEATURES, PLANTED, _two_processes, check_feature_case, run_worker


@pytest.fixture(scope="module")
def worker_results():
    """The features on meshes and the compiled-in plant, in one process with 8 host devices."""
    return run_worker(*FEATURES, "planted")


@pytest.mark.parametrize("case", FEATURES)
def test_mesh_features_match_the_dense_reference_with_poison(worker_results, case):
    """--overlap, fp8, speculative decoding and the rpa layout on a mesh: every request matches the
    dense reference, the sanitizer passes on every rank, idle ranks ran dummy steps (--overlap on
    2x2 alone: test_mesh.py, on the 2x2 runner)."""
    check_feature_case(worker_results[case])


def test_planted_mesh_bug_compiled_into_the_step_is_caught_by_the_sanitizer(worker_results):
    """PR 39444's bug planted in the traced slot mapping (its own compile); the host-side plants
    are in test_mesh.py."""
    err = worker_results["planted"].get("error")
    assert err is not None and err["invariant"] in PLANTED["planted"], worker_results["planted"]


def test_two_processes_given_different_workloads_stop(tmp_path):
    """Issue 25: two processes of one run given different workloads used to serve silently wrong;
    they now agree on a fingerprint of the workload and settings first, and both stop (exit 2)."""
    procs, outs = _two_processes(tmp_path, (("--requests", "4"), ("--requests", "5")))
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 2, out + err[-3000:]
        assert "different workloads or settings" in err, err[-3000:]


def test_two_processes_retry_when_the_coordinators_port_is_taken(tmp_path, monkeypatch):
    """The free port found for the coordinator can be taken before it binds it (it then dies, and
    process 1 would wait for it until its own timeout): the run is repeated on another port. Here
    the first port handed out is one this test holds."""
    import socket

    import test_mesh

    real = socket.socket
    held = real()
    held.bind(("localhost", 0))
    held.listen(1)
    probes = []

    class FirstPortTaken:  # the probe socket _two_processes binds to find a free port
        def __init__(self, *a, **k):
            self._s = real(*a, **k)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._s.close()

        def bind(self, addr):
            self._s.bind(addr)

        def getsockname(self):
            probes.append(1)
            return held.getsockname() if len(probes) == 1 else self._s.getsockname()

    monkeypatch.setattr(test_mesh.socket, "socket", FirstPortTaken)
    try:
        procs, outs = _two_processes(tmp_path, (("--requests", "2"),) * 2)
    finally:
        held.close()
    assert len(probes) == 2
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err[-3000:]
