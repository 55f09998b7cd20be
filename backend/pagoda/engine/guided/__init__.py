"""Structured output (guided decoding): JSON schema, any JSON, regex, choice, EBNF grammar.

``params.py`` (what a request asks for), ``backend.py`` (the grammar library behind a
small protocol; xgrammar today), ``manager.py`` (LRU of compiled grammars, one matcher
per sequence), ``pool.py`` (the compile pool: time budget, stuck threads, fairness across
tenants, cancellation), ``limits.py`` (size/complexity refused before compiling) and
``bitmask.py`` (the sampler's masking stage). The design and its limits are described in
docs/structured_output.md.
"""

from pagoda.engine.guided.params import GuidedDecodingParams

__all__ = ["GuidedDecodingParams"]
