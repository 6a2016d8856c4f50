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
