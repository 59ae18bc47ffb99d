"""``fitserve serve``'s replica flags (no Ray here: the parser is built without it)."""

from __future__ import annotations

import argparse

from fitserve.fleet.routing import ROUTING_MODES


def add_fleet_args(p: argparse.ArgumentParser) -> None:
    """--replicas, --ray-address, --replica-cpus, --routing."""
    g = p.add_argument_group("replicas on Ray Serve (pip install 'fitserve[ray]')")
    g.add_argument("--replicas", type=_at_least_one, default=None, metavar="N",
                   help="run N replicas of the engine as Ray Serve deployments behind one ingress on "
                        "--port (starts a local Ray head unless --ray-address is given)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (e.g. 10.0.0.1:6379 or ray://host:10001) instead of "
                        "starting a local head; fitserve must be installed on its nodes")
    g.add_argument("--fleet-config", default=None, metavar="FILE",
                   help="replica groups from a file (JSON or YAML): the Ray Serve config that "
                        "fitserve plan capacity --emit-ray-config writes, or its args alone "
                        "({groups: [{name, num_replicas, num_cpus, capacity, model?, engine?}], "
                        "canary?}); the command line's engine flags are each group's defaults")
    g.add_argument("--replica-cpus", type=float, default=1.0, metavar="CPUS",
                   help="CPUs Ray reserves for each replica; the engine runs that many torch threads")
    g.add_argument("--replica-capacity", type=float, default=None, metavar="UNITS",
                   help="capacity units the router weighs each replica by (default: its threads)")
    g.add_argument("--routing", default="affinity", choices=ROUTING_MODES,
                   help="affinity: prompt-prefix affinity under a load bound (the default); "
                        "round-robin; least-load: fewest in-flight requests per capacity unit. "
                        "A request may ask for another with the header X-Fitserve-Routing")
    g.add_argument("--routing-balance", type=float, default=4.0, metavar="REQS",
                   help="affinity's load bound: a replica holding the prefix is chosen while its "
                        "in-flight requests per capacity unit are within this of the least loaded")


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
