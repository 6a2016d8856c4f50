"""`python -m cxlalloc` (and the `cxlalloc` console script): info, run, bench,
demo, in subprocesses, as a user runs them."""

import glob
import json
import os
import subprocess
import sys

import pytest

NO_DRIVER = "/nonexistent/libcuda.so.1"  # forces the no-GPU path on any machine


def cli(*args, env_extra=None, timeout=240):
    env = {k: v for k, v in os.environ.items() if k != "CXLALLOC"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "cxlalloc", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def sysfs_nodes():
    return sorted(int(os.path.basename(p)[4:]) for p in glob.glob("/sys/devices/system/node/node[0-9]*"))


def test_info_json_without_gpu_lists_numa_and_reason():
    r = cli("info", "--json", "--libcuda", NO_DRIVER)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    gpu = info["gpu"]
    assert gpu["available"] is False and gpu["devices"] == [] and gpu["simulated"] is False
    assert gpu["reason"].startswith(f"CUDA unavailable: cannot load the CUDA driver library '{NO_DRIVER}'")
    numa = info["numa"]
    assert numa["available"] is True, numa.get("reason")
    nodes = numa["topology"]["nodes"]
    assert [n["id"] for n in nodes] == sysfs_nodes()
    for n in nodes:
        assert set(n) >= {"id", "has_cpu", "has_memory", "cxl", "total_bytes", "free_bytes", "memory_tier"}
        assert n["has_cpu"] == bool(n["cpus"])
    auto = numa["auto_node"]
    assert auto["node"] in [n["id"] for n in nodes if n["has_memory"]]
    assert auto["reason"].startswith(f"node {auto['node']}: ")
    assert info["cxlalloc"]["version"] == "0.1.0"
    assert info["torch"]["installed"] is True


def test_info_text_without_gpu():
    r = cli("info", "--libcuda", NO_DRIVER)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(line.startswith(f"no GPU: CUDA unavailable: cannot load the CUDA driver library '{NO_DRIVER}'")
               for line in lines)
    assert "NUMA topology (sysfs: /sys)" in r.stdout
    assert any(line.startswith("numa_node auto -> ") for line in lines)


def test_info_simulate_json():
    r = cli("info", "--simulate", "--json")
    assert r.returncode == 0, r.stderr
    gpu = json.loads(r.stdout)["gpu"]
    assert gpu["available"] is True and gpu["simulated"] is True and gpu["reason"] is None
    assert gpu["numa_method"] == "simulated"
    (dev,) = gpu["devices"]
    assert dev["index"] == 0 and dev["name"] == "cxlalloc simulated GPU 0"
    assert dev["total_bytes"] == 16 << 30  # the simulator's default VRAM
    assert dev["attributes"]["virtual_memory_management_supported"] == 1
    assert dev["attributes"]["host_numa_id"] == dev["host_numa_id"]
    assert set(dev["backends"]) == {"device", "host-vmm", "managed", "pinned"}
    assert all(isinstance(b["supported"], bool) and isinstance(b["reason"], str) for b in dev["backends"].values())
    assert dev["auto_node"]["node"] in sysfs_nodes()
    assert dev["auto_node"]["reason"].startswith(f"node {dev['auto_node']['node']}: ")


def test_run_propagates_variable_and_exit_code():
    code = "import os, sys; print(os.environ['CXLALLOC']); sys.exit(7)"
    r = cli("run", "--device-limit", "2GiB", "--numa-node", "0", "--option", "promote_after=3", "--",
            sys.executable, "-c", code)
    assert r.returncode == 7, r.stderr
    assert r.stdout == "device_limit:2GiB,numa_node:0,promote_after:3\n"


def test_run_takes_per_gpu_values():
    code = "import os; print(os.environ['CXLALLOC'])"
    r = cli("run", "--device-limit", "2GiB|1GiB", "--option", "numa_node=0=2|1=3", "--", sys.executable, "-c", code)
    assert (r.returncode, r.stdout) == (0, "device_limit:2GiB|1GiB,numa_node:0=2|1=3\n"), r.stderr
    r = cli("run", "--host-limit", "1GiB|lots", "--", "true")
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "python -m cxlalloc run: error: cxlalloc option 'host_limit[1]': 'lots' is not a size; use bytes (int) or a "
        "size string like '512MiB', '8GiB', '1.5TiB', '8GB'"], r.stderr


def test_run_defaults_to_1_and_merges_existing_variable():
    code = "import os; print(os.environ['CXLALLOC'])"
    r = cli("run", "--", sys.executable, "-c", code)
    assert (r.returncode, r.stdout) == (0, "1\n")
    r = cli("run", "--host-limit", "8GiB", "--", sys.executable, "-c", code, env_extra={"CXLALLOC": "backend:managed"})
    assert (r.returncode, r.stdout) == (0, "backend:managed,host_limit:8GiB\n")


def test_run_rejects_bad_options_before_starting():
    r = cli("run", "--backend", "cuda", "--", sys.executable, "-c", "print('started')")
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.splitlines()  # argparse quotes the choices from Python 3.12.8/3.13.1 on
    assert len(lines) == 1 and lines[0].startswith(
        "python -m cxlalloc run: error: argument --backend: invalid choice: 'cuda' (choose from "), r.stderr
    assert all(b in lines[0] for b in ("auto", "host-vmm", "managed", "pinned")), lines[0]
    r = cli("run", "--host-limit", "lots", "--", sys.executable, "-c", "print('started')")
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "python -m cxlalloc run: error: cxlalloc option 'host_limit': 'lots' is not a size;"), r.stderr
    r = cli("run", "--option", "bogus", "--", "true")
    assert r.returncode == 2 and "--option 'bogus': use KEY=VALUE" in r.stderr
    r = cli("run")
    assert r.returncode == 2 and "no command given" in r.stderr
    r = cli("run", "--", "/nonexistent/command")
    assert r.returncode == 127 and "cannot run '/nonexistent/command'" in r.stderr


def test_run_refuses_an_option_given_twice_on_its_command_line():
    for args in (["--option", "device_limit=1GiB", "--device-limit", "2GiB"],
                 ["--option", "device_limit=1GiB", "--option", "device_limit=2GiB"]):
        r = cli("run", *args, "--", sys.executable, "-c", "print('started')")
        assert r.returncode == 2 and r.stdout == ""
        assert "cxlalloc option 'device_limit' is given twice on the command line" in r.stderr, r.stderr
    # The inherited variable is a base that the command line overrides.
    r = cli("run", "--device-limit", "2GiB", "--", sys.executable, "-c", "import os; print(os.environ['CXLALLOC'])",
            env_extra={"CXLALLOC": "device_limit:1GiB"})
    assert (r.returncode, r.stdout) == (0, "device_limit:2GiB\n")


def test_run_with_a_malformed_inherited_variable_says_why_once():
    r = cli("run", "--", sys.executable, "-c", "print('started')", env_extra={"CXLALLOC": "device_limit:banana"})
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("'device_limit': 'banana' is not a size or fraction") == 1, r.stderr
    # Whether the start-up hook printed the error (installed .pth) or `run`
    # did, the last line is run's own.
    assert r.stderr.splitlines()[-1].startswith("python -m cxlalloc run: error: "), r.stderr


@pytest.mark.parametrize("sub,module", [("bench", "cxlalloc_apps.bench.cli"), ("demo", "cxlalloc_apps.demo")])
def test_bench_and_demo_are_registered(sub, module):
    """The product's CLI finds the apps by entry point (setup.py's group), not by import."""
    from cxlalloc import cli as product_cli

    ep = product_cli._app_entry_point(sub)
    assert ep is not None and ep.value == f"{module}:main"
    assert ep.load().__module__.startswith(f"cxlalloc_apps.{sub}")


def test_an_app_that_is_not_installed_says_so_in_one_line(monkeypatch, capsys):
    from cxlalloc import cli as product_cli

    monkeypatch.setattr(product_cli, "_app_entry_point", lambda name: None)
    assert product_cli.main(["demo", "--help"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("cxlalloc demo: not installed (no 'cxlalloc.apps' entry point named 'demo'")


def test_console_script_and_help():
    script = os.path.join(os.path.dirname(sys.executable), "cxlalloc")
    assert os.path.isfile(script), "console script 'cxlalloc' not installed (pip install -e .)"
    r = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "{info,run,bench,demo,kv-server,plan,serve}" in r.stdout


@pytest.mark.parametrize("args", [("info", "--json", "--simulate"), ("info", "--libcuda", NO_DRIVER)])
def test_info_into_a_closed_pipe_exits_quietly(args):
    """`cxlalloc info --json | head`: the reader goes away before the output is
    written (here: at once); no traceback, no 'Exception ignored', status 0."""
    env = {k: v for k, v in os.environ.items() if k != "CXLALLOC"}
    p = subprocess.Popen([sys.executable, "-m", "cxlalloc", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=env)
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=240) == 0, err
    assert err == ""


def test_info_json_piped_to_head():
    r = subprocess.run(f"{sys.executable} -m cxlalloc info --json --simulate | head -n 2", shell=True,
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.splitlines()[0] == "{"


def _script():
    script = os.path.join(os.path.dirname(sys.executable), "cxlalloc")
    if not os.path.isfile(script):
        pytest.skip("console script 'cxlalloc' not installed (pip install -e .)")
    return script


@pytest.mark.parametrize("sub", ["kv-server", "bench", "demo", "run", "info"])
def test_usage_errors_are_one_line_with_the_program_name_typed(sub):
    """A bad flag: one line ``PROG SUB: error: ...`` naming it, status 2, no
    usage block; PROG is what the user ran (the console script or -m)."""
    for argv0, prog in (([sys.executable, "-m", "cxlalloc"], "python -m cxlalloc"), ([_script()], "cxlalloc")):
        env = {k: v for k, v in os.environ.items() if k != "CXLALLOC"}
        r = subprocess.run([*argv0, sub, "--no-such-flag"], capture_output=True, text=True, timeout=240, env=env)
        assert r.returncode == 2, (r.returncode, r.stderr)
        assert r.stderr.splitlines() == [f"{prog} {sub}: error: unrecognized arguments: --no-such-flag"], r.stderr


def test_version_and_help_say_what_a_pip_user_has():
    import cxlalloc

    r = cli("--version")
    assert (r.returncode, r.stdout) == (0, f"cxlalloc {cxlalloc.__version__}\n")
    r = subprocess.run([_script(), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("usage: cxlalloc [-h] [--version]"), r.stdout
    assert "docs/" not in r.stdout and "'cxlalloc COMMAND --help'" in " ".join(r.stdout.split())
    r = cli("run", "--help")
    assert r.returncode == 0
    assert "--backend {auto,host-vmm,managed,pinned}" in r.stdout and "--policy {kv-aware,first-fit}" in r.stdout
    from cxlalloc import cli as product_cli

    parser = product_cli.make_parser()
    run = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "run")[1]
    missing = [a.dest for a in run._actions if not a.help]
    assert missing == [], f"run options without help text: {missing}"


def test_info_reports_a_cpu_torch_without_importing_it():
    r = cli("info", "--json", "--simulate", "--no-torch")
    assert r.returncode == 0, r.stderr
    t = json.loads(r.stdout)["torch"]
    import torch

    assert t["installed"] is True and t["imported"] is False
    assert t["version"] == torch.__version__
    code = ("import sys; from cxlalloc import cli; cli.gather_info(simulate=True, import_torch=False); "
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert (r.returncode, r.stdout) == (0, "False\n"), r.stderr


def test_info_prints_the_serving_engine_lines_for_this_machines_node():
    import yaml

    r = cli("info", "--json", "--libcuda", NO_DRIVER)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    eng, node = info["engines"], info["numa"]["auto_node"]["node"]
    assert eng["node"] == node and eng["status"] == "not yet run with an engine on a GPU"
    assert eng["kv_server"].startswith(f"cxlalloc kv-server --numa-node {node} ")
    cfg = yaml.safe_load(eng["lmcache_yaml"])  # the block LMCache loads (tests/kvstore/engines/test_lmcache_plugin.py)
    assert cfg["remote_storage_plugins"] == ["cxlalloc"] and cfg["max_local_cpu_size"] > 0
    # chunk names the same in every process (tests/engines/test_vllm_lmcache.py runs vLLM with the docs' block),
    # and the docs print the same config
    assert cfg["pre_caching_hash_algorithm"] == "sha256_cbor"
    from tests.engines.engine_util import docs_lmcache_yaml

    assert yaml.safe_load(docs_lmcache_yaml()) == cfg
    extra = cfg["extra_config"]
    assert extra["remote_storage_plugin.cxlalloc.class_name"] == "CxlallocConnectorAdapter"
    assert extra["remote_storage_plugin.cxlalloc.url"] == "cxlalloc:///run/cxlalloc/kv.sock"
    assert '"kv_connector": "LMCacheConnectorV1"' in eng["vllm"]
    # vLLM's own offloading with cxlalloc's tier: the JSON docs/engines.md prints (the one
    # tests/engines/test_vllm_offload_tier.py runs vLLM with)
    from tests.engines.engine_util import docs_offload_config

    head, conf = eng["vllm_offload"].split(" --kv-transfer-config ", 1)
    assert head == "vllm serve <model>" and conf[0] == conf[-1] == "'"
    assert json.loads(conf[1:-1]) == docs_offload_config()
    assert eng["kvbm_g2"][1:] == ["export DYN_MEMORY_DISABLE_NUMA=1", f"numactl --membind={node} <your Dynamo worker command>"]
    free = next(n["free_bytes"] for n in info["numa"]["topology"]["nodes"] if n["id"] == node)
    assert eng["kvbm_g2"][0] == f"export DYN_KVBM_CPU_CACHE_GB={max(1, free // 2 // (1 << 30))}"
    text = cli("info", "--libcuda", NO_DRIVER).stdout
    assert f"serving engines, KV on node {node}" in text and "vllm serve <model> --kv-transfer-config" in text
    assert "CxlallocSecondaryTier" in text
