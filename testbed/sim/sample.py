"""Sampling the switch tier in time. Past ``switch_budget`` switch-bound fetches the switch
model (switchd's policy loop in Python) runs on a few windows of the run spread over it, each a
stretch of consecutive fetches at the switch's full capacity, fill budget and interval, after a
warm-up stretch whose outcomes are not counted. What the switch serves is then the windows'
share x 1/R (R: their share of the switch-bound fetches), and its effect on the pool links is
exact inside the windows and, outside, the windows' fractional reduction per pool node.

Until #25 the sample was spatial (SHARDS: prefix trees at rate R, a switch of capacity x R):
at 1,024 nodes a 64 GiB switch holds 1,024 blocks of 64 MiB, scaled to 315 at R = 0.31 and to
33 at R = 0.03, with a fill budget of 20 and 2 blocks an interval, and the policy at that size
is not the policy at full size: at one point (1,024 nodes, 64 GiB, sharing 0.5, 200,000
requests) the exact run nets $58.7/h, R = 0.31 $37.2/h and R = 0.03 $18.6/h."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WINDOWS = 4          # windows spread over the run
WARM = 0.25          # share of each window's fetches that only warms the switch up


@dataclass
class Sample:
    sampled: np.ndarray      # per request: its switch outcomes are simulated and counted
    sim: np.ndarray          # per switch-bound fetch: the switch model runs it
    counted: np.ndarray      # per simulated fetch: counted (not warm-up)
    window_of: np.ndarray    # per simulated fetch: its window
    rate: float              # counted share of the switch-bound fetches
    window_secs: np.ndarray  # per second of the run: wholly inside a counted window
    windows: list

    @property
    def exact(self) -> bool:
        return self.rate >= 1.0


def time_windows(req_time: np.ndarray, fetch_t: np.ndarray, nsec: int, budget: int,
                 n_windows: int = WINDOWS, warm: float = WARM) -> Sample:
    """Windows of the switch-bound fetches (times ``fetch_t``, in time order: a fetch's time is
    its request's) holding about ``budget`` fetches in all; every fetch if they fit."""
    n = len(fetch_t)
    if n <= budget:
        return Sample(np.ones(len(req_time), bool), np.ones(n, bool), np.ones(n, bool),
                      np.zeros(n, np.int64), 1.0, np.ones(nsec, bool), [])
    per = budget / n_windows
    bounds = []
    for j in range(n_windows):
        c = (j + 0.5) * n / n_windows
        lo, hi = int(c - per * (1 - warm) / 2), min(n - 1, int(c + per * (1 - warm) / 2))
        w0 = max(0, int(lo - per * warm))
        bounds.append((float(fetch_t[w0]), float(fetch_t[lo]), float(fetch_t[hi])))
    counted_r = np.zeros(len(req_time), bool)
    counted_f = np.zeros(n, bool)
    sim = np.zeros(n, bool)
    window_of = np.full(n, -1, np.int64)
    secs = np.zeros(nsec, bool)
    for j, (tw, ta, tb) in enumerate(bounds):
        counted_r |= (req_time >= ta) & (req_time < tb)
        counted_f |= (fetch_t >= ta) & (fetch_t < tb)    # a fetch has its request's time
        inside = (fetch_t >= tw) & (fetch_t < tb)
        sim |= inside
        window_of[inside] = j
        secs[int(np.ceil(ta)):max(int(np.ceil(ta)), int(tb))] = True
    rate = max(float(counted_f.mean()), 1e-12)
    windows = [{"warm_from_s": round(tw, 3), "from_s": round(ta, 3), "to_s": round(tb, 3)}
               for tw, ta, tb in bounds]
    return Sample(counted_r, sim, counted_f[sim], window_of[sim], rate, secs, windows)
