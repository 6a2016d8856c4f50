"""The coverage matrix's CI sample (scripts/coverage_matrix.py, docs/coverage.md):
one architecture of each cache layer kind runs greedy, beam, seeded sampling and
a padded batch unwrapped and wrapped with KV spilling, in this process.

Every run must give plain transformers' tokens.  What each architecture's cache
looks like wrapped -- layers tiered / untiered, KV bytes per tier, whether
cxlalloc warned -- is compared with ``EXPECTED``, one line per architecture:
when cxlalloc tiers (or warns about) another layer kind, that line changes.
"""


import importlib.util
import json
import os
from typing import NamedTuple

import pytest
from tests.helpers.gc_util import collect_all
from tests.helpers.hf_util import torch  # noqa: F401  (skips without torch/transformers; one intra-op thread)

import cxlalloc.engine

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "coverage_matrix.py")


def _load():
    spec = importlib.util.spec_from_file_location("coverage_matrix", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


cm = _load()


class Exp(NamedTuple):
    tiered: dict  # layer kind -> count, cxlalloc layers of the wrapped greedy run's cache
    untiered: dict  # layer kind -> count, transformers' (or the model's) own layers
    growing: dict  # the untiered kinds whose bytes grow with the context
    kv: tuple  # (device, host) bytes of the kv class after the greedy run (weights + 1 chunk of VRAM)
    warned: bool  # cxlalloc emitted a warning during wrap/generate
    cache: str  # the wrapped greedy run's cache class


FULL2 = {"CxlKVLayer": 2}
# 21 tokens x 1 KiB (2 layers x 4 KV heads x 16 x fp32 x K,V) = 6 chunks of 4 KiB; one fits the device budget.
SPILLED6 = (4096, 20480)
WINDOW = (4096, 12288)  # a bounded window extent per sliding layer (and the full layers'), one chunk in VRAM
ENC_DEC = {"self:CxlKVLayer": 2, "cross:CxlKVLayer": 2}

# Every layer kind whose KV grows with the context is tiered (cxlalloc/hf/layers/, encdec.py,
# model_caches.py); what is left to transformers (SSM / conv / lightning-attention state, fixed size) is said
# once (CacheCoverageWarning: warned).
EXPECTED = {
    "causal/llama": Exp(FULL2, {}, {}, SPILLED6, False, "CxlCache"),
    "causal/gpt2": Exp(FULL2, {}, {}, SPILLED6, False, "CxlCache"),
    "causal/qwen3": Exp(FULL2, {}, {}, SPILLED6, False, "CxlCache"),
    "causal/mistral": Exp({"CxlSlidingLayer": 2}, {}, {}, WINDOW, False, "CxlCache"),  # window 8: bounded
    "causal/gemma2": Exp({"CxlKVLayer": 1, "CxlSlidingLayer": 1}, {}, {}, WINDOW, False, "CxlCache"),
    "causal/gemma3_text": Exp({"CxlKVLayer": 1, "CxlSlidingLayer": 1}, {}, {}, WINDOW, False, "CxlCache"),
    "causal/mamba": Exp({}, {"LinearAttentionLayer": 2}, {}, (0, 0), True, "CxlCache"),  # recurrent state only
    "causal/falcon_h1": Exp({"CxlHybridLayer": 2}, {}, {}, (4096, 8192), True, "CxlCache"),  # SSM state said
    "causal/deepseek_v32": Exp({"CxlIndexedLayer": 2}, {}, {}, WINDOW, False, "CxlCache"),  # + indexer keys
    "causal/minimax": Exp({"CxlKVLayer": 1}, {}, {}, (4096, 4096), True, "CxlMiniMaxCache"),  # its state said
    "seq2seq/t5": Exp({}, {}, {}, SPILLED6, False, "CxlEncoderDecoderCache")._replace(tiered=ENC_DEC),
    "seq2seq/bart": Exp({}, {}, {}, SPILLED6, False, "CxlEncoderDecoderCache")._replace(tiered=ENC_DEC),
}
# Only bounded (sliding-window) KV, tiered: the matrix calls it none-needed.
COVERAGE = {"causal/mistral": "none-needed"}


def test_expected_table_is_the_scripts_sample():
    assert sorted(EXPECTED) == sorted(cm.SAMPLE)


@pytest.fixture(scope="module")
def matrix_sim(sim):
    """The simulated GPU as the matrix configures it (4 KiB VMM granularity),
    restored to the suite's default afterwards; no simulated resource may
    outlive the sample."""
    collect_all()
    before = sim.live()
    cm.configure_sim()
    yield sim
    collect_all()
    after = sim.live()
    leaked = {k: after[k] - before[k] for k in after if after[k] > before[k]}
    sim.configure("vram=1GiB")
    cxlalloc.engine._sim_vram = 1 << 30
    assert not leaked, f"simulated driver resources leaked: {leaked}"


@pytest.fixture(scope="module")
def rows(matrix_sim):
    return {rid: cm.run_arch(rid) for rid in cm.SAMPLE}


@pytest.mark.parametrize("rid", cm.SAMPLE)
def test_sample_architecture(rows, rid):
    r = rows[rid]
    exp = EXPECTED[rid]
    assert r["status"] == "ok", (r.get("reason"), r["runs"])
    assert sorted(r["runs"]) == sorted(cm.RUNS)
    for run, v in r["runs"].items():
        assert v["ran"] and v["tokens_identical"] and v["scores_identical"], (run, v)
    assert r["cache_wrapped"] == exp.cache
    assert r["layers"] == {"tiered": exp.tiered, "untiered": exp.untiered, "untiered_growing": exp.growing}
    assert (r["kv_device_bytes"], r["kv_host_bytes"]) == exp.kv
    if "cache_kv_bytes" in r:  # the cache's own account of its extents agrees with the allocator's
        assert (r["cache_kv_bytes"]["device"], r["cache_kv_bytes"]["host"]) == exp.kv
    assert r["warned"] is exp.warned, r["warnings"]
    assert r["spilled"] is (exp.kv[1] > 0)
    # silent is computed: growing KV untiered and no cxlalloc warning.
    assert r["silent"] is (bool(exp.growing) and not exp.warned)
    assert r["coverage"] == COVERAGE.get(rid) or ("none-needed" if not (exp.tiered or exp.growing) else
                                                 "all-tiered" if not exp.growing else "partly-tiered"
                                                 if exp.tiered else "untiered")


def test_no_silent_untiered_kv_for_the_kinds_main_tiers(rows):
    """Plain full attention is what main tiers: an architecture whose growing
    KV is only that (decoder-only, transformers' DynamicCache) is never silent."""
    for rid, r in rows.items():
        if r["cache_wrapped"] == "CxlCache":
            assert "DynamicLayer" not in r["layers"]["untiered_growing"], rid


def test_summary_and_markdown(rows, tmp_path):
    doc = {"meta": {"versions": cm.versions(), "date": "today"}, "archs": rows}
    s = cm.summarize(rows)
    n_silent = sum(bool(e.growing) and not e.warned for e in EXPECTED.values())
    assert s["archs"] == s["ran"] == s["tokens_identical"] == len(EXPECTED)
    assert s["silent_untiered"] == n_silent
    assert s["all_tiered"] == sum(bool(e.tiered) and not e.growing and rid not in COVERAGE
                                  for rid, e in EXPECTED.items())
    assert s["none_needed"] == sum((not e.tiered and not e.growing) or COVERAGE.get(rid) == "none-needed"
                                   for rid, e in EXPECTED.items())
    md = cm.markdown(doc)
    assert f"| **silent untiered** (growing KV untiered, no warning) | **{n_silent}** |" in md
    for rid, r in rows.items():  # one row in the table, plus one per note and per warning in their sections
        assert md.count(f"\n| {rid} |") == 1 + len(r.get("notes", [])) + len(r.get("warnings", [])), rid
    json.dumps(doc)  # the JSON the script writes


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        cm.main(["--arch", "no_such_model", "--out", os.devnull, "--markdown", ""])
    assert "--arch no_such_model: not an architecture" in str(e.value)
    with pytest.raises(SystemExit):
        cm.main(["--jobs", "0"])
    assert "--jobs must be at least 1, not 0" in capsys.readouterr().err


def test_resume_skips_architectures_in_the_json(tmp_path):
    """A row already in the JSON is kept (no subprocess started) unless --force."""
    out, md = tmp_path / "c.json", tmp_path / "c.md"
    row = {"id": "causal/llama", "kind": "causal", "arch": "llama", "status": "not-built", "reason": "kept row",
           "runs": {}, "notes": []}
    out.write_text(json.dumps({"archs": {"causal/llama": row}}))
    assert cm.main(["--arch", "llama", "--out", str(out), "--markdown", str(md)]) == 0
    doc = json.loads(out.read_text())
    assert doc["archs"]["causal/llama"] == row
    assert doc["meta"]["versions"]["transformers"] == cm.versions()["transformers"]
    assert "| causal/llama | not-built | kept row |" in md.read_text()


def test_a_hang_is_one_row():
    """The per-architecture subprocess is killed at the timeout and the row says so."""
    r = cm.run_one_subprocess("causal/llama", timeout=0.5)
    assert r["status"] == "timeout" and r["reason"] == "no result within 0.5 s", r



def _row(**kw):
    row = {"status": "ok", "kv_grows": True, "warned": False, "kv_peak_bytes": 0, "kv_host_bytes": 0, "notes": [],
           "layers": {"tiered": {}, "untiered": {}, "untiered_growing": {}},
           "reported_layers": {"tiered": {"DynamicLayer": 2}, "untiered": {}}}
    row.update(kw)
    return row


def test_the_judge_decides_on_bytes_held_not_on_stats_claims():
    # hf.stats() says 2 tiered layers, the tiers held 0 B, no warning: silent (MPT's row once passed as fine)
    r = cm.judge(_row(kv_grows=False))
    assert r["silent"] is True and r["coverage"] == "untiered"
    assert any("0 B of KV in the tiers although hf.stats() reports 2 tiered layers" in n for n in r["notes"])
    assert cm.judge(_row(reported_layers={}))["silent"] is True  # growing KV, 0 B held
    assert cm.judge(_row(warned=True))["silent"] is False  # said so: not silent
    held = cm.judge(_row(kv_peak_bytes=1 << 20, layers={"tiered": {"CxlKVLayer": 2}, "untiered": {},
                                                        "untiered_growing": {}}))
    assert (held["silent"], held["coverage"]) == (False, "all-tiered")
    grown = cm.judge(_row(kv_peak_bytes=1 << 20, layers={"tiered": {"CxlKVLayer": 1}, "untiered": {"X": 1},
                                                         "untiered_growing": {"X": 1}}))
    assert (grown["silent"], grown["coverage"]) == (True, "partly-tiered")
    none = cm.judge(_row(kv_grows=False, reported_layers={}))
    assert (none["silent"], none["coverage"]) == (False, "none-needed")


def test_the_committed_matrix_has_no_silent_row():
    doc = json.load(open(os.path.join(REPO, "docs", "coverage.json")))
    rejudged = {k: cm.judge(dict(r, notes=list(r.get("notes") or []))) for k, r in doc["archs"].items() if "layers" in r}
    assert [k for k, r in rejudged.items() if r["silent"]] == []
