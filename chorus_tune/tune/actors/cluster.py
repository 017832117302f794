"""Where the singletons live on a Ray cluster (docs/design.md D14).

Buckets go wherever Ray's scheduler puts them (their GPUs decide). The pool
is the one actor of chorus_tune that must not move: it is pinned to the head
node, as Ray Serve pins its controller. The head holds Ray's GCS, so losing
it ends the cluster anyway; a pool on a worker node would add one more node
whose loss ends the sweep. (An actor that asks for no resources, as the pool
does, lands on a random node under Ray's ``"DEFAULT"`` strategy: measured on a
head and two workers, 6 of 8 such actors went to the workers.)
"""
from __future__ import annotations

from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

# Ray gives the head node this resource, and no other node (ray._common.constants).
HEAD_NODE_RESOURCE = "node:__internal_head__"


def head_node_id() -> str | None:
    """The id of the cluster's head node, or ``None`` if no alive node says it is the head."""
    for node in ray.nodes():
        if node.get("Alive") and HEAD_NODE_RESOURCE in node.get("Resources", {}):
            return node["NodeID"]
    return None


def pool_scheduling_strategy() -> Any:
    """The pool's ``scheduling_strategy``: the head node, hard (never a worker)."""
    head = head_node_id()
    return "DEFAULT" if head is None else NodeAffinitySchedulingStrategy(node_id=head, soft=False)


def node_cpus() -> dict[str, float]:
    """CPUs of every alive node, by node id."""
    return {node["NodeID"]: float(node.get("Resources", {}).get("CPU", 0))
            for node in ray.nodes() if node.get("Alive")}
