"""An engine core placed by Ray on any node of a Ray cluster (`--data-parallel-backend ray`).

Ray only places and supervises: an actor on the chosen node starts the same
`python -m asyncllm.engine.core_proc` a local core is, with `--watch-stdin`, and
waits for it. The core connects back to the front end over TCP, secured with CURVE
(curve.py): the front end binds to the address the user gives (or the IP
Ray reports for this node), never to all interfaces. If the front end dies, Ray
ends the actors it owns; the core sees its stdin close and exits, as a local one
does. `RayCoreProcess` has `CoreProcess`'s interface, so `MPClient` treats both alike.

A core whose tensor-parallel workers Ray places (`--distributed-executor-backend
ray`, executor/ray_executor.py) joins the front end's cluster: `cluster_environment`
hands a local core RAY_ADDRESS, and a Ray-placed core gets it from its actor.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from typing import Any

from asyncllm.config import EngineArgs
from asyncllm.curve import KEYS_ENV, ClientKeys
from asyncllm.ray_import import import_ray

logger = logging.getLogger(__name__)

# An actor killed (or lost with its node) leaves no exit code: report it as SIGKILL's.
_KILLED = -9


def cluster_environment(args: EngineArgs) -> dict[str, str]:
    """RAY_ADDRESS for a core process whose tensor-parallel workers Ray places: the
    cluster this process is connected to (where it called `ray.init`), so that the
    core joins the same one. Empty otherwise: the core's `ray.init` then finds
    RAY_ADDRESS or a `ray start` cluster itself. Never imports Ray."""
    if args.tensor_parallel_size == 1 or args.distributed_executor_backend != "ray":
        return {}
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return {}
    return {"RAY_ADDRESS": str(ray.get_runtime_context().gcs_address)}


def bind_host(args: EngineArgs) -> str:
    """The address the front end listens on for Ray-placed cores."""
    if args.data_parallel_address:
        return args.data_parallel_address
    return str(import_ray().util.get_node_ip_address())


class _CoreSupervisor:
    """Ray actor: runs one engine core process on its node and waits for it."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None

    def run(self, engine_args: str, input_addr: str, output_addr: str, keys: str) -> int:
        cmd = [
            sys.executable,
            "-m",
            "asyncllm.engine.core_proc",
            "--engine-args",
            engine_args,
            "--input",
            input_addr,
            "--output",
            output_addr,
            "--watch-stdin",
        ]
        env = dict(os.environ, **{KEYS_ENV: keys})
        # its own tensor-parallel workers (if Ray places them) join this cluster
        env["RAY_ADDRESS"] = str(import_ray().get_runtime_context().gcs_address)
        # stdin: a pipe this actor holds; the core exits when the actor's process ends.
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env, close_fds=True)
        return self._proc.wait()

    def pid(self) -> int | None:
        """The core process's pid on its node (tests kill it)."""
        return self._proc.pid if self._proc is not None else None


class RayCoreProcess:
    """An engine core started by a Ray actor, reached over CURVE-secured TCP."""

    def __init__(self, args: EngineArgs, keys: ClientKeys, host: str) -> None:
        self._args = args
        self._keys = keys
        # "*": ZMQ picks free ports at bind; MPClient sets the bound endpoints here.
        self.input_addr = f"tcp://{_bracket(host)}:*"
        self.output_addr = f"tcp://{_bracket(host)}:*"
        self._actor: Any = None
        self._run: Any = None
        self._code: int | None = None

    def start(self) -> None:
        """Place the actor and start the core; the caller has bound both addresses."""
        ray = import_ray()
        options: dict[str, Any] = {
            "num_cpus": self._args.num_threads or 1,
            "max_concurrency": 2,  # `pid` answers while `run` waits
            "scheduling_strategy": "SPREAD",
        }
        if self._args.device == "cuda":
            options["num_gpus"] = 1
        actor_cls = ray.remote(_CoreSupervisor)
        self._actor = actor_cls.options(**options).remote()
        self._run = self._actor.run.remote(
            self._args.to_json(), self.input_addr, self.output_addr, self._keys.to_text()
        )

    @property
    def pid(self) -> int | None:
        if self._actor is None:
            return None
        return import_ray().get(self._actor.pid.remote(), timeout=30)  # type: ignore[no-any-return]

    def exit_code(self) -> int | None:
        if self._code is None and self._run is not None:
            ready, _ = import_ray().wait([self._run], timeout=0)
            if ready:
                self._code = self._result()
        return self._code

    def wait(self) -> int:
        assert self._run is not None
        if self._code is None:
            self._code = self._result()
        return self._code

    def _result(self) -> int:
        ray = import_ray()
        try:
            return int(ray.get(self._run))
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as exc:
            logger.error("the Ray actor of an engine core died: %s", exc)
            return _KILLED

    def stop(self, timeout: float = 5.0) -> None:
        """Wait for the core to exit (after SHUTDOWN), else kill its actor, which ends
        the core through its stdin. Idempotent."""
        if self._run is None:
            return
        ray = import_ray()
        ready, _ = ray.wait([self._run], timeout=timeout)
        if not ready:
            logger.warning("engine core did not exit in %.1fs; killing its Ray actor", timeout)
        ray.kill(self._actor, no_restart=True)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
