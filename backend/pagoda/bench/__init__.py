"""Benchmarks behind `pagoda bench ...`: each a module with `main(argv) -> int`."""
