"""Fixtures of the app tests: local model directories the demo loads with
``--model`` (tiny random Llama weights and a word-level tokenizer), and the
``cxlalloc.apps`` entry points for a checkout whose installed metadata
predates them."""

import ast
import importlib.metadata
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def declared_apps():
    """(group, {name: "module:function"}) as setup.py declares them (its
    ``APP_GROUP`` and ``APP_COMMANDS`` literals, read without running setup.py)."""
    found = {}
    for node in ast.parse(open(os.path.join(ROOT, "setup.py")).read()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("APP_GROUP", "APP_COMMANDS"):
                found[node.targets[0].id] = ast.literal_eval(node.value)
    return found["APP_GROUP"], found["APP_COMMANDS"]


@pytest.fixture(scope="session", autouse=True)
def app_entry_points(tmp_path_factory):
    """Make ``cxlalloc bench|demo`` findable when the installed cxlalloc's
    metadata lacks the ``cxlalloc.apps`` group (an editable install made before
    the apps moved, or another checkout's): a stand-in ``.dist-info`` declaring
    setup.py's entry points goes first on ``sys.path`` and ``PYTHONPATH``, so
    this process and the commands it starts resolve them as an install would.
    After ``pip install -e .`` (CI) the installed metadata has them and nothing
    is added."""
    group, commands = declared_apps()
    have = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=group)}
    if all(have.get(n) == v for n, v in commands.items()):
        yield None
        return
    d = tmp_path_factory.mktemp("app-entry-points")
    info = d / "cxlalloc_apps_checkout-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: cxlalloc-apps-checkout\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n" + "".join(f"{n} = {v}\n" for n, v in commands.items()))
    old = os.environ.get("PYTHONPATH")
    sys.path.insert(0, str(d))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(d), old) if p)
    yield d
    sys.path.remove(str(d))
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


def save_model_dir(d, **shape):
    """Save a tiny random Llama (``tests.helpers.hf_util.tiny_llama(**shape)``)
    and a word-level tokenizer (``w0`` .. ``w49``) into ``d``; returns ``d``."""
    from tests.helpers.hf_util import tiny_llama
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tiny_llama(**shape).save_pretrained(d)
    words = ["[UNK]", "[PAD]", "</s>"] + [f"w{i}" for i in range(50)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]",
                            eos_token="</s>").save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """789 KiB of fp32 parameters (one 2 MiB segment in the allocator), KV 512 B
    per token: with the default prompt (1,388 tokens) the whole run needs less
    than the segment that holds the weights."""
    return save_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def kv_model_dir(tmp_path_factory):
    """5.24 MiB of fp32 parameters and 32 KiB of KV per token (8 layers x 8 KV
    heads x 64): the default prompt's KV cache spans 22 chunks of 2 MiB."""
    return save_model_dir(tmp_path_factory.mktemp("kv-llama"), hidden=64, layers=8, heads=8, kv_heads=8,
                          head_dim=64)
