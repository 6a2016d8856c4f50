"""Fixtures of the app tests: local model directories the demo loads with
``--model`` (tiny random Llama weights and a word-level tokenizer)."""

import pytest


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
