"""Block keys and model fingerprints: what must and must not share a key."""

import pytest

torch = pytest.importorskip("torch")

from cxlalloc.kvstore import keys as K  # noqa: E402


def test_chain_keys_name_the_block_and_every_token_before_it():
    root = K.root_key(b"f" * 32, b"layout", 4, None)
    a = K.chain_keys(root, list(range(10)), 4)
    assert len(a) == 2 and all(len(k) == K.KEY_BYTES for k in a)  # the partial third block has no key
    b = K.chain_keys(root, [0, 1, 2, 3, 4, 5, 6, 7, 99], 4)
    assert b == a  # the same full blocks
    c = K.chain_keys(root, [9, 1, 2, 3, 4, 5, 6, 7], 4)
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 changes every later key
    assert K.chain_keys(root, torch.arange(10), 4) == a  # tensors and lists agree
    assert K.chain_keys(root, list(range(10)), 4, max_blocks=1) == a[:1]
    assert K.chain_keys(root, list(range(4, 8)), 4, start_key=a[0]) == a[1:2]


def test_roots_differ_by_fingerprint_layout_block_size_and_namespace():
    base = K.root_key(b"f" * 32, b"L", 16, None)
    assert K.root_key(b"g" * 32, b"L", 16, None) != base
    assert K.root_key(b"f" * 32, b"M", 16, None) != base
    assert K.root_key(b"f" * 32, b"L", 32, None) != base
    assert K.root_key(b"f" * 32, b"L", 16, "tenant") != base
    assert K.root_key(b"f" * 32, b"L", 16, "") != base  # an empty namespace is still a namespace
    assert K.root_key(b"f" * 32, b"L", 16, None) == base


def _tiny(seed=0, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=100)
    cfg.update(kw)
    return LlamaForCausalLM(LlamaConfig(**cfg)).eval()


def test_fingerprint_follows_weights_dtype_and_config_not_paths():
    a, b = _tiny(0), _tiny(0)
    assert K.model_fingerprint(a) == K.model_fingerprint(b)
    b.config._name_or_path = "/another/copy/of/the/same/checkpoint"
    b.config.use_cache = False  # a run-time switch
    assert K.model_fingerprint(a) == K.model_fingerprint(b)
    assert K.model_fingerprint(_tiny(1)) != K.model_fingerprint(a)  # other weights
    assert K.model_fingerprint(_tiny(0).to(torch.bfloat16)) != K.model_fingerprint(a)
    assert K.model_fingerprint(_tiny(0, rope_theta=1234.0)) != K.model_fingerprint(a)  # config
    before = K.weights_version(a)
    with torch.no_grad():
        a.model.layers[0].mlp.up_proj.weight.add_(1e-3)
    assert K.weights_version(a) != before and K.model_fingerprint(a) != K.model_fingerprint(b)


def test_weight_digest_of_a_large_tensor_samples_within_bounds_and_full_sees_every_byte():
    m = torch.nn.Linear(4096, 5000, bias=False)  # 20.5M elements: float index math would run past the end
    d = K.weights_digest(m)
    with torch.no_grad():
        m.weight[0, 0] += 1.0  # a sampled element (the first)
    assert K.weights_digest(m) != d
    d_full = K.weights_digest(m, "full")
    with torch.no_grad():
        m.weight[1234, 777] += 1.0  # almost surely not sampled
    assert K.weights_digest(m, "full") != d_full
    with pytest.raises(ValueError, match="kv_store_fingerprint"):
        K.weights_digest(m, "partial")


def test_namespaced_keys_are_namespaced_key_of_each():
    from cxlalloc.kvstore.keys import namespaced_key, namespaced_keys

    ks = [bytes([i]) * 32 for i in range(5)]
    for ns in ("", "tenant", "é"):
        assert namespaced_keys(ns, ks) == [namespaced_key(ns, k) for k in ks]
    assert namespaced_keys("a", ks) != namespaced_keys("b", ks) and namespaced_keys("a", []) == []


def test_docs_give_the_fingerprint_default_the_code_uses():
    """Every "`kv_store_fingerprint`, default `X`" / "default `kv_store_fingerprint="X"`"
    in README and docs/ names the default of cxlalloc.kvstore.keys (kv-server.md once said `sampled`)."""
    import pathlib
    import re

    from cxlalloc.kvstore.keys import DEFAULT_WEIGHT_MODE

    root = pathlib.Path(__file__).resolve().parents[2]
    found = []
    for f in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = f.read_text(encoding="utf-8")
        found += [(f.name, m) for m in re.findall(r"`kv_store_fingerprint`, default `(\w+)`", text)]
        found += [(f.name, m) for m in re.findall(r"default `kv_store_fingerprint=\"(\w+)\"`", text)]
    assert len(found) >= 2, found  # the scan finds what it is for
    assert all(m == DEFAULT_WEIGHT_MODE for _, m in found), found


def test_weight_tensors_walks_once_and_names_what_torch_names():
    """weight_tensors' single walk gives torch's named_parameters() then named_buffers() pairs, the same
    tensors in the same order (a tied parameter once, a None buffer skipped, a shared buffer once); a model
    class that overrides named_parameters gets its own answer."""
    import torch

    from cxlalloc.kvstore.keys import weight_tensors

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(5, 4)
            self.inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
            self.head = torch.nn.Linear(4, 5, bias=False)
            self.head.weight = self.emb.weight                       # tied
            self.register_buffer("table", torch.arange(3.0))
            self.inner[0].register_buffer("table", self.table)       # the same buffer twice
            self.inner[1].register_buffer("gone", None)              # a None buffer
            self.again = self.inner                                  # a module reachable twice

    def torch_pairs(m):
        return list(m.named_parameters()) + [("buffer:" + n, b) for n, b in m.named_buffers() if b is not None]

    net = Net()
    got, want = weight_tensors(net), torch_pairs(net)
    assert [n for n, _ in got] == [n for n, _ in want] == [
        "emb.weight", "inner.0.weight", "inner.0.bias", "inner.1.weight", "inner.1.bias", "buffer:table"]
    assert all(a is b for (_, a), (_, b) in zip(got, want))

    class Renamed(Net):
        def named_parameters(self, *a, **k):
            return ((f"renamed.{n}", p) for n, p in super().named_parameters(*a, **k))

    assert weight_tensors(Renamed())[0][0] == "renamed.emb.weight"
