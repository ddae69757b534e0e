"""Host-side bookkeeping (plain Python, no device arrays).

* :mod:`kvjax.host.block_pool` — the block / recurrent-slot allocator (id 0 reserved).
* :mod:`kvjax.host.buckets` — the one place that picks a step's padded shape.
* :mod:`kvjax.host.scheduler` — token budget, chunked prefill, preemption, drafts.
* :mod:`kvjax.host.drafter` — n-gram draft proposals.
* :mod:`kvjax.host.placement` — which data-parallel rank a request goes to.
* :mod:`kvjax.host.trace` — drives the state functions step by step without a model.
"""
