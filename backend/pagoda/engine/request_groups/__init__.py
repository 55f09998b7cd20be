"""One user request run as a group of scheduler requests (no torch).

``parallel_sampling``: ``n > 1`` children and the sibling gate (the fan-out; the fan-in is the
output processor's); ``beam_search``: beams that fork and share KV blocks, scored as Hugging
Face's ``generate(num_beams=k)``. The step loop (``engine.core``) drives both; neither imports it.
"""
