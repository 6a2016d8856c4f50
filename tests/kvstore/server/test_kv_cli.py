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
    (["--size", "0"], ["'--size'", "0 must be above 0 bytes"]),
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
    (["--size", "64MiB", "--tenant", "a:65534:0"], ["'--tenant'", "'a:65534:0': SIZE '0' is not allowed",
                                                    "allowed: a positive size", "NAME:USERS[:SIZE]"]),
    (["--size", "64MiB", "--redis", "redis+cluster://127.0.0.1:7000?bogus=1"],
     ["'--redis'", "unknown query option 'bogus'; allowed: prefix, ttl, queue"]),
    # the kv-server names each block's tenant itself: a URL ?tenant= would be ignored, so it is refused
    (["--size", "64MiB", "--redis", "redis://127.0.0.1:6390/0?tenant=zz"],
     ["'--redis': ?tenant= names an in-process kv_store's values; a kv-server would ignore it"]),
    # an option of the URL is named as the URL's, not as a flag that was not given
    (["--size", "64MiB", "--redis", "redis://127.0.0.1:6390/0?ttl=-5"], ["'--redis ?ttl': -5.0 must be a positive"]),
    (["--size", "64MiB", "--redis", "redis://127.0.0.1:6390/0?queue=lots"], ["'--redis ?queue'", "not a size"]),
])
def test_bad_options_exit_2_naming_the_option(args, words, sockdir):
    if "--socket" not in args:
        args = args + ["--socket", os.path.join(sockdir, "kv.sock")]
    r = _run(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    for w in words:
        assert w in r.stderr, (w, r.stderr)
    assert "Traceback" not in r.stderr


def test_help_and_flag_errors_import_no_torch():
    """``kv-server --help`` and a flag error are answered without importing torch
    (seconds; the server itself never needs it)."""
    code = ("import sys\nfrom cxlalloc.kvstore.server import cli as server_cli\n"
            "for argv in (['--help'], ['--size', 'lots', '--socket', '/tmp/x.sock']):\n"
            "    try:\n        server_cli.main(argv)\n    except SystemExit:\n        pass\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--size" in r.stdout and "'--size'" in r.stderr


def test_busy_socket_exits_2_and_a_pool_beyond_the_node_warns(server_proc, sockdir):
    """A second server on a socket a live server listens on: one line, exit 2
    (docs/kv-server.md); a pool larger than the node's memory starts (sparse)
    with a warning naming the node's size."""
    sp = server_proc("--size", "64MiB", "--chunk", "4MiB")
    r = _run("--size", "64MiB", "--chunk", "4MiB", "--socket", sp.socket)
    assert r.returncode == 2, r.stderr
    assert "already listening" in r.stderr and "Traceback" not in r.stderr
    assert len([ln for ln in r.stderr.splitlines() if "error:" in ln]) == 1
    from cxlalloc import topology

    node0 = next(n for n in topology.read_topology()["nodes"] if n["id"] == 0)["total_bytes"]
    big = server_proc("--size", str(node0 * 2), "--numa-node", "0", socket_name="big.sock")
    assert "is more than NUMA node 0's memory" in big.log()
    big.proc.send_signal(signal.SIGTERM)
    assert big.proc.wait(timeout=10) == 0


def test_sigterm_as_soon_as_the_socket_appears_exits_0(sockdir):
    """A SIGTERM that lands the moment the socket file exists (a supervisor that sees the
    server up stops it at once) is a clean stop, exit 0, socket file gone: the stop handlers
    go in before the socket listens.  CI once saw exit -15 here (the handlers went in after
    the server answered), which left the socket file behind."""
    for i in range(3):
        sock = os.path.join(sockdir, f"early{i}.sock")
        p = subprocess.Popen([sys.executable, "-m", "cxlalloc", "kv-server", "--size", "64MiB", "--chunk", "4MiB",
                              "--socket", sock], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env=_env(), cwd=ROOT)
        deadline = time.monotonic() + 30
        while not os.path.exists(sock) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.0005)
        assert p.poll() is None, p.stderr.read()
        p.send_signal(signal.SIGTERM)
        err = p.communicate(timeout=20)[1]
        assert p.returncode == 0, err
        assert not os.path.exists(sock), "the socket file outlived a clean stop"


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
