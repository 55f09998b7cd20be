"""Reading a model's answer as an agent reads it: reasoning and tool calls, in each family's format.

- ``events``: the events every parser emits (``Content``, ``Reasoning``, ``CallStart``,
  ``CallArguments``) and ``Parsed``, an answer folded from them;
- ``reasoning``: ``<think>`` parsers (Qwen3, DeepSeek-R1), ``REASONING_PARSERS``;
- ``tool_calls``: Hermes, Qwen3-Coder XML, Llama 3 JSON, Mistral (``TOOL_PARSERS``), JSON calls
  read as they stream by ``json_calls``;
- ``harmony``: gpt-oss's channels (reasoning, answer and calls in one format);
- ``output``: ``OutputParser``, the reasoning parser then the tool parser over one answer.

Pure text processing: no I/O, no door (the doors of ``fleet.api`` render the events).
"""
