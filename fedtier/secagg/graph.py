"""The cell's sharing graph: who masks with and holds shares for whom (SecAgg+'s sparse graph).

Bell et al. (2020) replace SecAgg's complete graph with a random graph of degree O(log n): a
device masks with, and shares its secrets among, its neighbours only, so its work and traffic
grow with the degree instead of the cell size. We use their construction: a Harary graph
(each node linked to the ``degree / 2`` nodes on either side of it on a ring) over a random
permutation of the members. The permutation comes from a public seed (rollout seed, rollout,
round), so every member and the edge compute the same graph, and the edge cannot choose it.
A degree at or above ``len(members) - 1`` gives the complete graph (SecAgg).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from fedtier.rng import stream


def neighbours(members: Sequence[str], degree: int, seed: int, *labels: str | int) -> Mapping[str, frozenset[str]]:
    """Each member's neighbours: ``degree`` of them (rounded up to even) or everyone else."""
    ids = sorted(members)
    n = len(ids)
    if degree >= n - 1:
        return {m: frozenset(ids) - {m} for m in ids}
    half = (degree + 1) // 2
    order = [ids[i] for i in stream(seed, "secagg_graph", *labels).permutation(n)]
    links: dict[str, set[str]] = {m: set() for m in ids}
    for pos, node in enumerate(order):
        for d in range(1, half + 1):
            other = order[(pos + d) % n]
            links[node].add(other)
            links[other].add(node)
    return {m: frozenset(v) for m, v in links.items()}
