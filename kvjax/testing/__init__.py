"""Test and differential-testing tools: scenarios, torch references, vLLM adapters, progress output,
and the parity check's variants of the dense reference (``fp8_rounding``, ``routing_variants``).

Imports nothing from :mod:`kvjax.cli` (the CLI sits above it).
"""
