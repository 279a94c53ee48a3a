"""The PUT abuse of issue #26 against a real pool node, and what it does to another tenant.

``hog`` runs in one inference node (namespace 2, its own source address): many incomplete blocks,
blocks sent but for their last chunk until its namespace's budget is full, a block of one-byte
chunks, then chunk 0 of every incomplete block re-sent every second; first of all a complete block
of 64,000 one-byte chunks (the slot hog). ``run_scenario`` starts a testbed (no switch: the pool
node's own XDP program serves), the hog, and meanwhile has another node (namespace 1) PUT and GET
blocks with ``hostagent``; it returns the other tenant's PUT successes, the share of its chunks the
pool's XDP program answered, the pool process's memory growth per byte its assembler charged, and
the pool's counters. Used by tests/test_serve_xdp.py; run as a script it writes the figures with the
pool's default budgets:

    .venv/bin/python tests/pool_abuse.py --json bench/results/pool-put-abuse.json
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HOG = r"""
import socket, sys, time, json
from kvproto import Message, Op, PORT
pool, seconds, bulk_blocks, bulk_chunks, incomplete, tiny = json.loads(sys.argv[1])
sys.stdout.reconfigure(line_buffering=True)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
s.setblocking(False)
sent, acked, done = 0, set(), False
def drain():
    global done
    while True:
        try:
            m = Message.decode(s.recv(2048))
        except BlockingIOError:
            return
        except Exception:
            continue
        if m.op == Op.PUT_ACK and m.key == dk:
            acked.add(m.chunk)
            done = done or bool(m.flags & 8)
def put(key, chunk, n, payload):
    global sent
    for _ in range(1000):
        try:
            s.sendto(Message(Op.PUT, 2, key, chunk, n, 7, payload=payload).encode(), (pool, PORT))
            break
        except OSError:
            time.sleep(0.001)
    sent += 1
    if sent % 400 == 0:
        time.sleep(0.008)            # ~50k datagrams/s, about what the pool's process takes
        drain()
dk = b"dense" + bytes(11)
for _ in range(6):                              # a whole block of 64,000 one-byte chunks
    for c in range(64_000):
        if c not in acked:
            put(dk, c, 64_000, bytes([c & 255]))
    time.sleep(0.2)
    drain()
    if done:
        break
print(json.dumps({"dense": sent, "done": done}), flush=True)
keys = [b"inc" + i.to_bytes(13, "big") for i in range(incomplete)]
bulk = [b"bulk" + i.to_bytes(12, "big") for i in range(bulk_blocks)]
tk = b"tiny" + bytes(12)
for c in range(tiny):                           # one-byte chunks of a 199,999-chunk block
    put(tk, c, 199_999, bytes([c & 255]))
for k in bulk:                                  # all but the last chunk
    for c in range(bulk_chunks - 1):
        put(k, c, bulk_chunks, bytes([c & 255]) * 1024)
for k in keys:                                  # many incomplete blocks
    put(k, 0, 64, bytes(1024))
print(json.dumps({"loaded": sent}), flush=True)
end = time.monotonic() + seconds
again = [(k, 64, bytes(1024)) for k in keys] + [(k, bulk_chunks, bytes(1024)) for k in bulk]
again.append((tk, 199_999, bytes(1)))
while time.monotonic() < end:                   # chunk 0 re-sent: keep-alive attempts
    for k, n, payload in again:
        put(k, 0, n, payload)
    time.sleep(1.0)
print(json.dumps({"sent": sent}), flush=True)
"""


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def run_scenario(prefix: str, pool_args: tuple[str, ...] = (), seconds: float = 15.0,
                 bulk_blocks: int = 3, bulk_chunks: int = 16384, incomplete: int = 400,
                 tiny: int = 50_000, rounds: int = 3, block_bytes: int = 1 << 20,
                 log=print) -> dict:
    from testbed.lab import Lab
    with Lab(prefix, hosts=2, pools=1, switch=False, pool_args=pool_args) as lab:
        pid = lab.pools[0].pid
        pool = lab.pool_addrs[0]
        args = json.dumps([pool, seconds, bulk_blocks, bulk_chunks, incomplete, tiny])
        rss0, c0 = _rss(pid), lab.pool_counters()
        hog = lab.topo.popen("h2", [sys.executable, "-c", HOG, args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        try:
            if not hog.stdout.readline():           # the dense block is in
                raise RuntimeError(f"hog: {hog.stderr.read()[-800:]}")
            loaded = hog.stdout.readline()          # every phase sent once
            if not loaded:
                raise RuntimeError(f"hog: {hog.stderr.read()[-800:]}")
            time.sleep(1.0)
            peak, rss1 = lab.pool_counters(), _rss(pid)
            log(f"hog loaded ({loaded.strip()}): assembling {peak['assembling_bytes']} bytes "
                f"in {peak['assembling_blocks']} blocks, pool RSS +{rss1 - rss0} bytes")
            puts = gets = exact = chunks = 0
            before = lab.pool_counters()
            for r in range(rounds):                  # the other tenant, meanwhile
                key, data = os.urandom(16), os.urandom(block_bytes - 1000 * r)
                try:
                    lab.put("h1", 1, key, data)
                    puts += 1
                except Exception as exc:             # (a refused PUT exits non-zero)
                    log(f"tenant 1 PUT failed: {exc}")
                    continue
                stats, got = lab.get("h1", 1, key)
                gets += 1
                exact += got == data
                chunks += stats["chunks"]
            after = lab.pool_counters()
            xdp = after.get("xdp_hit", 0) - before.get("xdp_hit", 0)
            hog_out, hog_err = hog.communicate(timeout=seconds + 300)
            if hog.returncode:
                raise RuntimeError(f"hog: {hog_err[-800:]}")
            end = lab.pool_counters()
        finally:
            if hog.poll() is None:
                hog.kill()
                hog.wait()
    charged = peak["assembling_bytes"] - c0.get("assembling_bytes", 0)
    out = {
        "pool_args": list(pool_args),
        "hog": {"datagrams": json.loads(hog_out.strip().splitlines()[-1])["sent"],
                "incomplete_blocks": incomplete, "bulk_blocks": bulk_blocks,
                "bulk_chunks": bulk_chunks, "tiny_chunks": tiny, "dense_chunks": 64_000},
        "other_tenant": {"puts": puts, "of": rounds, "gets": gets, "byte_exact": exact,
                         "chunks": chunks, "xdp_answered": xdp,
                         "xdp_share": xdp / chunks if chunks else 0.0},
        "peak": {k: peak.get(k, 0) for k in ("assembling_bytes", "assembling_payload_bytes",
                                             "assembling_blocks")},
        "pool_rss_growth": rss1 - rss0,
        "rss_per_charged_byte": (rss1 - rss0) / charged if charged else None,
        "end": {k: end.get(k, 0) for k in (
            "assembling_bytes", "assembling_payload_bytes", "assembling_blocks", "expired_blocks",
            "refused_ns",
            "refused_source", "refused_total", "refused_too_large", "reclaimed_blocks",
            "resent_chunks", "err_no_space", "err_bad_request", "xdp_published",
            "xdp_unpublished", "xdp_dense_refused", "xdp_dense_slots_used", "staged_blocks")},
    }
    return out


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--pool-arg", action="append", default=[],
                    help="an argument for hostagent serve (repeatable)")
    ap.add_argument("--seconds", type=float, default=15.0,
                    help="how long the hog re-sends chunk 0s once it has sent the rest")
    ap.add_argument("--bulk-blocks", type=int, default=9)
    ap.add_argument("--no-xdp", action="store_true",
                    help="the pool serves from Python (HOSTAGENT_XDP_SERVE=0): its memory growth "
                         "is then not hidden by the heap BCC's compile leaves free")
    a = ap.parse_args()
    if a.no_xdp:
        os.environ["HOSTAGENT_XDP_SERVE"] = "0"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = run_scenario(f"pa{os.getpid() % 100000}", tuple(a.pool_arg), a.seconds,
                          a.bulk_blocks, rounds=5)
    text = json.dumps(result, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")
