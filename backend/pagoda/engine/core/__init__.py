"""The engine core: scheduler, queues, admission, policies and constraints (token ids in and out, no torch)."""
