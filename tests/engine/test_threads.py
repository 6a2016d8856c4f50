"""Threads allocating and reading their memory while migrations are on.

A move between tiers unmaps an address for a moment (VMM cannot replace a
mapping in place); a read of it then faults, in the simulator exactly as on a
GPU (where it kills the CUDA context).  Implicit moves (those the policy
chooses because of another request) therefore wait for the thread that owns
the memory (csrc/alloc/device_allocator_owners.cpp, docs/DESIGN.md
"Threads").  The workload runs in a child process, so a fault fails the test
instead of killing pytest.
"""

import ctypes
import json
import os
import subprocess
import sys
import threading
import time

import pytest

MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def workload(threads: int, seconds: float, implicit_moves: str = "owner") -> dict:
    """Each thread owns a KV extent it grows and a few "other" blocks; it
    writes its own byte into everything it owns and reads all of it back
    through the raw pointers, again and again.  Other threads' allocations
    push VRAM over its limit, so the policy wants to demote KV all the time.
    Returns the allocator's stats and what each thread saw."""
    import cxlalloc

    a = cxlalloc.Allocator(simulate=True, device_limit=48 * MiB, host_limit=512 * MiB, device_headroom=0,
                           promote_after=1, implicit_moves=implicit_moves)
    errors, reads = [], [0] * threads
    stop = time.monotonic() + seconds

    def check(p, n, byte, what="block"):
        data = ctypes.string_at(p, n)  # every byte: a read of an unmapped page faults here
        if data.count(byte) != n:
            raise AssertionError(f"thread {byte[0]}: {n - data.count(byte)} of {n} bytes of its {what} at {p:#x} are not its own; first bad offset {next(k for k, x in enumerate(data) if x != byte[0])}, value {data[next(k for k, x in enumerate(data) if x != byte[0])]}")

    def worker(i):
        import random

        rng = random.Random(i)
        me = bytes([i + 1])
        ext = a.extent(24 * MiB)
        size = 0
        blocks = []
        try:
            # Past `stop`, until an owner has carried out a queued move (how
            # soon one is queued depends on the threads' interleaving).
            while time.monotonic() < stop or (time.monotonic() < stop + 10
                                              and a.stats()["deferred_moves_done"] == 0):
                r = rng.random()
                if r < 0.3 and size < ext.capacity:
                    new = min(ext.capacity, size + rng.choice([MiB, 2 * MiB, 3 * MiB]))
                    ext.grow(new)
                    ctypes.memset(ext.base + size, i + 1, new - size)
                    size = new
                elif r < 0.35 and size:
                    ext.trim(0)
                    size = 0
                elif r < 0.6:
                    n = rng.choice([512 * 1024, 2 * MiB, 5 * MiB])
                    p = a.malloc(n, tag=rng.choice(["other", "weight"]))
                    ctypes.memset(p, i + 1, n)
                    blocks.append((p, n))
                elif blocks:
                    p, n = blocks.pop(rng.randrange(len(blocks)))
                    check(p, n, me)
                    a.free(p)
                if rng.random() < 0.2:
                    ext.touch()
                if size:
                    check(ext.base, size, me, "extent")
                for p, n in blocks:
                    check(p, n, me)
                reads[i] += 1
            ext.touch()  # the owner's last call: carries out what was queued for it
            if size:
                check(ext.base, size, me, "extent")
        except Exception as e:  # reported to the parent
            errors.append(f"{type(e).__name__}: {e}")
        finally:
            for p, _ in blocks:
                a.free(p)
            del ext

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    import gc

    gc.collect()
    a.check_invariants()
    s = a.stats()
    return {"errors": errors, "reads": reads, "demoted_bytes": s["demoted_bytes"], "promoted_bytes": s["promoted_bytes"],
            "deferred_moves": s["deferred_moves"], "deferred_moves_done": s["deferred_moves_done"],
            "allocated": s["device"]["allocated_bytes"] + s["host"]["allocated_bytes"]}


def run_child(threads: int, seconds: float, implicit_moves: str = "owner") -> subprocess.CompletedProcess:
    code = ("import json, sys; sys.path.insert(0, %r); from tests.engine.test_threads import workload; "
            "print(json.dumps(workload(%d, %r, %r)))" % (ROOT, threads, seconds, implicit_moves))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.mark.parametrize("threads", [4, 8])
def test_threads_allocating_and_reading_with_migrations_on_never_fault(threads):
    r = run_child(threads, 3.0)
    assert r.returncode == 0, f"the child died (signal {-r.returncode if r.returncode < 0 else None}): {r.stderr[-2000:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["errors"] == [], out["errors"]
    assert min(out["reads"]) > 0, out
    assert out["allocated"] == 0
    # The moves still happen: the policy wanted other threads' KV out of VRAM
    # (queued), and the owners carried those moves out at their next call.
    assert out["deferred_moves"] > 0, out
    assert out["deferred_moves_done"] > 0, out
    assert out["demoted_bytes"] > 0, out


def test_implicit_moves_option_is_validated():
    import cxlalloc

    with pytest.raises(ValueError, match="implicit_moves.*allowed: owner, any-thread"):
        cxlalloc.Allocator(simulate=True, device_limit=64 * MiB, implicit_moves="sometimes")


# ------------------------------------------------------------------ explicit migrate() and other threads' blocks
def test_migrate_refuses_a_segment_that_holds_another_threads_live_block(make_alloc):
    """Issue 29, item 11: migrate() of a thread's own block used to move the whole segment under another
    thread's live block.  Two small KV blocks share one segment (the block cache splits it); the thread that
    did not allocate the other one may not move it, and may once that block is freed."""
    import cxlalloc

    a = make_alloc(device_limit=64 * MiB, host_limit=256 * MiB)
    mine = a.malloc(64 * 1024, tag="kv")
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("other", a.malloc(64 * 1024, tag="kv")))
    t.start()
    t.join()
    other = box["other"]
    ctypes.memset(other, 7, 64 * 1024)
    assert abs(other - mine) < 2 * MiB, "the two small blocks are expected to share one 2 MiB segment"
    with pytest.raises(cxlalloc.UnsupportedError, match="another thread allocated"):
        a.demote(mine)
    assert a.tier_of(mine) == "device" and ctypes.string_at(other, 64 * 1024) == bytes([7]) * (64 * 1024)
    a.free(other)
    assert a.demote(mine) > 0 and a.tier_of(mine) == "host"  # alone in its segment now: it moves
    a.free(mine)


def stamp_workload(threads: int, seconds: float) -> dict:
    """Each thread allocates small KV blocks (so threads share segments), stamps its byte into them, calls
    migrate() on its own blocks back and forth, and checks every stamp; returns the stamps lost and the
    migrations done and refused."""
    import cxlalloc

    a = cxlalloc.Allocator(simulate=True, device_limit=64 * MiB, host_limit=512 * MiB)
    lost, moved, refused = [0], [0], [0]
    stop = time.monotonic() + seconds

    def worker(i):
        import random

        rng = random.Random(i)
        me, n = bytes([i + 1]), 32 * 1024
        blocks = []
        try:
            while time.monotonic() < stop:
                if len(blocks) < 8:
                    p = a.malloc(n, tag="kv")
                    ctypes.memset(p, i + 1, n)
                    blocks.append(p)
                p = rng.choice(blocks)
                try:
                    moved[0] += a.migrate(p, rng.choice(["host", "device"])) > 0
                except cxlalloc.UnsupportedError:
                    refused[0] += 1
                for q in blocks:
                    if ctypes.string_at(q, n) != me * n:
                        lost[0] += 1
                if rng.random() < 0.3:
                    a.free(blocks.pop(rng.randrange(len(blocks))))
        finally:
            for q in blocks:
                a.free(q)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return {"lost": lost[0], "moved": moved[0], "refused": refused[0]}


def test_four_threads_migrating_their_own_blocks_lose_no_stamp():
    code = ("import json, sys; sys.path.insert(0, %r); from tests.engine.test_threads import stamp_workload; "
            "print(json.dumps(stamp_workload(4, 3.0)))" % ROOT)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, f"the child died (signal {-r.returncode if r.returncode < 0 else None}): {r.stderr[-2000:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["lost"] == 0, out
    # Migrations ran (own segments moved or, where another thread's block shares the segment, refused); which of
    # the two depends on the schedule (CI once gave moved 0, refused 35,506 in 3 s; locally both run), so each path
    # has a deterministic test of its own: test_migrate_refuses_a_segment_that_holds_another_threads_live_block and
    # the single-thread migrate tests (tests/engine/test_extents.py, test_stateful.py).
    assert out["moved"] + out["refused"] > 0, out
