"""``bench --only kvscale``: the kv-server's costs at 10^4, 10^5 and 10^6 stored
blocks (lookup latency, the stall a disconnect causes to other clients, index
bytes per block), and their plot.  Its processes and helpers are the other
kv-server benchmarks' (:mod:`cxlalloc_apps.bench.kvprocs`)."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from typing import Any, Dict

from cxlalloc_apps.bench.kvprocs import _median, _pct, _Server, block_key, raw_client

# ----------------------------------------------------------------- scale: costs at 10^4..10^6 blocks
SCALE_SIZES = (10_000, 100_000, 1_000_000)
SCALE_BLOCK = 4096          # bytes: one page per block, the smallest slot, so 10^6 blocks fit a 4 GB sparse pool


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _raw(path: str, name: str):
    # a commit of 16,384 blocks on a loaded 2-core machine: seconds, not minutes
    return raw_client(path, name, timeout=600)


class _ScanEntry:
    __slots__ = ("key", "offset", "state", "writer")

    def __init__(self, key: bytes, offset: int):
        self.key, self.offset, self.state, self.writer = key, offset, "ready", None


def _scan_ms(n: int) -> float:
    """What a disconnect cost before per-owner sets: one pass over every entry
    of a key -> entry dict of ``n`` blocks, looking for the owner's WRITING
    ones (ms, in this process; the old ``drop_owner`` did exactly this)."""
    entries = {block_key(1, j, b"scan"): _ScanEntry(b"", j * SCALE_BLOCK) for j in range(n)}
    t0 = time.perf_counter()
    [e for e in entries.values() if e.state == "writing" and e.writer == "gone"]
    return (time.perf_counter() - t0) * 1e3


def part_scale(ctx, w, work: str) -> None:
    """Lookup latency, the stall a disconnect causes to another client's
    lookups, and index memory per block, at 10^4, 10^5 and 10^6 stored blocks."""
    import threading

    sizes = SCALE_SIZES[:2] if ctx.quick else SCALE_SIZES
    for n in sizes:
        if ctx.deadline.expired():
            w.skip(f"scale:{n}", "time budget used up")
            continue
        pool = -(-(n + 4096) * SCALE_BLOCK // (256 << 20)) * (256 << 20)
        srv = _Server(work, ["--size", str(pool), "--chunk", "256MiB", "--max-reserve", "100%"], f"s{n}.sock").start()
        try:
            rss0 = _rss(srv.proc.pid)
            ws, wcall = _raw(srv.socket, "writer")
            keys = [block_key(0, j, b"scale") for j in range(n)]
            t0 = time.perf_counter()
            for i in range(0, n, 16384):
                r = wcall("reserve", ns="", keys=keys[i:i + 16384], nbytes=SCALE_BLOCK, tokens=64)
                wcall("commit", res=r["res"])
            fill_s = time.perf_counter() - t0
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:  # let the background placement check finish (it maps nothing)
                p = srv.status()["pool"]
                if (p["placement_verified_bytes"] + p["placement_unverified_bytes"] + p["placement_skipped_bytes"]
                        + p["placement_misplaced_bytes"]) >= p["stored_blocks"] * SCALE_BLOCK:
                    break
                time.sleep(0.2)
            time.sleep(0.5)
            st = srv.status()
            rss1 = _rss(srv.proc.pid)
            ps, pcall = _raw(srv.socket, "probe")
            rng = random.Random(n)

            def probe_lookup() -> float:
                j = rng.randrange(n - 16)
                t = time.perf_counter()
                r = pcall("lookup", ns="", keys=keys[j:j + 16])
                dt = time.perf_counter() - t
                pcall("release", leases=[r["lease"]])
                return dt

            lat = [probe_lookup() for _ in range(300 if ctx.quick else 1000)]
            # Disconnects under load: a client pins 64 blocks and holds 64 reservations, then closes,
            # while the probe keeps looking up; its slowest lookup around each close is the stall.
            stalls, quiet = [], []
            for rep in range(10 if ctx.quick else 20):
                xs, xcall = _raw(srv.socket, f"leaver{rep}")
                j = rng.randrange(n - 64)
                xcall("lookup", ns="", keys=keys[j:j + 64])
                xcall("reserve", ns="", keys=[block_key(rep + 1, k, b"leave") for k in range(64)],
                      nbytes=SCALE_BLOCK, tokens=64)
                for closing in (False, True):  # the same window without, then with, the disconnect
                    window = []
                    stop = threading.Event()

                    def loop():
                        while not stop.is_set():
                            window.append(probe_lookup())

                    th = threading.Thread(target=loop)
                    th.start()
                    time.sleep(0.02)
                    if closing:
                        xs.close()
                    time.sleep(0.15)
                    stop.set()
                    th.join()
                    (stalls if closing else quiet).append(max(window))
            after = srv.status()["pool"]
            ws.close()
            ps.close()
        finally:
            srv.stop()
        w.add({"part": "scale", "blocks": n, "block_bytes": SCALE_BLOCK, "pool_bytes": pool, "fill_s": fill_s,
               "fill_blocks_per_s": n / fill_s, "lookup16_ms_p50": 1e3 * _median(lat),
               "lookup16_ms_p99": 1e3 * _pct(lat, 0.99), "lookup16_ms_max": 1e3 * max(lat),
               "disconnect_stall_ms_max": 1e3 * max(stalls), "disconnect_stall_ms_median": 1e3 * _median(stalls),
               "quiet_window_ms_max": 1e3 * max(quiet), "quiet_window_ms_median": 1e3 * _median(quiet),
               "server_drop_lock_ms_max": after["drop_ms_max"],
               "disconnects": len(stalls), "dropped_pins": after["dropped_pins"],
               "aborted_blocks": after["aborted_blocks"],
               "index_bytes_per_block": st["pool"]["index_bytes_per_block"],
               "server_rss_growth_bytes_per_block": (rss1 - rss0) / n,
               "committed_bytes": st["pool"]["committed_bytes"],
               "scan_all_entries_ms": _scan_ms(n),
               "method": "a real kv-server process; one raw-protocol client reserves and commits n blocks of 4 KiB "
                         "(never written: the sparse pool stays uncommitted); a probe client times lookup of 16 "
                         "stored keys (one round trip; its release is not timed); then 20 times a client pins 64 "
                         "blocks and holds 64 reservations and closes its socket while the probe loops: the "
                         "probe's slowest lookup in the 0.17 s around the close is that disconnect's stall; "
                         "quiet_window_*: the slowest lookup of an equal window just before, without a close (the "
                         "noise floor of this shared machine); server_drop_lock_ms_max: the longest the server held "
                         "its lock dropping a client (its own clock). index_bytes_per_block: the server's stats (sys.getsizeof of the "
                         "entry, key, offset and hash-table share); server_rss_growth_bytes_per_block: VmRSS after "
                         "the fill minus before, per block (includes the allocator's slack). scan_all_entries_ms: "
                         "one pass over every entry, what each disconnect cost before per-owner sets (measured in "
                         "the benchmark process over a dict of as many entries)."})


def run_scale(ctx) -> Dict[str, Any]:
    """``bench --only kvscale``: :func:`part_scale` in its own record (``kvscale.json``)."""
    from cxlalloc_apps.bench.meta import RecordWriter, new_record

    params = {"parts": ["scale"], "quick": ctx.quick, "sizes": list(SCALE_SIZES[:2] if ctx.quick else SCALE_SIZES),
              "units": "ms, bytes, blocks/s",
              "where": "CPU (the kv-server never touches a GPU); a shared 2-core machine: stalls include its noise"}
    w = RecordWriter(ctx.out_dir, new_record("kvscale", params, True, ctx.argv, ctx.device))
    work = tempfile.mkdtemp(prefix="kvscale-", dir="/tmp")
    try:
        try:
            part_scale(ctx, w, work)
        except Exception as e:
            import traceback

            w.error("scale", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rec = w.finish()
    try:
        plot_scale(rec, os.path.join(ctx.out_dir, "kvscale.png"))
    except ImportError:
        pass
    return rec


def plot_scale(rec: Dict[str, Any], path: str) -> None:
    """Stall, lookup latency and bytes per block against stored blocks (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rec["results"] if r.get("part") == "scale"]
    if not rows:
        return
    xs = [r["blocks"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(xs, [r["server_drop_lock_ms_max"] for r in rows], "D-", label="server lock held by a disconnect, max")
    a.plot(xs, [r["disconnect_stall_ms_max"] for r in rows], "o-", label="probe's slowest lookup around a disconnect")
    a.plot(xs, [r["quiet_window_ms_max"] for r in rows], "o--", label="the same without a disconnect (noise)")
    a.plot(xs, [r["lookup16_ms_p99"] for r in rows], "s-", label="lookup of 16 keys, p99")
    a.plot(xs, [r["scan_all_entries_ms"] for r in rows], "x:", label="one scan of every entry (the old disconnect)")
    a.set_yscale("log")
    b.plot(xs, [r["index_bytes_per_block"] for r in rows], "o-", label="index (stats)")
    b.plot(xs, [r["server_rss_growth_bytes_per_block"] for r in rows], "s-", label="server RSS growth")
    for ax, goal, unit, title in ((a, 5.0, "ms", "kv-server: latency seen by another client"),
                                  (b, 256, "bytes per block", "memory per block")):
        ax.axhline(goal, color="grey", lw=0.8, ls=":")  # the ticket's goal
        ax.set_xscale("log")
        ax.set_xlabel("blocks stored")
        ax.set_ylabel(unit)
        ax.legend(fontsize=8)
        ax.set_title(title)
    cpu = rec["hardware"].get("cpu") or {}
    fig.suptitle(f"{cpu.get('model', 'CPU')}, {rec['date_utc']} (a 2-core machine shared with other jobs; CPU only)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


run = run_scale
