"""The engine core's bookkeeping: requests, the KV block pool, the KV-cache manager
and the scheduler. Nothing here imports torch: it decides, the worker computes."""
