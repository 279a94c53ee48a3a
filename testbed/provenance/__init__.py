"""Where results come from: whether each result file the README and docs cite still measures
the code as it is now (``testbed results-check``).

    gitread   a repository's files at any commit, and the commits of a range with their
              Results-unaffected trailers
    entries   the code a command line runs (a click command's function, a module), and where
              it was before it moved
    depends   what that code imports and loads within the repository (Python, C), derived
    compare   what changed in it between two commits, less trailer-marked moves
    check     the cited results, their stamps, their states; the report"""
from .check import DATED, MADE_BY, Finding, check, render
from .gitread import NotACheckout

__all__ = ["DATED", "MADE_BY", "Finding", "NotACheckout", "check", "render"]
