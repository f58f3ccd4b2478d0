"""Training-speed benchmark: phase times, executed FLOPs, the fast update vs the reference, peak memory.

    python benchmarks/bench_train.py --threads 2 --steps 2          # SmolLM2 demo config (configs/smollm2.yaml)
    python benchmarks/bench_train.py --steps 2 --config configs/tiny.yaml
    python benchmarks/bench_train.py --trl-only                     # needs `pip install trl`

Prints, all measured in this run on this machine:

1. fp32 matmul FLOP/s (the peak every utilisation below is against): the best of the model's MLP
   matmul shape and large square products.
2. Update micro-benchmark: forward + backward of the policy through ``response_logprobs``, all
   weights trainable, 4 rows sharing one prompt. Nominal 6 N D (every row's prompt counted) and the
   FLOPs executed (``stratarl.infra.flops``: the prompt once, attention, the LM head on policy
   tokens) are printed separately; only the executed count is divided by time.
3. The RL loop for a few steps (no warm start): seconds per phase, and the update's nominal and
   executed FLOPs.
4. The update on the loop's last rollout batch, ``update_policy(impl="reference")`` against
   ``impl="fast"`` (frozen layers once per batch), interleaved: times, speedup, executed FLOPs and the
   largest gradient difference.
5. Optional (``--trl`` / ``--trl-only``, needs trl): TRL's GRPOTrainer on an identical single-turn GRPO
   workload with a partial-credit reward; mean reward and gradient norm of both arms, and no ratio
   when either arm's rewards are all 0 or its gradient norm is 0.

A utilisation above 100 % of the measured peak is printed as an accounting error, never as a result.
Targets (from the issues): fast update >= 2x the reference, peak RSS <= 8 GB, step time <= 0.67 x TRL's.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

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
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # Linux: KiB


def utilisation(flops_per_s: float, peak: float) -> str:
    """``flops_per_s`` as a share of the measured peak; above 100 % is impossible, so it is reported as
    an accounting error (work counted that did not run), never as a result."""
    share = flops_per_s / peak
    if share > 1.0:
        return f"ACCOUNTING ERROR: {100 * share:.0f}% of the measured peak (counts work that did not run)"
    return f"{100 * share:.1f}% of matmul peak"


def update_microbench(cfg, rows: int, prompt_len: int, response_len: int, repeats: int) -> dict:
    """Forward + backward (all weights trainable) through the trainer's log-prob path; the rows share
    one prompt, as a GRPO group does, so the prompt runs once (``response_logprobs``)."""
    from stratarl.infra.flops import matmul_params, nominal_flops, record_decoder_calls
    from stratarl.trainer.batch import collate_sequences
    from stratarl.trainer.logprobs import response_logprobs
    from stratarl.trainer.setup import load_policy

    model_cfg = type(cfg.model)(**{**cfg.model.__dict__, "trainable_layers": 0})
    model, tok = load_policy(model_cfg)
    params = matmul_params(model)
    g = torch.Generator().manual_seed(0)
    batch = collate_sequences(
        [torch.randint(100, 40000, (prompt_len,), generator=g).tolist()] * rows,
        [torch.randint(100, 40000, (response_len,), generator=g).tolist()] * rows,
        [[1] * response_len] * rows,
        tok.pad_token_id,
    )
    tokens = int(batch.attention_mask.sum())
    times, executed = [], 0.0
    model.train()
    for i in range(repeats + 1):
        t = time.perf_counter()
        with record_decoder_calls(model) as record:
            out = response_logprobs(
                model,
                batch.input_ids,
                batch.attention_mask,
                batch.prompt_lengths,
                batch.response_mask,
                chunk_tokens=cfg.trainer.logprob_chunk_tokens,
            )
            (-(out["logprobs"]).sum() / batch.num_policy_tokens).backward()
        model.zero_grad(set_to_none=True)
        if i:  # the first pass warms up allocator and kernels
            times.append(time.perf_counter() - t)
        executed = record.total()
    best = min(times)
    return {
        "params": params,
        "tokens": tokens,
        "seconds": best,
        "tokens_per_s": tokens / best,
        "nominal_flops": nominal_flops(params, tokens),
        "executed_flops": executed,
        "executed_flops_per_s": executed / best,
    }


def loop_bench(config: str, steps: int, overrides: list[str], keep_batch: bool = False, per_step: bool = False) -> dict:
    """A few RL steps of ``config`` (no warm start, no eval); per-phase means over steps 2..N.

    The update phase runs under ``record_decoder_calls``: ``update_executed_flops`` is the work it did
    (mean per step over steps 2..N). With ``keep_batch`` the last step's rollout batch (advantages
    filled, before the update) is returned as ``batch``, with the config as ``cfg``. With ``per_step``,
    ``per_step`` holds every step's ``reward/mean`` and ``optim/grad_norm``."""
    from stratarl.infra.flops import record_decoder_calls
    from stratarl.infra.metrics import read_metrics
    from stratarl.infra.threads import set_threads
    from stratarl.trainer.config import load_config
    from stratarl.trainer.rl import train
    from stratarl.trainer.run import RunParts
    from stratarl.trainer.update import update_policy

    executed: list[float] = []
    kept: dict = {}

    def counted_update(learner, batch, settings, generator, **kwargs):
        if keep_batch:
            kept["batch"] = copy.deepcopy(batch)
        with record_decoder_calls(learner.model) as record:
            out = update_policy(learner, batch, settings, generator, **kwargs)
        executed.append(record.total())
        return out

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            config,
            [
                "sft.enabled=false",
                "eval.before_after=false",
                f"trainer.steps={steps}",
                f"trainer.num_threads={torch.get_num_threads()}",  # the same threads as the baseline
                "logging.progress=false",
                "logging.tensorboard=false",
                "logging.num_transcripts=0",
                f"trainer.output_dir={tmp}",
                *overrides,
            ],
        )
        set_threads(cfg.trainer.num_threads)
        started = time.perf_counter()
        train(cfg, Path(tmp) / "bench", parts=RunParts(update=counted_update))
        wall = time.perf_counter() - started
        rows = read_metrics(Path(tmp) / "bench")
    measured = rows[1:] if len(rows) > 1 else rows
    keys = [
        "time/generation",
        "time/retrieval",
        "time/logprobs",
        "time/update",
        "time/step",
        "perf/update_tokens_per_s",
        "perf/generation_tokens_per_s",
        "rollout/response_length_mean",
        "rollout/observation_length_mean",
        "rollout/prompt_length_mean",
        "rollout/num",
        "perf/update_policy_tokens",
        "rollout/reward_mean",
        "optim/grad_norm",
    ]
    mean = {k: sum(r.get(k, 0.0) or 0.0 for r in measured) / len(measured) for k in keys}
    steps_executed = executed[1:] if len(executed) > 1 else executed
    mean["update_executed_flops"] = sum(steps_executed) / max(1, len(steps_executed))
    mean["wall_seconds"] = wall
    if per_step:
        mean["per_step"] = {
            k: [float(r.get(k, 0.0) or 0.0) for r in rows if "time/step" in r]
            for k in ("reward/mean", "optim/grad_norm")
        }
    mean["trainable_layers"] = cfg.model.trainable_layers
    if keep_batch:
        mean["batch"], mean["cfg"] = kept.get("batch"), cfg
    return mean


def update_comparison(cfg, batch, repeats: int = 2) -> dict:
    """The reference and the fast update (``update_policy(impl=...)``) on the same rollout batch from the
    same policy, interleaved ``repeats`` times (best time of each), plus the largest gradient difference
    of one accumulation over the whole batch (the first optimizer step's gradient). When the batch's
    advantages are all 0 (every reward equal) they are replaced by seeded N(0, 1) per row, so the
    gradients compared are not 0 (the work timed is the same either way)."""
    from stratarl.infra.flops import record_decoder_calls
    from stratarl.trainer.forward import REFERENCE, PrefixForward
    from stratarl.trainer.learner import build_learner
    from stratarl.trainer.prefix import frozen_prefix, unsupported_reason
    from stratarl.trainer.settings import UpdateSettings
    from stratarl.trainer.setup import load_policy
    from stratarl.trainer.update import accumulate_gradients, update_policy

    model, _ = load_policy(cfg.model)
    settings = UpdateSettings.from_config(cfg)
    total_steps = cfg.trainer.epochs * cfg.trainer.mini_batches
    replaced = not bool(batch.advantages.abs().sum())
    if replaced:  # all rewards equal: zero advantages, zero policy gradient, and nothing to compare
        g = torch.Generator().manual_seed(0)
        advantages = torch.randn(batch.size, 1, generator=g) * batch.response_mask
        batch = dataclasses.replace(batch, advantages=advantages, returns=advantages.clone())
    times: dict[str, list[float]] = {"reference": [], "fast": []}
    flops: dict[str, float] = {}
    for _ in range(repeats):
        for impl in ("reference", "fast"):
            learner = build_learner(copy.deepcopy(model), cfg, total_steps)
            b = copy.deepcopy(batch)
            with record_decoder_calls(learner.model) as record:
                t = time.perf_counter()
                update_policy(learner, b, settings, torch.Generator().manual_seed(0), impl=impl)
                times[impl].append(time.perf_counter() - t)
            flops[impl] = record.total()
    grads = {}
    for impl in ("reference", "fast"):
        learner = build_learner(copy.deepcopy(model), cfg, total_steps)
        learner.model.train()
        forward = REFERENCE
        if impl == "fast":
            prefix = frozen_prefix(learner.model, batch.input_ids, batch.attention_mask, batch.prompt_lengths)
            forward = PrefixForward(prefix)
        accumulate_gradients(learner, copy.deepcopy(batch), settings, forward)
        grads[impl] = [p.grad.clone() for p in learner.policy_parameters() if p.grad is not None]
    diff = max(float((a - b).abs().max()) for a, b in zip(grads["reference"], grads["fast"]))
    scale = max(float(a.abs().max()) for a in grads["reference"])
    return {
        "reference_s": min(times["reference"]),
        "fast_s": min(times["fast"]),
        "times": times,
        "speedup": min(times["reference"]) / min(times["fast"]),
        "executed_flops": flops,
        "max_grad_diff": diff,
        "max_grad": scale,
        "fast_path": unsupported_reason(model) or "used",
        "advantages_replaced": replaced,
    }


SEARCH_CREDIT = 0.1
# New tokens per completion in the TRL comparison: room for the warm start's search turn and what it writes
# after it in one turn (a second search, or an answer with no information to go on), so rewards differ
# within a group. At 32 the turn ends inside the first search and every completion scores the same.
MAX_NEW_TOKENS = 56


def format_f1_reward(response_text: str, golden_answers) -> float:
    """Partial credit for the TRL comparison: token F1 of the <answer> with Search-R1's format term (0.2 for
    a well-formed answer that is wrong), and ``SEARCH_CREDIT`` for a response with no answer that completes a
    ``<search>...</search>`` call (in one turn a searching policy gets no answer): searching scores above
    answering with nothing retrieved, which is wrong or malformed (0). A policy gets non-zero, varied rewards
    from format alone, so both arms' gradients do real work (all-equal rewards make GRPO's advantages, and its
    gradient, zero)."""
    import re

    from stratarl.rewards import f1_reward
    from stratarl.rewards.formats import make_format_reward

    score = make_format_reward(f1_reward, 0.2)(response_text, golden_answers)
    if score == 0.0 and "<answer>" not in response_text and re.search(r"<search>.+?</search>", response_text, re.S):
        return SEARCH_CREDIT
    return score


def real_work_error(name: str, rewards: list[float], grad_norms: list[float]) -> str | None:
    """Why ``name``'s arm did no real work (None if it did): every reward 0 (no advantage, no gradient),
    or every gradient norm 0 (or none logged)."""
    if not rewards or all(r == 0 for r in rewards):
        return (
            f"{name}: every reward was 0 (rewards {rewards}): the policy gradient is 0, the step times compare nothing"
        )
    if not grad_norms or all(g == 0 for g in grad_norms):
        return f"{name}: gradient norm 0 in every step ({grad_norms}): the optimizer did no work"
    return None


def trl_comparison(
    steps: int, prompts: int, group_size: int, max_tokens: int, lr: float = 1e-6, overrides: list[str] | None = None
) -> dict:
    """Single-turn GRPO, same model / prompts / group size / max new tokens / one update per batch / reward
    (``format_f1_reward``), in TRL's GRPOTrainer and in stratarl's loop (max_turns 0: one turn, all weights
    trainable, no KL). Step time = mean wall time of steps 2..N (the first warms up). Also returns each arm's
    per-step mean rewards and gradient norms; ``error`` is set (and no ratio) when either arm did no work."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from stratarl.rollout.parsing import ANSWER_STOP
    from stratarl.rollout.prompt import build_prompt
    from stratarl.trainer.config import load_config
    from stratarl.trainer.setup import load_policy, load_task
    from stratarl.trainer.warmstart.stages import warm_start_cache_dir

    overrides = list(overrides or [])  # e.g. data.synthetic.seed=7: the task (and so the warm start) of that world
    cfg = load_config(str(REPO / "configs" / "smollm2.yaml"), [*overrides, "trainer.precision=fp32"])
    task = load_task(cfg)
    # Both arms start from the lab's cached warm start when there is one (the one `stratarl demo --config
    # configs/smollm2.yaml` builds, at the config's own precision; its weights are saved in fp32), else from the
    # base model. It writes the protocol's tags, so format credit varies within a group.
    folder = warm_start_cache_dir(load_config(str(REPO / "configs" / "smollm2.yaml"), overrides)) / "model"
    init = str(folder) if (folder / "config.json").is_file() else None
    examples = task.train[: prompts * steps]
    answers = {build_prompt(e.question): e.golden_answers for e in examples}
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": build_prompt(e.question)}]} for e in examples])

    def reward(prompts, completions, **kwargs):
        out = []
        for prompt, completion in zip(prompts, completions):
            text = completion[0]["content"] if isinstance(completion, list) else completion
            out.append(format_f1_reward(text, answers[prompt[-1]["content"]]))
        return out

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self._t = [], 0.0

        def on_step_begin(self, args, state, control, **kw):
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self._t)

    def ours() -> dict:
        # TRL's generate stops only at EOS; stratarl's turns also stop at `</search>` (the engine's tool call).
        # In one turn with no tool that stop would end every warm-start completion at its first search, all
        # with the same reward (no gradient) and half TRL's tokens. So this arm stops where TRL's does:
        # at EOS, or after `</answer>` (where the warm start writes EOS anyway).
        with mock.patch("stratarl.rollout.config.STOP_STRINGS", (ANSWER_STOP,)):
            return _ours()

    def _ours() -> dict:
        return loop_bench(
            str(REPO / "configs" / "smollm2.yaml"),
            steps,
            [
                *overrides,
                "algo.name=grpo",
                "rollout.max_turns=0",
                f"rollout.max_tokens_per_turn={max_tokens}",
                f"rollout.group_size={group_size}",
                f"trainer.prompts_per_step={prompts}",
                "trainer.epochs=1",
                "trainer.mini_batches=1",
                "algo.kl_coef=0",
                "model.trainable_layers=0",
                f"optim.lr={lr}",
                "rollout.temperature=1.0",
                "algo.reward=bench_train:format_f1_reward",
                # One update per batch: pi_old is the sampler's own log-probs, as TRL's
                # num_iterations=1 uses the detached current log-probs: no extra forward pass.
                "optim.warmup_steps=0",
                "algo.old_logprobs=rollout",
                "trainer.precision=fp32",  # TRL's arm runs fp32 (bf16=False) on a CPU
                *([f"model.init_from={init}"] if init else []),
            ],
            per_step=True,
        )

    # Ours before and after TRL: on a shared machine the load drifts; the mean of the two
    # brackets TRL's run in time.
    ours_before = ours()
    model, tokenizer = load_policy(cfg.model.__class__(name=cfg.model.name, init_from=init))
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(
            output_dir=tmp,
            per_device_train_batch_size=prompts * group_size,
            num_generations=group_size,
            max_completion_length=max_tokens,
            beta=0.0,
            num_iterations=1,
            learning_rate=lr,
            temperature=1.0,
            use_cpu=True,
            bf16=False,
            report_to="none",
            logging_steps=1,
            save_strategy="no",
            max_steps=steps,
            loss_type="dapo",
            scale_rewards="group",
            gradient_accumulation_steps=1,
            seed=0,
            dataloader_num_workers=0,
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[timer],
        )
        trainer.train()
        history = trainer.state.log_history
    lengths = [h["completions/mean_length"] for h in history if "completions/mean_length" in h]
    trl_rewards = [float(h["reward"]) for h in history if "reward" in h]
    trl_grad_norms = [float(h["grad_norm"]) for h in history if "grad_norm" in h]
    trl_step = sum(timer.times[1:]) / max(1, len(timer.times) - 1)
    ours_after = ours()
    step = (ours_before["time/step"] + ours_after["time/step"]) / 2
    our_rewards = ours_before["per_step"]["reward/mean"] + ours_after["per_step"]["reward/mean"]
    our_grad_norms = ours_before["per_step"]["optim/grad_norm"] + ours_after["per_step"]["optim/grad_norm"]
    errors = [
        e
        for e in (
            real_work_error("TRL", trl_rewards, trl_grad_norms),
            real_work_error("stratarl", our_rewards, our_grad_norms),
        )
        if e
    ]
    return {
        "trl_step_s": trl_step,
        "trl_steps": timer.times,
        "trl_completion_len": lengths,
        "trl_rewards": trl_rewards,
        "trl_grad_norms": trl_grad_norms,
        "stratarl_rewards": our_rewards,
        "stratarl_grad_norms": our_grad_norms,
        "stratarl_step_s": step,
        "stratarl_steps_before_after": [ours_before["time/step"], ours_after["time/step"]],
        "stratarl_phases": {
            k: (ours_before[k] + ours_after[k]) / 2 for k in ("time/generation", "time/logprobs", "time/update")
        },
        "stratarl_completion_len": (
            ours_before["rollout/response_length_mean"] + ours_after["rollout/response_length_mean"]
        )
        / 2,
        "policy": init or cfg.model.name,
        "error": "; ".join(errors) or None,
        "ratio": None if errors else step / trl_step,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "smollm2.yaml"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--skip-micro", action="store_true", help="skip the update micro-benchmark")
    parser.add_argument("--skip-compare", action="store_true", help="skip the reference-vs-fast update comparison")
    parser.add_argument("--compare-repeats", type=int, default=2, help="interleaved runs of each update (best kept)")
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
        cmp = trl_comparison(
            steps=max(2, args.steps), prompts=2, group_size=4, max_tokens=MAX_NEW_TOKENS, overrides=args.overrides
        )
        results["trl"] = cmp
        mean = lambda xs: sum(xs) / max(1, len(xs))  # noqa: E731
        print(
            f"[vs TRL] single-turn GRPO on configs/smollm2.yaml's task, 2 prompts x 4, <= {MAX_NEW_TOKENS} new tokens (both stop at EOS or </answer> only), 1 update/batch, "
            f"reward: answer F1 + format credit, 0.1 for a completed search (format_f1_reward); policy {cmp['policy']}"
        )
        print(
            f"    TRL GRPOTrainer {cmp['trl_step_s']:.1f} s/step, mean reward {mean(cmp['trl_rewards']):.3f}, "
            f"mean grad norm {mean(cmp['trl_grad_norms']):.3g} (completions {cmp['trl_completion_len']})"
        )
        print(
            f"    stratarl {cmp['stratarl_step_s']:.1f} s/step (before / after TRL: "
            f"{', '.join(f'{t:.1f}' for t in cmp['stratarl_steps_before_after'])}; phases "
            f"{', '.join(f'{k[5:]} {v:.1f}' for k, v in cmp['stratarl_phases'].items())}; completions "
            f"{cmp['stratarl_completion_len']:.1f} tokens), mean reward {mean(cmp['stratarl_rewards']):.3f}, "
            f"mean grad norm {mean(cmp['stratarl_grad_norms']):.3g}"
        )
        if cmp["error"]:
            print(f"    error: no ratio reported: {cmp['error']}. Fix: a task or reward the policy partly solves")
        else:
            print(f"    step-time ratio stratarl / TRL {cmp['ratio']:.2f} (target <= 0.67)")
        if args.trl_only:
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
            return 0
    if not args.skip_micro:
        micro = update_microbench(cfg, rows=4, prompt_len=192, response_len=160, repeats=1)
        results["update_micro"] = micro
        print(
            f"[update micro] {micro['params'] / 1e6:.0f}M matmul params, {micro['tokens']} tokens (4 rows sharing "
            f"one prompt) fwd+bwd in {micro['seconds']:.2f}s: {micro['tokens_per_s']:.0f} tok/s; nominal 6ND "
            f"{micro['nominal_flops'] / 1e9:.0f} GFLOP, executed {micro['executed_flops'] / 1e9:.0f} GFLOP = "
            f"{micro['executed_flops_per_s'] / 1e9:.1f} GFLOP/s, {utilisation(micro['executed_flops_per_s'], peak)}"
        )
    loop = loop_bench(args.config, args.steps, args.overrides, keep_batch=not args.skip_compare)
    from stratarl.infra.flops import matmul_params, nominal_flops
    from stratarl.trainer.setup import load_policy

    model, _ = load_policy(cfg.model)
    params = matmul_params(model)
    layers = getattr(model.config, "num_hidden_layers", 1)
    trainable = loop["trainable_layers"] or layers
    update_s = loop["time/update"]
    nominal = nominal_flops(params, loop["perf/update_tokens_per_s"] * update_s)  # tokens x epochs of a step
    loop["update_nominal_flops"] = nominal
    batch, loop_cfg = loop.pop("batch", None), loop.pop("cfg", None)
    results["loop"] = loop
    results["peak_rss_gb"] = peak_rss_gb()
    print(f"[loop] {args.steps} steps of {Path(args.config).name}, means over steps 2..{args.steps}:")
    for k in ("time/generation", "time/retrieval", "time/logprobs", "time/update", "time/step"):
        print(f"    {k:<28}{loop[k]:8.2f} s")
    print(
        f"    rollouts/step {loop['rollout/num']:.0f}, prompt {loop['rollout/prompt_length_mean']:.0f} + policy "
        f"{loop['rollout/response_length_mean']:.0f} + observation {loop['rollout/observation_length_mean']:.0f} tokens"
    )
    executed = loop["update_executed_flops"]
    print(
        f"    update: {loop['perf/update_tokens_per_s']:.0f} tok/s (every row's prompt counted); nominal 6ND "
        f"{nominal / 1e9:.0f} GFLOP (shown, not the work done), executed {executed / 1e9:.0f} GFLOP (prompts once, "
        f"last {trainable}/{layers} layers train) = {executed / max(update_s, 1e-9) / 1e9:.1f} GFLOP/s, "
        f"{utilisation(executed / max(update_s, 1e-9), peak)}"
    )
    print(f"    generation: {loop['perf/generation_tokens_per_s']:.0f} policy tok/s")
    if batch is not None:
        cmp = update_comparison(loop_cfg, batch, repeats=args.compare_repeats)
        results["update_compare"] = cmp
        peak_share = {k: utilisation(v / cmp[f"{k}_s"], peak) for k, v in cmp["executed_flops"].items()}
        print(
            f"[update: reference vs fast] the last loop step's {batch.size} rollouts, same policy, "
            f"{loop_cfg.trainer.epochs} epoch(s) x {loop_cfg.trainer.mini_batches} mini-batch(es): reference "
            f"{cmp['reference_s']:.2f} s ({cmp['executed_flops']['reference'] / 1e9:.0f} GFLOP, {peak_share['reference']}), "
            f"fast {cmp['fast_s']:.2f} s ({cmp['executed_flops']['fast'] / 1e9:.0f} GFLOP, {peak_share['fast']}; "
            f"frozen prefix: {cmp['fast_path']}): speedup {cmp['speedup']:.2f}x (target >= 2); max |grad diff| "
            f"{cmp['max_grad_diff']:.2e} (largest |grad| {cmp['max_grad']:.2e})"
            + (
                "; the loop's advantages were all 0, replaced by seeded N(0, 1) per row"
                if cmp["advantages_replaced"]
                else ""
            )
        )
        if cmp["max_grad"] == 0:
            print("    error: every gradient is 0: the comparison checked nothing")
    print(f"[memory] peak RSS {results['peak_rss_gb']:.2f} GB (target <= 8)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
