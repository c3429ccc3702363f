"""Ray, imported on demand: a leaf module, so that the engine's Ray launcher and the
tensor-parallel Ray executor (a layer below it) share one way of joining a cluster.
Ray is an optional extra; without it, the error says how to get it."""

from __future__ import annotations

import os
from typing import Any


def import_ray(field: str = "data_parallel_backend") -> Any:
    """Ray, with an error that says how to get it where it is not installed."""
    try:
        import ray
    except ImportError as exc:
        from asyncllm.errors import ConfigError

        raise ConfigError(
            f"EngineArgs.{field}='ray' needs Ray: pip install 'asyncllm[ray]'"
        ) from exc
    if not ray.is_initialized():
        # Joins the cluster of RAY_ADDRESS or a running `ray start`, else starts one here.
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True)
    return ray
