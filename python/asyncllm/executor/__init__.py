"""Executors: how the model runs across processes.

With `tensor_parallel_size` 1 the engine core builds its `ModelRunner` directly
and nothing here is imported. With more, `multiproc.build_tp_runner` starts a multiprocess
executor: rank 0 is the core's own runner, ranks 1..N-1 are worker processes
(`worker_proc`) that receive each step's model inputs from rank 0
(`step_channel`) and run the same forward pass on their shard of the model.
"""
