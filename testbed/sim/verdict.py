"""What a validation calls agreement between the live testbed and the cluster model, one rule for
every `sim validate` (the trace, --serve, --serve --racks): a share (a hit ratio, the split of
fetched chunks between switch hits and held replicas) agrees when the model is within
``RELATIVE`` of the measured share, or ``FLOOR`` absolute where the share is too small for a
relative bound to mean anything; a time (TTFT) agrees when within its own relative bound. An
absolute bound alone (3 pp) passed a model that said 0.02 of a measured 0.049. Shares that agree
by construction (what the model computes from the others, or takes from the workload) are shown
as such and never counted as agreement."""
from __future__ import annotations

RELATIVE = 0.20                      # a share: within 20 % of the measured share ...
FLOOR = 0.01                         # ... or 1 percentage point, whichever is more
BY_CONSTRUCTION = "by construction"  # how a share the model cannot get wrong is reported


def share_bound(measured: float) -> float:
    """The largest difference a share may have from ``measured`` and still agree."""
    return max(RELATIVE * abs(measured), FLOOR)


def share_agrees(measured: float | None, model: float | None) -> bool:
    """Whether the model's share agrees with the measured one (both must exist)."""
    if measured is None or model is None:
        return False
    return abs(model - measured) <= share_bound(measured) + 1e-12


def relative_agrees(measured: float | None, model: float | None, bound: float) -> bool:
    """Whether ``model`` is within ``bound`` (relative) of ``measured``."""
    if not measured or model is None:
        return False
    return abs(model / measured - 1) <= bound + 1e-12
