"""The serve benchmark's trace options (``--serve-trace``), its trace text, and the README block generated from the
committed record (``cxlalloc_apps/bench/serve_report.py``)."""

import collections
import json
import os

import pytest

from cxlalloc_apps.bench import cli, serve_report
from cxlalloc_apps.bench.serve_trace import QUICK, Trace, TraceText, parse_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECORD = "benchmarks/results/serve-cpu-rag-2026-12-03"


def test_overrides_set_the_issue_shape_and_name_bad_fields():
    t = parse_overrides(Trace(), "concurrency=64, doc_tokens=2048-4096,zipf_s=0.8,window_s=90")
    assert (t.concurrency, t.doc_range(), t.zipf_s, t.window_s) == (64, (2048, 4096), 0.8, 90.0)
    assert Trace().doc_range() == (1024, 8192) and Trace().concurrency == 32  # issue 28's defaults
    with pytest.raises(ValueError, match="KEY one of concurrency, window_s"):
        parse_overrides(Trace(), "sessions=64")
    with pytest.raises(ValueError, match="doc_tokens='8192-1024'"):
        parse_overrides(Trace(), "doc_tokens=8192-1024")
    with pytest.raises(ValueError, match="concurrency='many' is not a int"):
        parse_overrides(Trace(), "concurrency=many")
    with pytest.raises(ValueError, match="rag_fraction=1.5"):
        parse_overrides(QUICK, "rag_fraction=1.5")


def test_cli_refuses_a_bad_trace_before_running(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--only", "serve", "--serve-trace", "zipf_s=-1", "--out", "/tmp"])
    assert e.value.code == 2
    assert "zipf_s=-1.0: must be a finite number >= 0" in capsys.readouterr().err


def test_trace_text_documents_sizes_and_zipf_popularity():
    t = parse_overrides(Trace(), "documents=8,rag_fraction=1.0")
    a, b = TraceText(t), TraceText(t)
    assert a.doc_sizes == b.doc_sizes and all(1024 <= n <= 8192 for n in a.doc_sizes)
    assert [len(d.split()) for d in a.docs] == a.doc_sizes
    picks = collections.Counter(a.session(sid)[1] for sid in range(2000))
    assert None not in picks and picks[0] == max(picks.values()) and picks[0] > 2 * picks[7]
    msgs, questions = a.first_messages(3)
    k, doc, qs = a.session(3)
    assert msgs == [{"role": "system", "content": a.systems[k]}]
    assert questions[0] == f"{a.docs[doc]} {qs[0]}" and questions[1:] == qs[1:]
    chats = TraceText(parse_overrides(Trace(), "rag_fraction=0"))
    assert all(chats.session(sid)[1] is None for sid in range(50))


def test_readme_block_is_generated_from_the_committed_record():
    with open(os.path.join(ROOT, RECORD, "serve.json")) as f:
        rec = json.load(f)
    with open(os.path.join(ROOT, "benchmarks", "README.md")) as f:
        readme = f.read()
    block = readme[readme.index(serve_report.START) + len(serve_report.START):readme.index(serve_report.END)]
    assert block.strip("\n").split("\n") == serve_report.results_block(rec, RECORD)
    assert serve_report.rewrite(readme, serve_report.results_block(rec, RECORD)) == readme
    assert [g["verdict"] for g in rec["summary"]["goals"]] and rec["summary"]["rounds"] >= 5
