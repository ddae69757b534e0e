"""Test and differential-testing tools: scenarios, torch references, vLLM adapters, progress output.

Imports nothing from :mod:`kvjax.cli` (the CLI sits above it).
"""
