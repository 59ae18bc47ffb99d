"""Replicas of the engine behind one OpenAI-compatible ingress, on Ray Serve (``fitserve[ray]``).

``fitserve serve MODEL --replicas N`` and :func:`fitserve.fleet.builder.build_fitserve_app` run
N Ray Serve replicas, each a whole fitserve server (engine loop + app) sized for the CPUs Ray
gives it, behind an ingress that forwards every route; a Ray Serve ``RequestRouter``
(:mod:`fitserve.fleet.router`) picks the replica by prompt-prefix affinity, load and capacity.

Ray is imported only by the modules that need it (router, replica, ingress, builder, launch):
this package's ``__init__`` and its pure parts (routing, request, args) import without it.
"""
