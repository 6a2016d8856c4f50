"""``cxlalloc kv-server`` on the command line: clear errors, --status, metrics
file, SIGTERM; and the CXLALLOC key that points every process at it."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.kvstore.kvutil import ROOT, subprocess_env as _env


def _run(*args, timeout=30):
    return subprocess.run([sys.executable, "-m", "cxlalloc", "kv-server", *args], capture_output=True, text=True,
                          env=_env(), cwd=ROOT, timeout=timeout)


@pytest.mark.parametrize("args,words", [
    ([], ["'--size': required"]),
    (["--size", "2MiB", "--chunk", "4MiB"], ["'--size'", "below one chunk", "4.00 MiB"]),
    (["--size", "64MiB", "--chunk", "3000"], ["'--chunk'", "multiple of the page size"]),
    (["--size", "lots"], ["'--size'", "not a size"]),
    (["--size", "64MiB", "--numa-node", "99"], ["'--numa-node'", "auto or a node with memory: 0"]),
    (["--size", "64MiB", "--socket-mode", "999"], ["'--socket-mode'", "octal"]),
    (["--size", "64MiB", "--quota", "tenant"], ["'--quota'", "NAMESPACE=SIZE"]),
    (["--size", "64MiB", "--group", "no-such-group-x"], ["'--group'", "no group named"]),
    (["--size", "64MiB", "--redis", "http://127.0.0.1:6379"], ["'--redis'", "redis://host:port/db"]),
    (["--size", "64MiB", "--socket", "/tmp/" + "s" * 120], ["'--socket'", "107 bytes"]),
    (["--size", "64MiB", "--metrics-port", "0"], ["'--metrics-port'", "1-65535"]),
    (["--size", "64MiB", "--redis-option", "ssl"], ["'--redis-option'", "KEY=VALUE"]),
])
def test_bad_options_exit_2_naming_the_option(args, words, sockdir):
    if "--socket" not in args:
        args = args + ["--socket", os.path.join(sockdir, "kv.sock")]
    r = _run(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    for w in words:
        assert w in r.stderr, (w, r.stderr)
    assert "Traceback" not in r.stderr


def test_status_without_a_server_exits_1(sockdir):
    r = _run("--status", "--socket", os.path.join(sockdir, "none.sock"))
    assert r.returncode == 1 and "no server answers" in r.stderr


def test_start_status_metrics_file_and_sigterm(server_proc, sockdir):
    prom = os.path.join(sockdir, "kv.prom")
    sp = server_proc("--size", "64MiB", "--chunk", "4MiB", "--quota", "t=8MiB", "--quota", "*=16MiB",
                     "--metrics-file", prom, "--metrics-interval", "0.2", "--socket-mode", "0600")
    assert oct(os.stat(sp.socket).st_mode & 0o777) == "0o600"
    r = _run("--status", "--socket", sp.socket)
    assert r.returncode == 0 and "pool" in r.stdout and "64.00 MiB" in r.stdout
    r = _run("--status", "--json", "--socket", sp.socket)
    st = json.loads(r.stdout)
    assert st["pool"]["capacity_bytes"] == 64 << 20 and st["pool"]["quotas"] == {"t": 8 << 20, "*": 16 << 20}
    assert st["server"]["socket_mode"] == "0600"
    deadline = time.monotonic() + 5
    while not os.path.exists(prom) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "cxlalloc_kv_capacity_bytes" in open(prom).read()
    assert "ready: pool 64.00 MiB (67108864 bytes) on NUMA node 0" in sp.log()
    sp.proc.send_signal(signal.SIGTERM)
    assert sp.proc.wait(timeout=10) == 0
    assert not os.path.exists(sp.socket)


def test_cxlalloc_key_points_wrap_at_the_server(server_proc, monkeypatch):
    import cxlalloc.hf as hf
    from cxlalloc.config import make_config, parse_env
    from tests.kvstore.kvutil import generate, prompts, tiny_llama

    sp = server_proc()
    monkeypatch.setenv("CXLALLOC", f"kv_store:{sp.url}")
    assert make_config(**parse_env()).kv_store == sp.url
    m = tiny_llama()
    hf.wrap(m, device_limit="256MiB", host_limit="512MiB", block_tokens=8)  # no kv_store: CXLALLOC's
    _, r = generate(m, prompts()[0])
    assert r["store"]["kind"] == "server" and r["last"]["stored_blocks"] > 0
    with pytest.raises(ValueError, match="'kv_store'.*unix:///path/kv.sock"):
        make_config(kv_store="http://example")
