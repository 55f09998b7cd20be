"""The router's doors: Triton gRPC, Triton HTTP, OpenAI, LoRA admin, tracing."""
