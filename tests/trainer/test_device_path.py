"""The single-GPU path, checked on a CPU: the precision policy and its config errors, backend choice on
CUDA, tensor placement (on the `meta` device: a tensor left on the CPU raises), bf16 autocast with fp32
master weights, optimizer state and log-probs, and `stratarl train` with trainer.precision=bf16."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from stratarl.config_errors import ConfigError
from stratarl.infra import precision as precision_module
from stratarl.infra.precision import DevicePolicy, check_placement, resolve_precision
from stratarl.rollout.backends import AutocastGenerator, make_generator
from stratarl.rollout.generation import Generator
from stratarl.trainer.config import load_config
from stratarl.trainer.settings import UpdateSettings

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def _tiny_llama(vocab: int = 50, hidden: int = 16, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


# --------------------------------------------------------------------------- config and policy


def test_precision_defaults_to_auto_and_resolves_to_fp32_on_a_cpu():
    cfg = load_config(TINY)
    assert cfg.trainer.precision == "auto"
    assert resolve_precision("cpu", "auto") == "fp32"
    assert DevicePolicy.create("cpu").autocast_dtype is None


def test_auto_is_bf16_on_a_cuda_device_that_supports_it(monkeypatch):
    monkeypatch.setattr(precision_module, "bf16_supported", lambda device: device.type == "cuda")
    assert resolve_precision("cuda", "auto") == "bf16"
    assert resolve_precision("cuda:0", "fp32") == "fp32"
    monkeypatch.setattr(precision_module, "bf16_supported", lambda device: device.type == "cpu")
    assert resolve_precision("cuda", "auto") == "fp32"  # a pre-Ampere GPU: fp32, silently
    with pytest.raises(ConfigError, match=r"trainer.precision.*no bf16 support.*trainer.precision=fp32"):
        resolve_precision("cuda", "bf16")


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.precision=fp16", r"trainer.precision.*did you mean 'bf16'.*auto, fp32, bf16"),
        ("trainer.precision=int8", r"trainer.precision.*int8"),
        ("trainer.device=mps", r"trainer.device.*cuda:N"),
        ("trainer.device=cuda:x", r"trainer.device.*cuda:N"),
    ],
)
def test_bad_device_or_precision_is_a_one_line_config_error(override, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config(TINY, [override])
    assert "\n" not in str(info.value)


def test_bf16_on_a_cpu_and_cuda_N_are_accepted_by_the_config():
    cfg = load_config(TINY, ["trainer.precision=bf16", "trainer.device=cuda:1"])
    assert (cfg.trainer.precision, cfg.trainer.device) == ("bf16", "cuda:1")


def test_check_device_refuses_a_missing_gpu_and_an_index_past_the_visible_ones(monkeypatch):
    from stratarl.trainer.setup import check_device

    check_device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"trainer.device.*Fix: set trainer.device=cpu"):
        check_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    check_device("cuda:0")
    with pytest.raises(ConfigError, match=r"'cuda:1': only 1 CUDA GPU\(s\) are visible.*trainer.device=cuda:0"):
        check_device("cuda:1")


def test_cuda_never_takes_the_cpu_fast_decoder():
    cuda, cpu = DevicePolicy(torch.device("cuda"), "bf16"), DevicePolicy(torch.device("cpu"), "fp32")
    assert cuda.fast_decode("kv_cache") is False and cuda.fast_decode("kv_cache_generic") is False
    assert cpu.fast_decode("kv_cache") is None and cpu.fast_decode("kv_cache_generic") is False
    assert DevicePolicy(torch.device("cpu"), "bf16").fast_decode("kv_cache") is None


def test_bf16_on_a_cpu_generates_through_the_fast_decoder_on_bf16_weight_copies(smollm2_tokenizer):
    """bf16 on a CPU: the fast decoder on bf16 copies of the weights (no autocast wrapper), a batch of 3+ rows
    taking the packed path; the model's own weights stay fp32."""
    from stratarl.models import build_tiny_model
    from stratarl.rollout.generation import KVCacheGenerator, SamplingParams

    model = build_tiny_model(smollm2_tokenizer, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    bf16 = DevicePolicy(torch.device("cpu"), "bf16")
    generator = make_generator(model, smollm2_tokenizer, "kv_cache", seed=0, policy=bf16)
    assert isinstance(generator, KVCacheGenerator) and generator.fast_decoder is not None
    assert generator.fast_decoder.dtype == torch.bfloat16
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    outputs = generator.generate(prompts, SamplingParams(max_new_tokens=4, temperature=1.0))
    assert len(outputs) == 4 and all(1 <= len(o.token_ids) <= 4 for o in outputs)
    assert generator.fast_decoder.k_cache.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())
    generic = make_generator(model, smollm2_tokenizer, "kv_cache_generic", seed=0, policy=bf16)
    assert isinstance(generic, AutocastGenerator) and generic.inner.fast_decoder is None


def test_make_generator_on_cuda_builds_the_generic_loop_under_autocast(smollm2_tokenizer):
    from stratarl.models import build_tiny_model
    from stratarl.rollout.generation import KVCacheGenerator

    model = build_tiny_model(smollm2_tokenizer, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    on_cpu = make_generator(model, smollm2_tokenizer, "kv_cache", seed=0, policy=DevicePolicy.create("cpu", "auto"))
    assert isinstance(on_cpu, KVCacheGenerator) and on_cpu.fast_decoder is not None  # the CPU fast path
    # The model stays on the CPU; the policy says CUDA, as it would for a model on the GPU.
    on_cuda = make_generator(
        model, smollm2_tokenizer, "kv_cache", seed=0, policy=DevicePolicy(torch.device("cuda"), "bf16")
    )
    assert isinstance(on_cuda, AutocastGenerator) and on_cuda.policy.device.type == "cuda"
    assert isinstance(on_cuda.inner, KVCacheGenerator) and on_cuda.inner.fast_decoder is None
    assert on_cuda.supports_cache_keys is False and on_cuda.rng is on_cuda.inner.rng  # attributes pass through


def test_autocast_generator_runs_generate_under_autocast():
    seen = {}

    class Probe(Generator):
        rng = "the inner rng"

        def generate(self, prompts, params, max_new_tokens=None):
            seen["enabled"] = torch.is_autocast_enabled("cpu")
            seen["dtype"] = torch.get_autocast_dtype("cpu")
            return ["done"]

    wrapped = AutocastGenerator(Probe(), DevicePolicy(torch.device("cpu"), "bf16"))
    assert wrapped.generate([[1]], None) == ["done"] and wrapped.rng == "the inner rng"
    assert seen == {"enabled": True, "dtype": torch.bfloat16}
    assert not torch.is_autocast_enabled("cpu")


# --------------------------------------------------------------------------- placement


def test_build_learner_puts_value_head_reference_and_normaliser_on_the_models_device():
    from stratarl.trainer.learner import build_learner

    with torch.device("meta"):
        model = _tiny_llama()
    cfg = load_config(TINY, ["algo.name=so_ppo", "algo.kl_coef=0.01"])
    learner = build_learner(model, cfg, total_optimizer_steps=4)
    assert learner.value_head is not None and learner.ref_model is not None and learner.normalizer is not None
    check_placement(model, "meta", learner.value_head, learner.ref_model)
    assert all(c.device.type == "meta" for c in learner.normalizer.c_buffers)


def test_check_placement_names_a_parameter_on_the_wrong_device_or_dtype():
    model = _tiny_llama()
    with pytest.raises(RuntimeError, match=r"on cpu, expected meta"):
        check_placement(model, "meta")
    model.lm_head.weight.data = model.lm_head.weight.data.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"bfloat16; master weights must be fp32"):
        check_placement(model, "cpu")


def test_advantage_inputs_are_built_on_the_batch_device():
    from stratarl.trainer.batch import ScoredBatch, collate_sequences
    from stratarl.trainer.step import advantage_inputs, compute_advantages

    seen = {}

    def estimator(inputs):  # records what the trainer built; meta tensors cannot be checked for NaN
        seen.update({k: v.device.type for k, v in vars(inputs).items() if isinstance(v, torch.Tensor)})
        return torch.zeros_like(inputs.response_mask), torch.zeros_like(inputs.response_mask)

    tokens = collate_sequences([[5, 6]] * 4, [[7, 8, 9], [7, 8], [7], [7, 8]], [[1, 1, 1], [1, 1], [1], [1, 0]], 0)
    tokens = tokens.to("meta")
    zeros = torch.zeros(tokens.response_mask.shape, device="meta")
    scored = ScoredBatch(**vars(tokens), old_logprobs=zeros, on_policy=False, ref_logprobs=None, old_values=zeros)
    batch = compute_advantages(
        estimator, scored, advantage_inputs(scored, [1.0, 0.0, 1.0, 0.0], [0, 0, 1, 1], [0, 1, 0, 1])
    )
    assert {"rewards", "group_ids", "response_mask", "strata_ids", "values"} <= seen.keys()
    assert set(seen.values()) == {"meta"}
    assert batch.advantages.device.type == "meta"


# --------------------------------------------------------------------------- bf16 numerics


def _batch():
    from stratarl.trainer.batch import collate_sequences

    prompts = [[3, 4, 5], [3, 4, 5], [6, 7]]
    responses = [[8, 9, 10, 11], [12, 13], [14, 15, 16]]
    masks = [[1, 1, 0, 1], [1, 1], [1, 1, 1]]
    return collate_sequences(prompts, responses, masks, 0)


def test_bf16_autocast_runs_matmuls_in_bf16_and_returns_fp32_logprobs():
    from stratarl.trainer.logprobs import response_logprobs

    model = _tiny_llama()
    batch = _batch()
    out_dtypes = []
    hook = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o: out_dtypes.append(o.dtype))
    args = (batch.input_ids, batch.attention_mask, batch.prompt_lengths, batch.response_mask)
    with torch.no_grad():
        fp32 = response_logprobs(model, *args, with_entropy=True)
        with DevicePolicy(torch.device("cpu"), "bf16").autocast():
            bf16 = response_logprobs(model, *args, with_entropy=True)
    hook.remove()
    assert out_dtypes[0] == torch.float32 and out_dtypes[-1] == torch.bfloat16
    assert bf16["logprobs"].dtype == torch.float32 and bf16["entropy"].dtype == torch.float32
    assert not torch.equal(bf16["logprobs"], fp32["logprobs"])  # bf16 really ran
    # bf16 keeps ~3 significant digits; log-probs of a 50-word vocabulary are around -4.
    torch.testing.assert_close(bf16["logprobs"], fp32["logprobs"], atol=0.05, rtol=0.02)


def test_value_head_stays_fp32_under_autocast():
    from stratarl.trainer.critic import ValueHead

    head = ValueHead(16)
    torch.nn.init.normal_(head.linear.weight)
    hidden = torch.randn(2, 3, 16)
    with DevicePolicy(torch.device("cpu"), "bf16").autocast():
        values = head(hidden)
    assert values.dtype == torch.float32
    torch.testing.assert_close(values, head(hidden))


def test_bf16_update_keeps_fp32_weights_and_optimizer_state_with_gradients_close_to_fp32():
    from stratarl.trainer.batch import scatter_response_values
    from stratarl.trainer.config.resolve import bound_advantage
    from stratarl.trainer.learner import build_learner
    from stratarl.trainer.step import advantage_inputs, compute_advantages
    from stratarl.trainer.update import optimizer_step, score_batch

    grads = {}
    for precision in ("fp32", "bf16"):
        cfg = load_config(TINY, ["algo.name=ppo", "algo.kl_coef=0.01", f"trainer.precision={precision}"])
        model = _tiny_llama()
        learner = build_learner(model, cfg, total_optimizer_steps=2)
        tokens = _batch()
        sampling = scatter_response_values([[0.0] * 4, [0.0] * 2, [0.0] * 3], tokens.response_lengths)
        scored = score_batch(learner, tokens, UpdateSettings.from_config(cfg), sampling)
        assert scored.old_logprobs.dtype == scored.ref_logprobs.dtype == scored.old_values.dtype == torch.float32
        batch = compute_advantages(
            bound_advantage(cfg.algorithm), scored, advantage_inputs(scored, [1.0, 0.0, 0.5], [0, 0, 1], [0, 0, 0])
        )
        # Keep the accumulated gradient: zero_grad runs inside optimizer_step, so record it from a hook.
        params = dict(model.named_parameters())
        for name, p in params.items():
            p.register_hook(lambda g, name=name: grads.setdefault(precision, {}).__setitem__(name, g.clone()))
        optimizer_step(learner, batch, UpdateSettings.from_config(cfg))
        check_placement(model, "cpu", learner.value_head, learner.ref_model)
        for group in learner.optimizer.param_groups:
            for p in group["params"]:
                state = learner.optimizer.state[p]
                assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert grads["fp32"].keys() == grads["bf16"].keys()
    for name in grads["fp32"]:
        g32, g16 = grads["fp32"][name], grads["bf16"][name]
        assert g16.dtype == torch.float32, name
        # bf16 forward: gradients agree to a few per cent of their scale, not bit for bit.
        scale = float(g32.abs().max()) + 1e-8
        assert float((g16 - g32).abs().max()) <= 0.05 * scale, name


@pytest.mark.parametrize("algo", sorted(__import__("stratarl.algos.presets", fromlist=["PRESETS"]).PRESETS))
def test_every_preset_scores_and_updates_under_bf16(algo):
    from stratarl.algos.registry import advantage_info
    from stratarl.trainer.config.resolve import bound_advantage
    from stratarl.trainer.learner import build_learner
    from stratarl.trainer.step import advantage_inputs, compute_advantages
    from stratarl.trainer.update import score_batch, update_policy

    cfg = load_config(
        TINY,
        [
            f"algo.name={algo}",
            "algo.kl_coef=0.01",
            "trainer.precision=bf16",
            "trainer.epochs=1",
            "trainer.mini_batches=1",
        ],
    )
    model = _tiny_llama()
    learner = build_learner(model, cfg, total_optimizer_steps=1)
    scored = score_batch(learner, _batch(), UpdateSettings.from_config(cfg))
    # GiGPO reads each turn's anchor state (rollout 0 has two turns, the others one).
    states = [("", "\x1eobs"), ("",), ("",)] if advantage_info(cfg.algorithm.advantage).needs_step_states else None
    batch = compute_advantages(
        bound_advantage(cfg.algorithm), scored, advantage_inputs(scored, [1.0, 0.0, 0.5], [0, 0, 1], [0, 1, 0], states)
    )
    before = [p.detach().clone() for p in model.parameters()]
    metrics = update_policy(learner, batch, UpdateSettings.from_config(cfg), torch.Generator().manual_seed(0))
    assert math.isfinite(metrics["loss/policy"]) and metrics["optim/skipped_steps"] == 0.0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    check_placement(model, "cpu", learner.value_head, learner.ref_model)  # still fp32 master weights
    if learner.value_head is not None:
        assert math.isfinite(metrics["loss/value"])


def test_sft_step_under_bf16_gives_fp32_gradients_close_to_fp32():
    from stratarl.trainer.warmstart.demos import Demonstration
    from stratarl.trainer.warmstart.sft import sft_step

    demos = [Demonstration(prompt_ids=[3, 4], response_ids=[5, 6, 7], response_mask=[1, 0, 1], kind="correct")]
    grads = {}
    for precision in ("fp32", "bf16"):
        model = _tiny_llama()
        stats = sft_step(
            model, demos, 0, micro_batch_tokens=64, chunk_tokens=8, policy=DevicePolicy.create("cpu", precision)
        )
        assert math.isfinite(stats["loss"])
        grads[precision] = model.lm_head.weight.grad
    assert grads["bf16"].dtype == torch.float32
    scale = float(grads["fp32"].abs().max())
    assert 0 < float((grads["bf16"] - grads["fp32"]).abs().max()) <= 0.05 * scale


# --------------------------------------------------------------------------- the CLI, bf16 on a CPU


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_train_with_bf16_on_a_cpu(algo, tmp_path, tiny_overrides, reward_path):
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    run = tmp_path / algo
    command = [
        sys.executable,
        "-m",
        "stratarl.cli",
        "train",
        str(TINY),
        *tiny_overrides,
        f"algo.name={algo}",
        "trainer.precision=bf16",
        "trainer.steps=1",
        "logging.tensorboard=false",
        "--run-dir",
        str(run),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TINY.parents[1]), str(reward_path)])}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(math.isfinite(rows[-1][k]) for k in ("loss/policy", "optim/grad_norm"))
    if algo == "ppo":
        assert math.isfinite(rows[-1]["loss/value"])
    assert "precision: bf16" in (run / "config.yaml").read_text()
    weights = load_file(str(run / "checkpoints" / "step_000001" / "model.safetensors"))
    assert weights and all(w.dtype == torch.float32 for w in weights.values())


def test_bf16_native_is_bf16_only_where_the_device_has_bf16_matmul_units(monkeypatch):
    monkeypatch.setattr(precision_module, "cpu_bf16_matmul", lambda: "AVX512-BF16")
    assert resolve_precision("cpu", "bf16_native") == "bf16"
    monkeypatch.setattr(precision_module, "cpu_bf16_matmul", lambda: None)
    assert resolve_precision("cpu", "bf16_native") == "fp32"
    assert resolve_precision("cpu", "auto") == "fp32"  # auto never picks bf16 on a CPU
    monkeypatch.setattr(precision_module, "bf16_supported", lambda device: device.type == "cuda")
    assert resolve_precision("cuda", "bf16_native") == "bf16"


def test_a_bf16_native_warm_start_is_cached_under_the_precision_it_resolves_to(monkeypatch):
    from stratarl.trainer.warmstart.stages import warm_start_key

    monkeypatch.setattr(precision_module, "cpu_bf16_matmul", lambda: None)  # a CPU without bf16 units
    cfg = load_config(TINY, ["trainer.precision=bf16_native"])
    assert "precision" not in warm_start_key(cfg)
    assert warm_start_key(cfg) == warm_start_key(load_config(TINY, ["trainer.precision=fp32"]))
    monkeypatch.setattr(precision_module, "cpu_bf16_matmul", lambda: "AMX")  # the same config on an AMX CPU
    assert warm_start_key(load_config(TINY, ["trainer.precision=bf16_native"]))["precision"] == "bf16"


def test_cpu_bf16_matmul_reads_the_cpu_flags(monkeypatch, tmp_path):
    import builtins

    real_open = builtins.open
    for flags, expected in (
        ("fpu avx512f avx512_bf16", "AVX512-BF16"),
        ("fpu amx_bf16 avx512_bf16", "AMX"),
        ("fpu avx2", None),
    ):
        cpuinfo = tmp_path / "cpuinfo"
        cpuinfo.write_text(f"processor : 0\nflags\t\t: {flags}\n")
        monkeypatch.setattr(
            builtins, "open", lambda path, *a, **k: real_open(cpuinfo if path == "/proc/cpuinfo" else path, *a, **k)
        )
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
        assert precision_module.cpu_bf16_matmul() == expected
