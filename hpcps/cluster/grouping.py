"""Groups of similar speed (``--group-by speed``, ``--groups auto``): pure arithmetic, no MPI.

Basu et al. balance stragglers against staleness by grouping workers: a
group runs at the pace of its slowest member. Contiguous rank blocks put a
straggler with fast peers and slow them all down; grouping by measured
speed puts it only with slow peers (or alone), so the fast groups keep
their pace and the central server hears from them as often as without the
straggler.

:func:`speed_groups` sorts the workers by their measured iteration time and
cuts the sorted list into G contiguous blocks, choosing the cuts that
minimise the spread of log-times within blocks (optimal one-dimensional
k-means, by dynamic programming; N is small). Logs, because speed is a
ratio: 10 ms against 40 ms is as far apart as 1 s against 4 s.
"""

from __future__ import annotations

import math
from typing import Mapping


def speed_groups(times: Mapping[int, float], n_groups: int) -> list[list[int]]:
    """Ranks grouped by similar ``times`` (seconds per iteration), fastest group first.

    Every group gets at least one rank; ranks within a group are ascending.
    Ties are broken by rank, so every caller computes the same groups.
    """
    if not 1 <= n_groups <= len(times):
        raise ValueError(f"need 1 <= groups <= workers (got {n_groups} groups, {len(times)} workers)")
    if any(not t > 0 for t in times.values()):
        raise ValueError("iteration times must be positive")
    order = sorted(times, key=lambda r: (times[r], r))
    x = [math.log(times[r]) for r in order]
    n = len(x)
    prefix, prefix_sq = [0.0], [0.0]
    for v in x:
        prefix.append(prefix[-1] + v)
        prefix_sq.append(prefix_sq[-1] + v * v)

    def cost(i: int, j: int) -> float:  # squared deviation of x[i:j] from its mean
        s, m = prefix[j] - prefix[i], j - i
        return max(0.0, prefix_sq[j] - prefix_sq[i] - s * s / m)

    # best[g][j]: least cost of cutting x[:j] into g blocks; cut[g][j]: where the last block starts
    best = [[math.inf] * (n + 1) for _ in range(n_groups + 1)]
    cut = [[0] * (n + 1) for _ in range(n_groups + 1)]
    best[0][0] = 0.0
    for g in range(1, n_groups + 1):
        for j in range(g, n + 1):
            for i in range(g - 1, j):
                c = best[g - 1][i] + cost(i, j)
                if c < best[g][j] - 1e-12:
                    best[g][j], cut[g][j] = c, i
    blocks, j = [], n
    for g in range(n_groups, 0, -1):
        i = cut[g][j]
        blocks.append(sorted(order[i:j]))
        j = i
    return blocks[::-1]
