"""How long requests wait before the scheduler first runs them.

Measured where it happens, in the scheduler, at a request's first admission (not
after a preemption), against the arrival time the front end stamped. Kept as a
fixed-bucket histogram so `get_stats` can hand it to a metrics endpoint at any time.
"""

from __future__ import annotations

import bisect

# Upper bounds in seconds, as vLLM's dashboards bucket request queue time.
QUEUE_TIME_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                      50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class QueueTimeHistogram:
    def __init__(self) -> None:
        self.counts = [0] * (len(QUEUE_TIME_BUCKETS) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)  # clocks of two processes may differ by a hair
        self.counts[bisect.bisect_left(QUEUE_TIME_BUCKETS, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def cumulative(self) -> list[int]:
        """Counts of observations <= each bound, then the total (Prometheus's `le`)."""
        out, total = [], 0
        for c in self.counts:
            total += c
            out.append(total)
        return out
