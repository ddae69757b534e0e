"""``python -m kvjax``: the demo, the trace and the differential test.

* :mod:`kvjax.cli.main` — argument parsing and the sub-commands.
* :mod:`kvjax.cli.demo` — serve a workload and check it against the dense reference, on one
  device or over a ``("data", "model")`` device mesh (``--mesh``).
* :mod:`kvjax.cli.trace` — print a scheduling trace through the state functions alone.
* :mod:`kvjax.cli.workload` — workload files: load, generate, validate.

Progress output comes from :mod:`kvjax.testing.progress` (the difftest uses it too, and
``kvjax.testing`` imports nothing from the CLI).
"""
