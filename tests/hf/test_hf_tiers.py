"""KV placement under a device budget (simulation): the KV cache spills oldest
tokens first while weights stay in VRAM, copies stay flat per decode step, and
cases C01, C03, C04 of docs/cases.md scaled down.

Activations are torch's own CPU memory in simulation and are not modelled; the
device budget here covers weights + KV (what wrap() places in the allocator)."""

import time

import pytest
from tests.helpers.hf_util import (MiB, assert_same, gen, kv_bytes_per_token, padded_batch, tiny_gpt2, tiny_gpt_neo,
                                   tiny_llama, torch, weight_footprint)

import cxlalloc.hf as hf
from cxlalloc.hf import returned_cache

CHUNK = 2 * MiB


def wide_llama():
    # 8 KiB of K+V per token per sequence: 256 tokens per 2 MiB chunk at batch 1
    return tiny_llama(hidden=256, heads=8, kv_heads=8, layers=4)


def committed_tiers(cache):
    out = []
    for s in cache._stores():
        out += [(off, n, t) for off, n, t in s.extent.tiers() if t != "none"]
    return out


def assert_oldest_on_host(cache):
    """Host chunks form a prefix of each store (the oldest tokens), device chunks the rest."""
    for s in cache._stores():
        tiers = [t for _, _, t in s.extent.tiers() if t != "none"]
        assert tiers == sorted(tiers, key=lambda t: t != "host"), f"placement is not oldest-first: {s.extent.tiers()}"


def test_kv_spills_oldest_first_while_weights_stay_on_device(fresh_sim):
    m = wide_llama()
    fp = weight_footprint(m)
    inp = padded_batch(batch=4, length=200)
    n_new = 150
    per_token = kv_bytes_per_token(m, batch=4)  # 32 KiB: 64 tokens per chunk
    kv_need = (200 + n_new - 1) * per_token
    limit = fp + 3 * CHUNK
    assert fp + kv_need > limit, "premise: weights + KV do not fit under the limit"
    ref = gen(m, **inp, max_new_tokens=n_new, min_new_tokens=n_new)
    hf.wrap(m, device_limit=limit, host_limit=256 * MiB)
    out = gen(m, **inp, max_new_tokens=n_new, min_new_tokens=n_new)
    assert_same(ref, out)  # bit-identical scores too
    c = returned_cache(out)
    st = c.kv_stats()
    s = hf.stats(m)
    # KV: the newest 3 chunks in VRAM, the rest (oldest tokens) on the host tier.
    assert st["kv_device_bytes"] == 3 * CHUNK
    assert st["kv_host_bytes"] == -(-kv_need // CHUNK) * CHUNK - 3 * CHUNK > 0
    assert_oldest_on_host(c)
    assert s["kv"]["host_bytes"] == st["kv_host_bytes"]
    # Weights (and anything else) never went to the host tier.
    assert s["weight"]["host_bytes"] == 0 and s["weight"]["peak_host_bytes"] == 0
    assert s["weight"]["device_bytes"] >= s["hf"]["weight_bytes"]
    assert s["other"]["peak_host_bytes"] == 0
    assert s["device"]["peak_reserved_bytes"] <= limit
    # Decode-time growth demoted the oldest device chunks (no copy by the cache).
    assert s["demoted_bytes"] > 0 and st["demoted_bytes"] == s["demoted_bytes"]
    # Bytes copied per decode step: exactly the new token's K/V, at every context length.
    assert st["step_bytes_copied"][1:] == [per_token] * (n_new - 1)
    assert st["bytes_copied_existing"] == 0


def test_kv_device_limit_caps_kv_in_vram(fresh_sim):
    m = wide_llama()
    inp = padded_batch(batch=4, length=200)
    ref = gen(m, **inp, max_new_tokens=40, min_new_tokens=40)
    hf.wrap(m, device_limit=256 * MiB, host_limit=256 * MiB, kv_device_limit=2 * CHUNK)
    out = gen(m, **inp, max_new_tokens=40, min_new_tokens=40)
    assert_same(ref, out)
    st = returned_cache(out).kv_stats()
    assert st["kv_device_bytes"] == 2 * CHUNK and st["kv_host_bytes"] > 0
    assert_oldest_on_host(returned_cache(out))


def test_c01_prompt_length_sweep_under_a_cap(fresh_sim):
    """C01 scaled: tiny GPT-Neo (global/local attention), prompt 128 -> 2048 tokens
    in steps of 128, 8 new tokens, batch 2, under a device cap holding the weights
    and 3 chunks (768 tokens) of KV.  No OOM; greedy tokens identical to the
    uncapped run at every length; KV on the host 0 while it fits, then rising."""
    m = tiny_gpt_neo(attn="eager")
    fp = weight_footprint(m)
    per_token = kv_bytes_per_token(m, batch=2)  # 8 KiB
    cap = fp + 3 * CHUNK
    lengths = list(range(128, 2049, 128))
    g = torch.Generator().manual_seed(0)
    prompts = {L: torch.randint(3, 1000, (2, L), generator=g) for L in lengths}
    refs = {}
    baseline_need = {}
    for L in lengths:
        r = gen(m, input_ids=prompts[L], max_new_tokens=8, min_new_tokens=8)
        refs[L] = r.sequences
        kv = sum(layer.keys.nelement() * 4 * 2 for layer in returned_cache(r).layers)
        baseline_need[L] = fp + kv
    hf.wrap(m, device_limit=cap, host_limit=256 * MiB)
    a = hf.allocator(m)
    host = {}
    for L in lengths:
        spilled0 = a.stats()["spilled_bytes"]
        out = gen(m, input_ids=prompts[L], max_new_tokens=8, min_new_tokens=8)
        assert torch.equal(out.sequences, refs[L]), f"tokens differ at prompt length {L}"
        st = returned_cache(out).kv_stats()
        host[L] = st["kv_host_bytes"]
        kv_chunks = -(-(L + 7) * per_token // CHUNK)
        if kv_chunks <= 3:
            assert host[L] == 0 and a.stats()["spilled_bytes"] == spilled0, L
        else:
            assert host[L] == (kv_chunks - 3) * CHUNK, L
            assert baseline_need[L] > cap, "a capped baseline could not hold this"
        assert a.stats()["device"]["peak_reserved_bytes"] <= cap
        del out
    assert host[lengths[0]] == 0 and host[lengths[-1]] > 0
    values = [host[L] for L in lengths]
    assert values == sorted(values), "host bytes rise only with the length"
    assert a.stats()["ooms"] == 0


@pytest.mark.parametrize("mode", ["sample-nrs32", "beam16"])
def test_c03_many_sequences_and_beams_under_a_quarter_cap(fresh_sim, mode):
    """C03 scaled: tiny GPT-2, a ~350-token prompt; (i) sampling with 32 return
    sequences, (ii) 16-beam search; device cap = weights + 1/4 of the KV need.
    Outputs (and beam scores) identical to the uncapped baseline."""
    m = tiny_gpt2(hidden=128)
    fp = weight_footprint(m)
    ids = torch.randint(3, 1000, (1, 350), generator=torch.Generator().manual_seed(4))
    if mode == "sample-nrs32":
        kw = dict(do_sample=True, num_return_sequences=32, max_new_tokens=32, min_new_tokens=32)
        n_seq, n_new = 32, 32
    else:
        kw = dict(num_beams=16, max_new_tokens=16, min_new_tokens=16, early_stopping=True)
        n_seq, n_new = 16, 16
    kv_need = (350 + n_new - 1) * kv_bytes_per_token(m, batch=n_seq)
    t0 = time.perf_counter()
    ref = gen(m, input_ids=ids, seed=5, **kw)
    t_ref = time.perf_counter() - t0
    cap = fp + kv_need // 4
    hf.wrap(m, device_limit=cap, host_limit=256 * MiB)
    t0 = time.perf_counter()
    out = gen(m, input_ids=ids, seed=5, **kw)
    t_cxl = time.perf_counter() - t0
    assert_same(ref, out)
    st = returned_cache(out).kv_stats()
    s = hf.stats(m)
    assert st["kv_host_bytes"] > kv_need // 2, "most of the KV lives on the host tier"
    assert s["device"]["peak_reserved_bytes"] <= cap and s["weight"]["host_bytes"] == 0
    if mode == "beam16":
        assert st["reorders"] > 0 and st["reorder_rows"] > 0
    print(f"C03 {mode}: baseline {t_ref:.2f} s, cxlalloc {t_cxl:.2f} s, KV host {st['kv_host_bytes'] / MiB:.1f} MiB")


class SpikeProcessor:
    """A LogitsProcessor that, at the first generation step (right after the
    prefill), allocates a transient through the allocator, as transformers
    4.45-4.46.2 cloned the full [B, S, V] logits (case C04), then frees it."""

    def __init__(self, allocator, cache_ref, extra, new_step=False):
        self.a, self.cache_ref, self.extra, self.new_step = allocator, cache_ref, extra, new_step
        self.calls = 0
        self.report = {}

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == 1:
            a = self.a
            cache = self.cache_ref()
            before = dict(tiers=committed_tiers(cache), stats=a.stats())
            # Larger than the free device room by `extra`: it fits on the device
            # only if `extra` bytes of KV are demoted.
            d = before["stats"]["device"]
            self.nbytes = d["limit_bytes"] - d["reserved_bytes"] + self.extra
            self.report["nbytes"] = self.nbytes
            if self.new_step:  # negative control: KV not in the current step's working set
                a.mark_step()
            t = a.tensor((self.nbytes // 4,), torch.float32, tag="other")
            self.report["tier"] = a.tier_of(t.data_ptr())
            mid = a.stats()
            del t
            a.empty_cache()
            after = dict(tiers=committed_tiers(cache), stats=a.stats())
            self.report.update(before=before, mid=mid, after=after)
        return scores


def test_c04_transient_spike_does_not_evict_kv(fresh_sim):
    m = wide_llama()
    fp = weight_footprint(m)
    inp = padded_batch(batch=8, length=200)
    kv_need = (200 + 16 - 1) * kv_bytes_per_token(m, batch=8)  # 7 chunks
    limit = fp + (-(-kv_need // CHUNK)) * CHUNK + CHUNK  # KV fits with one chunk to spare
    ref = gen(m, **inp, max_new_tokens=16, min_new_tokens=16)
    hf.wrap(m, device_limit=limit, host_limit=256 * MiB)
    a = hf.allocator(m)

    def run(new_step):
        from transformers import LogitsProcessorList

        # > 10 MiB: the engine gives 1-10 MiB requests torch's 20 MiB segments,
        # which no demotion of 7 chunks could make room for.
        proc = SpikeProcessor(a, lambda: hf.kv_cache(m), 5 * CHUNK, new_step=new_step)
        out = gen(m, **inp, max_new_tokens=16, min_new_tokens=16, logits_processor=LogitsProcessorList([proc]))
        return out, proc.report

    out, r = run(new_step=False)
    assert_same(ref, out)
    # The spike could fit on the device only by demoting 5 chunks of KV read in
    # this step: it goes to the host tier instead, and KV stays where it was.
    assert r["tier"] == "host"
    assert r["after"]["tiers"] == r["before"]["tiers"] and all(t == "device" for _, _, t in r["before"]["tiers"])
    assert r["mid"]["demoted_bytes"] == r["before"]["stats"]["demoted_bytes"]
    assert r["mid"]["host"]["allocated_bytes"] - r["before"]["stats"]["host"]["allocated_bytes"] >= r["nbytes"]
    assert r["after"]["stats"]["host"]["allocated_bytes"] == r["before"]["stats"]["host"]["allocated_bytes"] == 0
    st = returned_cache(out).kv_stats()
    assert st["kv_host_bytes"] == 0, "no new spill in the decode steps after the spike"
    assert hf.stats(m)["spilled_bytes"] == r["mid"]["spilled_bytes"]
    del out

    # Negative control: the same spike outside the step's working set demotes KV.
    out, r = run(new_step=True)
    assert_same(ref, out)
    assert r["tier"] == "device"
    assert r["mid"]["demoted_bytes"] - r["before"]["stats"]["demoted_bytes"] >= 5 * CHUNK
    assert any(t == "host" for _, _, t in r["after"]["tiers"])

