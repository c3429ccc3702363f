"""Executors: how the model runs across processes.

With `tensor_parallel_size` 1 the engine core builds its `ModelRunner` directly
and nothing here is imported. With more, `factory.build_tp_runner` starts an
executor (its interface and constants: `abstract.TPExecutor`): rank 0 is the
core's own runner, ranks 1..N-1 are worker processes (`worker_proc`) that receive
each step's model inputs from rank 0 (`step_channel`) and run the same forward
pass on their shard of the model. The multiprocess executor (`multiproc`) starts
them on the core's machine; the Ray executor (`ray_executor`,
`distributed_executor_backend="ray"`) has Ray place them on a cluster's nodes,
reached through rank 0's CURVE-secured hub (`hub`). Imports run one way:
factory -> multiproc / ray_executor -> abstract.
"""
