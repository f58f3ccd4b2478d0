"""Training-speed benchmark: phase times, update MFU and peak memory of `stratarl train`.

    python benchmarks/bench_train.py                       # demo config, 3 RL steps, no warm start
    python benchmarks/bench_train.py --steps 2 --config configs/tiny.yaml

Prints, all measured in this run on this machine:

1. fp32 matmul FLOP/s (the baseline every ratio below is against): the best of the model's MLP
   matmul shape and large square products.
2. Update micro-benchmark: forward + backward of the policy through the trainer's own
   code path (``response_logprobs`` + chunked selective log-softmax), all weights
   trainable, on the rollout shapes. MFU = tokens/s x 6 x params / matmul FLOP/s.
3. The RL loop for a few steps of the config: seconds per phase (generation,
   retrieval, log-probs, update), update tokens/s and its MFU (nominal 6 x params x
   tokens, and the work actually done when only the last layers train), peak RSS.
4. Optional: TRL's GRPOTrainer on an identical single-turn GRPO workload when
   ``trl`` is installed (``--trl``).

Targets (from the issue): update MFU >= 50 %, peak RSS <= 8 GB, step time <= 0.67 x TRL's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def matmul_flops(seconds_per_shape: float = 1.5) -> float:
    """Best fp32 FLOP/s over matmul shapes: the model's MLP shape [4096 x 576] @ [576 x 1536] and
    large squares (2048^3, 4096^3). The best of them is this machine's practical fp32 peak."""
    best = 0.0
    for m, k, n in ((4096, 576, 1536), (2048, 2048, 2048), (4096, 4096, 4096)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        a @ b  # warm-up
        end = time.perf_counter() + seconds_per_shape
        while time.perf_counter() < end:
            t = time.perf_counter()
            a @ b
            best = max(best, 2 * m * k * n / (time.perf_counter() - t))
    return best


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2  # Linux: KiB


def update_microbench(cfg, rows: int, prompt_len: int, response_len: int, repeats: int) -> dict:
    """Forward + backward (all weights trainable) through the trainer's log-prob path."""
    from stratarl.trainer.batch import collate_sequences
    from stratarl.trainer.logprobs import response_logprobs
    from stratarl.trainer.setup import load_policy

    model_cfg = type(cfg.model)(**{**cfg.model.__dict__, "trainable_layers": 0})
    model, tok = load_policy(model_cfg)
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    batch = collate_sequences([torch.randint(100, 40000, (prompt_len,), generator=g).tolist()] * rows,
                              [torch.randint(100, 40000, (response_len,), generator=g).tolist()] * rows,
                              [[1] * response_len] * rows, tok.pad_token_id)
    tokens = int(batch.attention_mask.sum())
    times = []
    model.train()
    for i in range(repeats + 1):
        t = time.perf_counter()
        out = response_logprobs(model, batch.input_ids, batch.attention_mask, batch.prompt_lengths,
                                batch.response_mask, chunk_tokens=cfg.trainer.logprob_chunk_tokens)
        (-(out["logprobs"]).sum() / batch.num_policy_tokens).backward()
        model.zero_grad(set_to_none=True)
        if i:  # the first pass warms up allocator and kernels
            times.append(time.perf_counter() - t)
    best = min(times)
    return {"params": params, "tokens": tokens, "seconds": best, "tokens_per_s": tokens / best,
            "flops_per_s": 6 * params * tokens / best}


def loop_bench(config: str, steps: int, overrides: list[str]) -> dict:
    """A few RL steps of ``config`` (no warm start, no eval); per-phase means over steps 2..N."""
    from stratarl.trainer.config import load_config
    from stratarl.trainer.metrics import read_metrics
    from stratarl.trainer.rl import train
    from stratarl.trainer.setup import set_threads

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(config, ["sft.enabled=false", "eval.before_after=false", f"trainer.steps={steps}",
                                   f"trainer.num_threads={torch.get_num_threads()}",  # the same threads as the baseline
                                   "logging.progress=false", "logging.tensorboard=false", "logging.num_transcripts=0",
                                   f"trainer.output_dir={tmp}", *overrides])
        set_threads(cfg.trainer.num_threads)
        started = time.perf_counter()
        train(cfg, Path(tmp) / "bench")
        wall = time.perf_counter() - started
        rows = read_metrics(Path(tmp) / "bench")
    measured = rows[1:] if len(rows) > 1 else rows
    keys = ["time/generation", "time/retrieval", "time/logprobs", "time/update", "time/step",
            "perf/update_tokens_per_s", "perf/generation_tokens_per_s", "rollout/response_length_mean",
            "rollout/observation_length_mean", "rollout/prompt_length_mean", "rollout/num", "perf/update_policy_tokens"]
    mean = {k: sum(r.get(k, 0.0) or 0.0 for r in measured) / len(measured) for k in keys}
    mean["wall_seconds"] = wall
    mean["trainable_layers"] = cfg.model.trainable_layers
    return mean


def trl_comparison(steps: int, prompts: int, group_size: int, max_tokens: int, lr: float = 1e-6) -> dict:
    """Single-turn GRPO, same model / prompts / group size / max new tokens / one update per batch,
    in TRL's GRPOTrainer and in stratarl's loop (max_turns 0: one turn, all weights trainable, no KL).
    Step time = mean wall time of steps 2..N (the first warms up)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from stratarl.rewards import em_reward
    from stratarl.rollout.prompt import build_prompt
    from stratarl.trainer.config import load_config
    from stratarl.trainer.setup import load_policy, load_task

    cfg = load_config(str(REPO / "configs" / "demo.yaml"))
    task = load_task(cfg)
    examples = task.train[:prompts * steps]
    answers = {build_prompt(e.question): e.golden_answers for e in examples}
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": build_prompt(e.question)}]} for e in examples])

    def reward(prompts, completions, **kwargs):
        out = []
        for prompt, completion in zip(prompts, completions):
            text = completion[0]["content"] if isinstance(completion, list) else completion
            out.append(em_reward(text, answers[prompt[-1]["content"]]))
        return out

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self._t = [], 0.0

        def on_step_begin(self, args, state, control, **kw):
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self._t)

    def ours() -> dict:
        return loop_bench(str(REPO / "configs" / "demo.yaml"), steps,
                          ["algo.name=grpo", "rollout.max_turns=0", f"rollout.max_tokens_per_turn={max_tokens}",
                           f"rollout.group_size={group_size}", f"trainer.prompts_per_step={prompts}", "trainer.epochs=1",
                           "trainer.mini_batches=1", "algo.kl_coef=0", "model.trainable_layers=0", f"optim.lr={lr}",
                           # One update per batch: pi_old is the sampler's own log-probs, as TRL's
                           # num_iterations=1 uses the detached current log-probs: no extra forward pass.
                           "optim.warmup_steps=0", "algo.old_logprobs=rollout"])

    # Ours before and after TRL: on a shared machine the load drifts; the mean of the two
    # brackets TRL's run in time.
    ours_before = ours()
    model, tokenizer = load_policy(cfg.model.__class__(name=cfg.model.name))
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(output_dir=tmp, per_device_train_batch_size=prompts * group_size, num_generations=group_size,
                          max_completion_length=max_tokens, beta=0.0, num_iterations=1, learning_rate=lr,
                          temperature=1.0, use_cpu=True, bf16=False, report_to="none", logging_steps=1,
                          save_strategy="no", max_steps=steps, loss_type="dapo", scale_rewards="group",
                          gradient_accumulation_steps=1, seed=0, dataloader_num_workers=0)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[timer])
        trainer.train()
        lengths = [h.get("completions/mean_length") for h in trainer.state.log_history if "completions/mean_length" in h]
    trl_step = sum(timer.times[1:]) / max(1, len(timer.times) - 1)
    ours_after = ours()
    step = (ours_before["time/step"] + ours_after["time/step"]) / 2
    return {"trl_step_s": trl_step, "trl_steps": timer.times, "trl_completion_len": lengths,
            "stratarl_step_s": step, "stratarl_steps_before_after": [ours_before["time/step"], ours_after["time/step"]],
            "stratarl_phases": {k: (ours_before[k] + ours_after[k]) / 2 for k in
                                ("time/generation", "time/logprobs", "time/update")},
            "stratarl_completion_len": (ours_before["rollout/response_length_mean"]
                                        + ours_after["rollout/response_length_mean"]) / 2,
            "ratio": step / trl_step}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--skip-micro", action="store_true", help="skip the update micro-benchmark")
    parser.add_argument("--json", help="also write the numbers here")
    parser.add_argument("--trl", action="store_true", help="also compare with TRL's GRPOTrainer (pip install trl)")
    parser.add_argument("--trl-only", action="store_true", help="only the TRL comparison")
    parser.add_argument("overrides", nargs="*", help="config overrides for the loop")
    args = parser.parse_args()
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    from stratarl.trainer.config import load_config

    cfg = load_config(args.config, args.overrides)
    print(f"threads: {torch.get_num_threads()}   config: {args.config}   load average: {os.getloadavg()[0]:.1f}")
    peak = matmul_flops()
    print(f"[baseline] fp32 matmul: {peak / 1e9:.1f} GFLOP/s")
    results: dict = {"matmul_flops": peak}
    if args.trl or args.trl_only:
        cmp = trl_comparison(steps=max(2, args.steps), prompts=2, group_size=4, max_tokens=32)
        results["trl"] = cmp
        print(f"[vs TRL] single-turn GRPO, 2 prompts x 4, <= 32 new tokens, 1 update/batch: TRL GRPOTrainer "
              f"{cmp['trl_step_s']:.1f} s/step (completions {cmp['trl_completion_len']}), stratarl "
              f"{cmp['stratarl_step_s']:.1f} s/step (before / after TRL: "
              f"{', '.join(f'{t:.1f}' for t in cmp['stratarl_steps_before_after'])}; phases "
              f"{', '.join(f'{k[5:]} {v:.1f}' for k, v in cmp['stratarl_phases'].items())}; "
              f"completions {cmp['stratarl_completion_len']:.1f} tokens): "
              f"ratio {cmp['ratio']:.2f} (target <= 0.67)")
        if args.trl_only:
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
            return 0
    if not args.skip_micro:
        micro = update_microbench(cfg, rows=4, prompt_len=192, response_len=160, repeats=1)
        micro["mfu"] = micro["flops_per_s"] / peak
        results["update_micro"] = micro
        print(f"[update micro] {micro['params'] / 1e6:.0f}M params, {micro['tokens']} tokens fwd+bwd in "
              f"{micro['seconds']:.2f}s: {micro['tokens_per_s']:.0f} tok/s, MFU {100 * micro['mfu']:.1f}% of matmul")
    loop = loop_bench(args.config, args.steps, args.overrides)
    from stratarl.trainer.setup import load_policy

    model, _ = load_policy(cfg.model)
    params = sum(p.numel() for p in model.parameters())
    layers = getattr(model.config, "num_hidden_layers", 1)
    trainable = loop["trainable_layers"] or layers
    # Work actually done: forward 2N everywhere, backward 4N only above the lowest trained layer.
    work_factor = 2 + 4 * trainable / layers
    loop["update_mfu_nominal"] = loop["perf/update_tokens_per_s"] * 6 * params / peak
    loop["update_mfu_work"] = loop["perf/update_tokens_per_s"] * work_factor * params / peak
    results["loop"] = loop
    results["peak_rss_gb"] = peak_rss_gb()
    print(f"[loop] {args.steps} steps of {Path(args.config).name}, means over steps 2..{args.steps}:")
    for k in ("time/generation", "time/retrieval", "time/logprobs", "time/update", "time/step"):
        print(f"    {k:<28}{loop[k]:8.2f} s")
    print(f"    rollouts/step {loop['rollout/num']:.0f}, prompt {loop['rollout/prompt_length_mean']:.0f} + policy "
          f"{loop['rollout/response_length_mean']:.0f} + observation {loop['rollout/observation_length_mean']:.0f} tokens")
    print(f"    update: {loop['perf/update_tokens_per_s']:.0f} tok/s = MFU {100 * loop['update_mfu_nominal']:.1f}% "
          f"nominal (6 x params), {100 * loop['update_mfu_work']:.1f}% of the work done "
          f"({work_factor:.1f} x params; last {trainable}/{layers} layers train)")
    print(f"    generation: {loop['perf/generation_tokens_per_s']:.0f} policy tok/s")
    print(f"[memory] peak RSS {results['peak_rss_gb']:.2f} GB (target <= 8)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
