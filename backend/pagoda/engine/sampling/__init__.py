"""Sampling on the logits' device: sampler, top-k/top-p filters, counter-based noise, logits processors."""
