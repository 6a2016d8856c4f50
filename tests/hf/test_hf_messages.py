"""What a wrapped model's user reads when the limits given to wrap() are too small."""

import pytest

from tests.helpers.hf_util import tiny_llama, torch

import cxlalloc
import cxlalloc.hf as hf


def test_oom_hint_names_wrap_not_cxlalloc():
    """The allocator was made by hf.wrap(model, ...): that is where its limits
    are raised; CXLALLOC cannot change them."""
    model = hf.wrap(tiny_llama(), device_limit="2MiB", host_limit=0)
    ids = torch.randint(3, 900, (8, 1000))
    with pytest.raises(cxlalloc.OutOfMemoryError) as e:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, pad_token_id=0)
    msg = str(e.value)
    assert "CXLALLOC" not in msg, msg
    assert msg.endswith('Raise host_limit or device_limit where this allocator is made (e.g. '
                        'cxlalloc.hf.wrap(model, ..., host_limit="64GiB")).'), msg


def test_host_limit_beyond_the_node_is_clamped_and_said_once():
    """docs/huggingface.md's ``host_limit="200GiB"`` on a smaller machine: wrap()
    uses the node's memory instead and says so once (it was accepted silently,
    and a later out-of-memory error then blamed a 200 GiB limit)."""
    import warnings

    from cxlalloc import topology
    from cxlalloc.engine import HostLimitWarning

    node0 = next(n for n in topology.read_topology()["nodes"] if n["id"] == 0)["total_bytes"]
    asked = 2 * node0 + (1 << 30)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        models = [hf.wrap(tiny_llama(), device_limit="64MiB", host_limit=asked, numa_node=0) for _ in range(2)]
    said = [w for w in got if issubclass(w.category, HostLimitWarning)]
    assert len(said) == 1, [str(w.message) for w in got]
    assert "'host_limit'" in str(said[0].message) and "NUMA node 0's memory" in str(said[0].message)
    for m in models:
        assert hf.stats(m)["host"]["limit_bytes"] == node0
