"""A fleet in a box: N nodes in network namespaces, a router, traffic and faults (docs/fleet.md).

``python scripts/fleet.py --nodes 6 --minutes 3 --seed 1`` runs it (as root); the modules here are
its parts: ``netns`` (namespaces, bridge, link faults), ``engine`` (an engine process that
registers shm KV with its node's daemon and answers the router), ``router`` (the router, on
``kvd_client.aio`` only), ``faults``, ``checks`` (the invariants) and ``run`` (the orchestrator).
"""
