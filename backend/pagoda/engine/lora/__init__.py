"""Multi-LoRA: adapter slots and their scheduling constraint."""
