"""The kv-server's Prometheus metrics as Prometheus practice has them: HELP
strings that do not change between scrapes, counters (rates left to
``rate()``), no empty label values; ``--status`` does not count itself."""

import re
import time

from cxlalloc.kvstore.server.metrics import render
from cxlalloc.kvstore.server.cli import query_status
from tests.kvstore.kvutil import RawClient, key

MiB = 1 << 20
BLOCK = 64 << 10


def _help(text):
    return sorted(line for line in text.splitlines() if line.startswith("# HELP"))


def test_metrics_are_stable_counters_without_empty_labels(kv_server):
    srv = kv_server(quotas={"": 4 * MiB, "t": 8 * MiB})
    c = RawClient(srv.socket_path)
    for ns in ("", "t"):  # the default namespace and a named one
        r = c.call("reserve", ns=ns, keys=[key(1)], nbytes=BLOCK, tokens=16)
        c.call("commit", res=r["res"])
        c.call("lookup", ns=ns, keys=[key(1), key(2)])
    first = render(srv.stats())
    time.sleep(1.2)  # the rate window moves on
    c.call("lookup", ns="t", keys=[key(1)])
    second = render(srv.stats())
    assert _help(first) == _help(second)
    assert not re.search(r"\d+\.\d+ s\b", "\n".join(_help(first)))  # no measured number in a HELP string
    assert "_per_second" not in first
    assert 'cxlalloc_kv_load_bytes_total{tier="pool"}' in first
    assert not re.search(r'=""', first), [line for line in first.splitlines() if '=""' in line]
    from prometheus_client.parser import text_string_to_metric_families

    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(first) for s in fam.samples}
    assert all(v != "" for (_, labels) in samples for _, v in labels)
    ns = lambda n: (("namespace", n),)  # noqa: E731
    assert samples["cxlalloc_kv_namespace_used_bytes", ns("(default)")] == BLOCK
    assert samples["cxlalloc_kv_namespace_used_bytes", ns("t")] == BLOCK
    assert samples["cxlalloc_kv_namespace_quota_bytes", ns("(default)")] == 4 * MiB
    assert re.search(r"^cxlalloc_kv_rate_window_seconds \d", first, re.M)
    c.close()


def test_status_does_not_count_its_own_connection(kv_server):
    srv = kv_server()
    assert query_status(srv.socket_path)["server"]["clients"] == 0
    c = RawClient(srv.socket_path)
    c.call("ping")
    st = query_status(srv.socket_path)
    assert st["server"]["clients"] == 1 and len(st["clients"]) == 1
    assert "cxlalloc_kv_clients 1.0" in render(st)
    c.close()


def _scrape(port):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_hardening_counters_are_scraped_from_metrics(kv_server, redis_server, sockdir):
    """Each hardening limit, broken once, moves its own series on /metrics (scraped over HTTP): --hello-timeout,
    --idle-timeout, --max-items, --max-objects, --max-clients-per-uid (as root: a second uid), --max-reserve,
    a corrupt block dropped, a Redis value over --redis-max-value; the limits themselves are gauges (user trial:
    none of these was exported)."""
    import os
    import socket
    import subprocess
    import sys

    import msgpack

    from cxlalloc.kvstore import protocol as P
    from cxlalloc.kvstore.keys import namespaced_key
    from cxlalloc.kvstore.server.metrics import MetricsExporter
    from cxlalloc.kvstore.tiers.redis import RedisTier
    from tests.kvstore.kvutil import ROOT, subprocess_env

    rs = redis_server()
    tier = RedisTier(rs.url, prefix="m:", max_value_bytes=MiB)
    srv = kv_server(redis=tier, hello_timeout=0.5, idle_timeout=1.0, max_items=100, max_objects=50,
                    max_clients_per_uid=1, max_reserve_bytes=BLOCK, max_pinned=BLOCK, socket_mode=0o666)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exp = MetricsExporter(srv.stats, port=port).start()
    try:
        before = _scrape(port)
        reason = lambda r: ("cxlalloc_kv_refused_connections_total", (("reason", r),))  # noqa: E731
        assert before[reason("hello_timeout")] == 0 and before[("cxlalloc_kv_limit", (("limit", "max_items"),))] == 100
        silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # connects, never says hello
        silent.connect(srv.socket_path)
        idle = RawClient(srv.socket_path, want_fd=False)  # says hello, then nothing
        time.sleep(1.6)
        silent.close()
        idle.close()
        c = RawClient(srv.socket_path, want_fd=False)
        c.P.send_msg(c.sock, {"op": "lookup", "ns": "", "keys": [key(i) for i in range(150)]})  # 150 > --max-items
        assert c.P.recv_msg(c.sock)[0]["code"] == "bad_request"
        c.close()
        c = RawClient(srv.socket_path, want_fd=False)
        nested = msgpack.packb({"op": "ping", "x": [[[]] for _ in range(60)]})  # 121 containers > --max-objects
        c.sock.sendall(P._LEN.pack(len(nested)) + nested)
        assert c.P.recv_msg(c.sock)[0]["code"] == "bad_request"
        c.close()
        c = RawClient(srv.socket_path, want_fd=False)
        r = c.call("reserve", ns="", keys=[key(1), key(2)], nbytes=BLOCK, tokens=16)  # one fits the budget
        c.call("commit", res=r["res"])  # zeros, not a sealed block: a reader finds it corrupt
        assert c.call("reserve", ns="", keys=[key(3)], nbytes=2 * BLOCK, tokens=16)["code"] == "limit"
        lease = c.call("lookup", ns="", keys=[key(1)])["lease"]  # pins BLOCK: all of its --max-pinned
        assert c.call("lookup", ns="", keys=[key(1)])["code"] == "limit"
        c.call("release", leases=[lease])
        assert c.call("discard", ns="", keys=[key(1)])["dropped"] == 1
        rs.client().setrange("m:" + namespaced_key("", key(7)).hex(), 2 * MiB - 1, b"x")  # planted, too large
        assert c.call("lookup", ns="", keys=[key(7)])["ok"]
        c.close()
        if os.geteuid() == 0:  # a second uid: its second connection is over --max-clients-per-uid 1
            other = ("import os, sys\nfrom tests.kvstore.kvutil import RawClient\n"
                     "import cxlalloc.kvstore.protocol, msgpack, mmap, hashlib\n"
                     "os.setgid(65534); os.setuid(65534)  # after the imports: the checkout may be unreadable\n"
                     "cs = [RawClient(sys.argv[1], want_fd=False) for _ in range(2)]\n"
                     "print(' '.join('ok' if c.hello.get('ok') else c.hello['code'] for c in cs))")
            out = subprocess.run([sys.executable, "-c", other, srv.socket_path], cwd=ROOT, env=subprocess_env(),
                                 capture_output=True, text=True, timeout=30)
            assert out.stdout.split() == ["ok", "limit"], out.stdout + out.stderr
        after = _scrape(port)
    finally:
        exp.stop()
    moved = lambda k: after[k] - before.get(k, 0)  # noqa: E731
    assert moved(reason("hello_timeout")) == 1 and moved(reason("idle_timeout")) == 1
    assert moved(reason("timeout")) == 0  # the two closes are not counted again as --frame-timeout
    assert moved(reason("max_items")) == 1 and moved(reason("max_objects")) == 1 and moved(reason("bad_frame")) == 0
    assert moved(reason("per_uid")) == (1 if os.geteuid() == 0 else 0) and moved(reason("max_clients")) == 0
    assert moved(("cxlalloc_kv_refused_reserves_total", ())) == 1
    assert moved(("cxlalloc_kv_reserve_budget_blocks_total", ())) == 1  # key(2); key(3)'s reserve was refused whole
    assert moved(("cxlalloc_kv_refused_lookups_total", ())) == 1
    assert moved(("cxlalloc_kv_pin_budget_blocks_total", ())) == 1
    assert moved(("cxlalloc_kv_corrupt_blocks_total", ())) == 1
    assert moved(("cxlalloc_kv_redis_refused_values_total", (("reason", "too_large"),))) == 1
    assert after[("cxlalloc_kv_lock_hold_seconds_max", ())] > 0
    assert after[("cxlalloc_kv_limit", (("limit", "max_pinned"),))] == BLOCK
    assert after[("cxlalloc_kv_limit", (("limit", "hello_timeout_s"),))] == 0.5
    assert after[("cxlalloc_kv_buffered_peak_bytes", ())] > 0
    tier.close()
