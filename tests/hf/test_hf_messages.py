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
