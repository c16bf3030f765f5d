"""What the tests that start processes share: the CLIs' environment, a free port, and ``accelerate launch``."""

from __future__ import annotations

import os
import socket
import sys


def cli_env(**overrides: str) -> dict:
    """The CLIs' environment: this checkout first on the path, the emulation backend (no interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return {**env, "PYTHONPATH": path, "DIFFUSION_INT8_BACKEND": "emulation", "PYTHONUNBUFFERED": "1", **overrides}


# one CPU thread, as ``accelerate launch`` gives each of its processes unless ``OMP_NUM_THREADS`` is set: a CPU matrix
# product's sums can depend on its thread count, so a run compared bit for bit with launched ones needs the same count
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def one_thread_env(base: dict | None = None) -> dict:
    """``base`` (the CLIs' environment; None: ``cli_env()``) with one CPU thread (``ONE_THREAD``)."""
    return {**(cli_env() if base is None else base), **ONE_THREAD}


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now (a rendezvous port of its own for each launch)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch(processes: int) -> list[str]:
    """The command prefix that runs ``-m module ...`` under ``accelerate launch`` in ``processes`` processes."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port())]
