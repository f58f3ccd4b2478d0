"""Fixtures for rollout tests (test doubles live in rollout_fakes.py)."""

from __future__ import annotations

import pytest
from rollout_fakes import DictRetriever


@pytest.fixture
def dict_retriever():
    return DictRetriever()


@pytest.fixture(scope="session")
def varied_model(smollm2_tokenizer):
    """A random 2-layer Llama with an untied, large-init output layer: unlike ``tiny_model``
    (whose tied embeddings make greedy decoding repeat the last token) its greedy text
    varies token to token, so stop strings can be placed inside a generation."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = smollm2_tokenizer
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        initializer_range=0.5,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    return model.eval()
