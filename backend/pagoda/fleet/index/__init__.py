"""The fleet's Redis side: prefix index, KV-event publisher, replica registry."""
