"""Fulcrum from Python: the coordinator's job API (fulcrum.Client).

    import fulcrum
    client = fulcrum.Client("127.0.0.1:7070")
    job_id = client.submit("deploy/examples/mnist-mlp.yaml")
    for event in client.watch(job_id):
        print(event.kind, fulcrum.state_name(event.job), event.job.status.epoch)

The gRPC stubs (fulcrum.v1.cluster_pb2 and the rest) are generated from
proto/ when the project builds; the package is assembled in build/python.
"""

from fulcrum.client import TERMINAL_STATES, Client, FulcrumError, state_name

__all__ = ["Client", "FulcrumError", "TERMINAL_STATES", "state_name"]
