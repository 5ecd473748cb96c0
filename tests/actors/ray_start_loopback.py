"""`python ray_start_loopback.py <ray start arguments>`: Ray's own `ray start`, able to join a
second node to a cluster on this machine's loopback address.

Ray keeps every address on 127.0.0.1 only while RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (set to 1,
it swaps 127.0.0.1 for the machine's external address, and the head listens on loopback only),
but with that setting `ray start --address` refuses to join any cluster. This lifts the refusal
alone: the node still names itself and its head 127.0.0.1, and its processes (raylet, workers)
inherit RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0.
"""
import sys

from ray._private import ray_constants, services
from ray.scripts.scripts import main

if __name__ == "__main__":
    ray_constants.ENABLE_RAY_CLUSTER = True  # read by `ray start`'s multi-node check...
    services.resolve_ip_for_localhost = lambda host: host  # ...and by these two, kept on loopback
    services.get_node_ip_address = lambda address=None: "127.0.0.1"
    sys.argv = ["ray", "start", *sys.argv[1:]]
    main()
