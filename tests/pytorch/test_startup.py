"""The CXLALLOC start-up hook (cxlalloc-startup.pth + cxlalloc.pytorch.startup),
exercised in fresh interpreters: silent and import-free without the
variable, one line on stderr for every problem, the program always runs.

On a machine whose torch can use CUDA, activation itself is covered by
tests/pytorch/test_torch_gpu.py::test_env_var_activation_in_subprocess.
"""

import os
import site
import subprocess
import sys
import textwrap

import pytest

WARN_CPU = "cxlalloc: warning: CXLALLOC is set but cxlalloc is not enabled: cxlalloc.enable(): CUDA is not available: "


def _torch_has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run_py(args, env_extra=None, drop=("CXLALLOC",), cwd=None, timeout=180):
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(env_extra or {})
    return subprocess.run([sys.executable] + list(args), env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def test_pth_is_installed_in_site_packages():
    dirs = site.getsitepackages()
    found = [d for d in dirs if os.path.isfile(os.path.join(d, "cxlalloc-startup.pth"))]
    assert found, f"cxlalloc-startup.pth missing from {dirs} (pip install -e . / pip install . installs it)"
    with open(os.path.join(found[0], "cxlalloc-startup.pth")) as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("import os, sys;")
    assert 'os.environ.get("CXLALLOC")' in lines[0]


def test_without_variable_nothing_is_imported():
    r = run_py(["-c", "import sys, torch; print(sorted(m for m in sys.modules if m.startswith('cxlalloc')))"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
    assert r.stderr == ""


def test_variable_set_but_torch_never_imported_is_silent():
    r = run_py(["-c", "import sys; print('torch' in sys.modules, 'cxlalloc.pytorch.startup' in sys.modules)"],
               {"CXLALLOC": "1"})
    assert r.returncode == 0
    assert r.stdout.strip() == "False True"
    assert r.stderr == ""


@pytest.mark.skipif(_torch_has_cuda(), reason="torch can use CUDA here: activation is tested by test_torch_gpu.py")
def test_cpu_torch_warns_once_and_runs(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import torch\nx = torch.ones(3) * 2\nprint('ran', int(x.sum()))\nraise SystemExit(0)\n")
    r = run_py([str(script)], {"CXLALLOC": "1"})
    assert r.returncode == 0
    assert r.stdout == "ran 6\n"
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(WARN_CPU)
    assert "CPU-only build" in lines[0] and "cxlalloc.Allocator(simulate=True)" in lines[0]


@pytest.mark.skipif(_torch_has_cuda(), reason="torch can use CUDA here: activation is tested by test_torch_gpu.py")
def test_python_dash_m_and_child_processes(tmp_path):
    pkg = tmp_path / "app"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    # The parent does not import torch; its child (a worker, as torchrun
    # starts them) inherits CXLALLOC and gets the hook on its own.
    (pkg / "__main__.py").write_text(textwrap.dedent("""
        import subprocess, sys
        r = subprocess.run([sys.executable, "-c", "import torch; print('child ran')"], capture_output=True, text=True)
        print(r.stdout.strip(), r.returncode)
        sys.stderr.write("child stderr: " + r.stderr)
        import torch
        print("parent ran")
    """))
    r = run_py(["-m", "app"], {"CXLALLOC": "device_limit:50%"}, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["child ran 0", "parent ran"]
    lines = r.stderr.splitlines()
    assert len(lines) == 2, r.stderr
    assert lines[0].startswith("child stderr: " + WARN_CPU)
    assert lines[1].startswith(WARN_CPU)


@pytest.mark.parametrize("value,line", [
    ("device_limit:8Gx",
     "cxlalloc: error: CXLALLOC: cxlalloc option 'device_limit': '8Gx' is not a size or fraction; use bytes (int) "
     "or a size string like '512MiB', '8GiB', '1.5TiB', '8GB', or a fraction of VRAM: a float in (0, 1] or a "
     "percentage like '50%' (cxlalloc is not enabled)"),
    ("numa_node:2,backend:cuda",
     "cxlalloc: error: CXLALLOC: cxlalloc option 'backend': 'cuda' is not allowed; allowed: auto, host-vmm, managed, "
     "pinned (cxlalloc is not enabled)"),
    ("device_limit:8GiB|8Gx",  # per GPU: the second GPU's value is named
     "cxlalloc: error: CXLALLOC: cxlalloc option 'device_limit[1]': '8Gx' is not a size or fraction; use bytes (int) "
     "or a size string like '512MiB', '8GiB', '1.5TiB', '8GB', or a fraction of VRAM: a float in (0, 1] or a "
     "percentage like '50%' (cxlalloc is not enabled)"),
    ("host_limit:0=1GiB|1GiB",
     "cxlalloc: error: CXLALLOC: cxlalloc option 'host_limit': '0=1GiB|1GiB' mixes device=value and plain values; "
     "give one value for every GPU, a list with one value per visible GPU (host_limit=['8GiB', '4GiB']), or a "
     "mapping by device index (host_limit={0: '8GiB', 1: '4GiB'}); in CXLALLOC: host_limit:8GiB|4GiB or "
     "host_limit:0=8GiB|1=4GiB (cxlalloc is not enabled)"),
    ("devise:1",
     "cxlalloc: error: CXLALLOC: unknown key 'devise'; known keys: device_limit, host_limit, numa_node, backend, "
     "kv_device_limit, device_headroom, migration_rate, promote_after, extent_chunk, policy, strict_placement, "
     "simulate, sim_vram, libcuda, device, spill_reserve, kv_store, implicit_moves (cxlalloc is not enabled)"),
])
def test_bad_value_one_error_line_naming_the_key(value, line):
    r = run_py(["-c", "import torch; print('ran')"], {"CXLALLOC": value})
    assert r.returncode == 0
    assert r.stdout == "ran\n"
    assert r.stderr.splitlines() == [line]


def test_off_values_do_nothing():
    for value in ("0", "off", "false"):
        r = run_py(["-c", "import torch; print('ran')"], {"CXLALLOC": value})
        assert (r.returncode, r.stdout, r.stderr) == (0, "ran\n", "")


HOOKED = "import sys; print(any(type(f).__name__ == '_TorchImportHook' for f in sys.meta_path))"


def test_hook_waits_for_torch():
    r = run_py(["-c", HOOKED], {"CXLALLOC": "1"})
    assert (r.returncode, r.stdout, r.stderr) == (0, "True\n", "")


def test_simulate_warns_once_when_torch_is_imported_and_is_silent_otherwise():
    # torch cannot use the simulated GPU: one line pointing to the simulated entry points
    r = run_py(["-c", HOOKED + "; import torch; print('ran')"], {"CXLALLOC": "simulate:1"})
    assert r.returncode == 0 and r.stdout == "True\nran\n"
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("cxlalloc: warning: CXLALLOC=simulate:1 has no effect on torch")
    assert "cxlalloc.Allocator(simulate=True)" in lines[0]
    r = run_py(["-c", "print('no torch')"], {"CXLALLOC": "simulate:1"})
    assert (r.returncode, r.stdout, r.stderr) == (0, "no torch\n", "")


def test_broken_install_is_one_warning_not_a_crash(tmp_path):
    fake = tmp_path / "cxlalloc"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('boom: simulated broken install')\n")
    r = run_py(["-c", "print('ran')"], {"CXLALLOC": "1", "PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0
    assert r.stdout == "ran\n"
    assert r.stderr.splitlines() == [
        "cxlalloc: warning: CXLALLOC start-up hook failed (ImportError: boom: simulated broken install); "
        "cxlalloc is not enabled"]
