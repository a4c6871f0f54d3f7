"""A local Ray cluster of two nodes for the e2e tests: a head and a second node, each a raylet
of its own (Ray's own ``ray.cluster_utils.Cluster``, as Ray's tests make one), with few CPUs.
Run as a script (``python -m tests.e2e.ray_cluster CPUS``): it prints the cluster's address on
one line once both nodes are up, and shuts down the processes it started when its standard
input closes. A process of its own keeps Ray's imports, threads and warnings out of pytest's.
Its environment should hold ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (the test's does), or Ray
takes the machine's own address for 127.0.0.1 (test_mapper_ray.RAY_LOOPBACK)."""

from __future__ import annotations

import json
import sys


def main() -> None:
    from ray.cluster_utils import Cluster

    cpus = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    # Loopback only: the nodes and their drivers talk to no other address.
    node = {"num_cpus": cpus, "include_dashboard": False, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args=node)
    try:
        cluster.add_node(num_cpus=cpus, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        print(json.dumps({"address": cluster.address, "nodes": 2}), flush=True)
        sys.stdin.read()  # until the test closes it
    finally:
        cluster.shutdown()  # type: ignore[no-untyped-call]


if __name__ == "__main__":
    main()
