"""cxlalloc serve on a transformers whose serving managers moved (5.25 renamed CBGenerateManager to
CBGenerateRunner, and CI's unpinned install then failed every serve test with an AttributeError after the model
loaded): one RuntimeError naming the missing name and the tested release, before anything loads."""

import pytest

pytest.importorskip("transformers.cli.serving")


def test_serving_modules_name_a_missing_manager_and_the_tested_release(monkeypatch):
    from transformers.cli.serving import utils as serving_utils

    from cxlalloc.hf.serving import serving_modules

    serving_modules()  # the installed (tested) transformers has both managers
    monkeypatch.delattr(serving_utils, "CBGenerateManager")
    with pytest.raises(RuntimeError) as e:
        serving_modules()
    msg = str(e.value)
    assert "transformers.cli.serving.utils.CBGenerateManager" in msg and "transformers==5.24.0" in msg, msg
