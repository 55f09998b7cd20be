"""The device side: model runner, CUDA graphs, device worker, runner output, host KV copies."""
