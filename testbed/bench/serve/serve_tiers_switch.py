"""The switch of `testbed bench serve --tiers`: `switchd run` (the same options, the same
daemon) that empties itself on SIGHUP as a restart on fresh maps would find it: every map of the
switch cleared, the ports configured and the admission policy built anew by the daemon's own
start, the program left attached. It prints ``switchd: reset`` when the empty switch serves
again. A restart compiles xdp/kvswitch.c with BCC (7 s on an idle 2-core box, 15-28 s under
load): the benchmark did that for each of its 12 runs.

  python -m testbed.bench.serve.serve_tiers_switch <switchd options> run <run options>
"""
from __future__ import annotations

import signal
import threading


def clear_maps(dp) -> None:
    """Zero every array and empty every hash of ``dp``'s switch, as a fresh start finds them:
    all but the constant CRC table, the replication devmap (the start writes it anew, the
    same) and a per-CPU scratch buffer the program overwrites before reading."""
    from switchd.dataplane import MAP_NAMES
    for name in (*MAP_NAMES, "kv_port_clear"):
        dp.bpf.get_table(name.encode()).clear()


class _Stop(threading.Event):
    """The daemon's stop event, telling whether its loop is between policy steps (waiting)."""
    waiting = False

    def wait(self, timeout=None):
        self.waiting = True
        try:
            return super().wait(timeout)
        finally:
            self.waiting = False


class Resettable:
    """The daemon's policy (its manager: None with the policy off) behind a reset: done at once
    when SIGHUP finds the daemon's loop waiting, else at its next step."""

    def __init__(self, daemon, dp, start):
        self.daemon, self.dp, self.start = daemon, dp, start
        self.manager, self.due = None, False
        daemon.stop = _Stop()
        self.manager = start(daemon, dp)
        signal.signal(signal.SIGHUP, self._signalled)

    def __bool__(self) -> bool:          # the daemon steps it every interval
        return True

    def _signalled(self, *_) -> None:
        self.due = True
        if self.daemon.stop.waiting:     # not inside a step or a read of the maps
            self.reset()

    def reset(self) -> None:
        self.due = False
        clear_maps(self.dp)
        self.manager = self.start(self.daemon, self.dp)
        print("switchd: reset", flush=True)

    def step(self):
        if self.due:
            self.reset()
        return self.manager.step() if self.manager else None


def main(argv: list[str] | None = None) -> None:
    from switchd import cli, daemon
    start = daemon.Daemon._start

    def resettable_start(self, dp):
        if self.s.metrics_port:
            raise daemon.SwitchError("a resettable switch serves no metrics")
        return Resettable(self, dp, start)

    daemon.Daemon._start = resettable_start
    cli.main(argv, prog_name="switchd")


if __name__ == "__main__":
    main()
