"""The engine core: one step at a time, token ids in and out, no torch.

The step loop (``engine_core``, pipeline parallelism's ``batch_queue``), the device side as the
core sees it (``device``), requests accepted but not yet in the scheduler (``parked``), load
shedding at the engine's edge (``load_shedding``); the scheduler and its helpers in ``sched/``.
"""
