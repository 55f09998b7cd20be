"""The scheduler and its helpers: which requests advance this step, by how many tokens (no torch).

``scheduler`` (one token budget), ``preemption`` (swap or recompute), ``scheduler_config`` (its limits),
``admit_waiting`` (admitting waiting requests in policy order), ``constraints`` (the rules that
may hold one back), ``policy`` and ``request_queue`` (waiting order, preemption victims),
``prefill_hold`` (less urgent prefill chunks held back for a more urgent prompt),
``step_plan`` (one ``schedule()`` call's bookkeeping), ``runner_view`` (what the runner already
holds, so the step plan is a delta).
"""
