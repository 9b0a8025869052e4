"""Fulcrum from Python: the coordinator's job API (fulcrum.Client).

    import fulcrum
    client = fulcrum.Client("127.0.0.1:7070")
    job_id = client.submit("deploy/examples/mnist-mlp.yaml")
    for event in client.watch(job_id):
        print(event.kind, fulcrum.state_name(event.job), event.job.status.epoch)

fulcrum.Tables pushes and pulls a job's parameter-server tables from NumPy
arrays through the C++ client (fulcrum/tables.py); fulcrum.torch keeps a
PyTorch module's parameters and embeddings there (import fulcrum.torch).
fulcrum.Worker makes this process one worker of a job whose spec says
user_workers: true (fulcrum/worker.py).

The gRPC stubs (fulcrum.v1.cluster_pb2 and the rest) are generated from
proto/ when the project builds; the package is assembled in build/python.
"""

import importlib
import sys


def _require(module, package):
    """Imports `module`, or raises an ImportError that names the Debian
    package that brings it and the interpreters that see it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"fulcrum needs the Python module {module!r} (Debian's package {package}), which {sys.executable} "
            f"cannot import ({e}). Install it (apt-get install {package}) and run Debian's /usr/bin/python3, "
            "or a virtual environment made from it that sees its packages: "
            "/usr/bin/python3 -m venv --system-site-packages ENV") from e


_require("grpc", "python3-grpcio")
_require("google.protobuf", "python3-protobuf")

from fulcrum.client import TERMINAL_STATES, Client, FulcrumError, state_name  # noqa: E402
from fulcrum.worker import Worker, WorkerStopped  # noqa: E402

__all__ = ["Client", "FulcrumError", "TERMINAL_STATES", "Tables", "Worker", "WorkerStopped", "state_name"]


def __getattr__(name):
    # fulcrum.Tables loads the C++ client only when asked for.
    if name == "Tables":
        _require("numpy", "python3-numpy")
        from fulcrum.tables import Tables  # pylint: disable=import-outside-toplevel
        return Tables
    raise AttributeError(f"module 'fulcrum' has no attribute {name!r}")
