"""Test and differential-testing tools: scenarios, torch references, vLLM adapters."""
