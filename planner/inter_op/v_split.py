"""ZB-V's layer split: device 0 runs the first chunk (with the embedding) and the last (with
the LM head), every other device two middle chunks, so balancing chunks, as the stage DP
does, leaves device 0 the slowest. This split balances devices instead: it tries every
layer count for the two end chunks (one layer up to one more than an even share each), splits
the middle layers evenly over the other chunks, and keeps the split whose slowest device
(the sum of its two chunks) is fastest. Time alone: predict() checks memory."""

from __future__ import annotations

import numpy as np

from planner.evaluate.config import split_layers
from planner.inter_op.stage_dp import StageCosts


def v_ranges(inputs: StageCosts, pp: int) -> list[tuple[int, int]] | None:
    n, chunks = inputs.num_layers, 2 * pp
    if n < chunks:
        return None
    t = np.concatenate([[0.0], np.cumsum(np.asarray(inputs.layer_time, float))])
    widest = n // chunks + 1
    best, best_key = None, None
    for first in range(1, widest + 1):
        for last in range(1, widest + 1):
            middle = n - first - last
            if middle < chunks - 2:
                continue
            ranges = [(0, first)]
            ranges += [(first + a, first + b) for a, b in split_layers(middle, chunks - 2)]
            ranges.append((n - last, n))
            times = [t[b] - t[a] for a, b in ranges]
            times[0] += inputs.first_time
            times[-1] += inputs.last_time
            slowest = max(times[d] + times[chunks - 1 - d] for d in range(pp))
            key = (slowest, abs(first - last))
            if best_key is None or key < best_key:
                best, best_key = ranges, key
    return best
