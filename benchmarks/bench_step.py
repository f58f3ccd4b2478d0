"""The RL step, today's fp32 step against the bf16 step, side by side in one run, per phase.

    python benchmarks/bench_step.py                       # SmolLM2 lab (configs/smollm2.yaml), its warm start
    python benchmarks/bench_step.py --steps 5 --json out.json
    python benchmarks/bench_step.py --config configs/smollm2.yaml trainer.prompts_per_step=2

Two runs of the same config, built by the trainer's own ``build_run`` from the same weights (the cached
warm start when it exists, else the base model; ``--no-warm-start`` forces the base model), with the same
seed, so each step samples the same questions and the same sampling stream (both arms start from the
fp32 warm start when it is cached, else from the bf16 one):

- ``fp32`` (the baseline, the SmolLM2 lab as it ran before bf16): fp32 fast decoder, sampling log-probs
  as old log-probs (``algo.old_logprobs=rollout``), the frozen prefix computed by a pass over the frozen
  layers (``trainer.prefix_from_rollouts=false``), fp32 update;
- ``bf16``: the fast decoder on bf16 weight copies, keeping the hidden states entering the lowest trainable
  layer as it samples (``trainer.prefix_from_rollouts``: the frozen prefix, no second pass; the share of
  steps that used it is printed), old log-probs recomputed through that prefix
  (``algo.old_logprobs=recompute``), the update under bf16 autocast.

The two runs' steps are interleaved (fp32 step 1, bf16 step 1, fp32 step 2, ...), so machine noise hits
both; step 1 of each is a warm-up and is not counted. Printed per phase (generation, retrieval, frozen
prefix, scoring, update) as medians, with rollouts per second and the step-time ratio.

Then numerics on the real model, on one rollout batch of the fp32 run (the same tokens for every number):
the largest |log-prob| difference of bf16 scoring from fp32 scoring, the fp32 and bf16 decoders' sampling
log-probs against their own trainer's, and the first bf16 optimizer step's largest |log ratio| (on-policy:
below 1e-3 is the target).

``--policy-lag K`` compares instead a fresh step with a stale-weights one: the config as given with
``trainer.policy_lag=0`` (the baseline) and with ``trainer.policy_lag=K``, interleaved the same way, same seed
and threads (the lag is min(K, step), so a short run's lag is the step index: the mechanism's cost, the
sampler copy and its snapshots, is what it measures), plus a third arm at lag K whose step measures the
sampler/learner mismatch by a separate scoring pass, as the step did before it read the update's own forward
(``lagK+pass``). The numerics checks are skipped.

The CPU's bf16 matmul units (``cpu_bf16_matmul``) and a bf16 / fp32 GEMM rate ratio at the model's MLP
shape are printed first: bf16 pays only where that ratio is well above 1.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
PHASES = ("generation", "retrieval", "frozen_prefix", "logprobs", "update", "step")
ARMS = {
    "fp32": ["trainer.precision=fp32", "algo.old_logprobs=rollout", "trainer.prefix_from_rollouts=false"],
    "bf16": ["trainer.precision=bf16", "algo.old_logprobs=recompute", "trainer.prefix_from_rollouts=true"],
}


def gemm_ratio(seconds: float = 1.0) -> dict:
    """bf16 and fp32 GEMM rates at SmolLM2's MLP shape ([512 x 576] @ [576 x 1536]), best of a loop each."""
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(512, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
        a @ b
        best, end = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            t = time.perf_counter()
            a @ b
            best = max(best, 2 * 512 * 576 * 1536 / (time.perf_counter() - t))
        out[name] = best
    return {"fp32_gflops": out["fp32"] / 1e9, "bf16_gflops": out["bf16"] / 1e9, "ratio": out["bf16"] / out["fp32"]}


def lag_arms(lag: int, with_pass: bool = True) -> dict[str, list[str]]:
    """The ``--policy-lag`` comparison: the config as given, fresh (the baseline), with ``lag`` stale steps, and
    (``with_pass``) with ``lag`` stale steps measuring the sampler/learner mismatch by a scoring pass (``pass``: the
    step before the update measured it on its own forward)."""
    stale = [f"trainer.policy_lag={lag}"]
    arms = {"lag0": ["trainer.policy_lag=0"], f"lag{lag}": stale}
    return {**arms, f"lag{lag}+pass": stale} if with_pass else arms


def with_scoring_pass(run) -> None:
    """Make ``run``'s step measure the mismatch by a separate scoring pass: an update without the
    ``learner_logprobs`` keyword (stratarl.trainer.step._mismatch_in_update)."""
    from stratarl.trainer.update import update_policy

    def update(learner, batch, settings, generator, *, forward=None):
        return update_policy(learner, batch, settings, generator, forward=forward)

    run.parts = dataclasses.replace(run.parts, update=update)


def build_arms(
    config: str, overrides: list[str], tmp: Path, warm_start: bool, arms: dict[str, list[str]] | None = None
) -> tuple[dict, str | None]:
    from stratarl.trainer.config import load_config
    from stratarl.trainer.run import build_run
    from stratarl.trainer.warmstart.stages import warm_start_cache_dir

    base = [
        "eval.before_after=false",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.num_transcripts=0",
        f"trainer.output_dir={tmp}",
        f"trainer.num_threads={torch.get_num_threads()}",
    ]
    arms = ARMS if arms is None else arms
    init = None
    for settings in arms.values():  # the fp32 warm start first (the baseline's), else the bf16 one
        probe = load_config(config, base + overrides + settings)
        folder = warm_start_cache_dir(probe) / "model"
        if warm_start and probe.sft.enabled and init is None and (folder / "config.json").is_file():
            init = str(folder)
    runs = {}
    for arm, settings in arms.items():
        cfg = load_config(config, base + overrides + settings)
        runs[arm] = build_run(cfg, tmp / arm, init_from=init)
    # A model.init_from given on the command line is the policy when no cached warm start was found.
    return runs, init or cfg.model.init_from


def spy_first_log_ratio(record: list, learner):
    """Wrap ``learner.policy_loss`` to record the largest |log ratio| over policy tokens of each call before
    ``learner.optimizer``'s first step (the on-policy micro-batches); returns the function that undoes it."""
    real = learner.policy_loss
    stepped = []
    handle = learner.optimizer.register_step_post_hook(lambda *_: stepped.append(1))

    def loss(logprobs, old_logprobs, advantages, mask, **kwargs):
        if not stepped:
            record.append(float(((logprobs - old_logprobs).detach().abs() * mask).max()))
        return real(logprobs, old_logprobs, advantages, mask, **kwargs)

    learner.policy_loss = loss

    def undo():
        learner.policy_loss = real
        handle.remove()

    return undo


def timed_steps(runs: dict, steps: int, keep: bool = True) -> tuple[dict, dict, list]:
    """Interleaved RL steps of every arm; (per-arm list of per-step metrics, each arm's last batch with its
    weights and prefix, the bf16 arm's first-step log ratios). ``keep`` False: no batch is kept (the copies
    would count in the update's time)."""
    from stratarl.trainer.step import rl_step

    rows: dict[str, list[dict]] = {arm: [] for arm in runs}
    kept: dict = {}
    first_ratios: list[float] = []

    def keeping(arm, original):
        def update(learner, batch, settings, generator, **kwargs):
            # The batch, the weights that sampled it (before this update changes them), and its forward.
            kept[arm] = {
                "batch": copy.deepcopy(batch),
                "weights": copy.deepcopy(learner.model.state_dict()),
                "forward": kwargs.get("forward"),
            }
            return original(learner, batch, settings, generator, **kwargs)

        return update

    for arm, run in runs.items() if keep else ():  # the run's update, wrapped to keep each step's batch
        run.parts = dataclasses.replace(run.parts, update=keeping(arm, run.parts.update))
    for step in range(steps):
        for arm, run in runs.items():
            restore = None
            if arm == "bf16" and step == 0:
                restore = spy_first_log_ratio(first_ratios, run.learner)
            try:
                metrics = rl_step(run)
            finally:
                if restore:
                    restore()
            run.step += 1
            rows[arm].append(metrics)
            print(
                f"  step {step + 1} {arm}: "
                + " ".join(f"{p} {metrics.get(f'time/{p}', 0.0):.1f}s" for p in PHASES)
                + f", reward {metrics.get('reward/mean', 0.0):.2f}, searches {metrics.get('rollout/search_calls_mean', 0.0):.2f}"
                + f", prefix {'from the rollouts' if metrics.get('perf/prefix_from_rollouts') else 'computed'}",
                flush=True,
            )
    return rows, kept, first_ratios


def numerics(runs: dict, kept: dict) -> dict:
    """Log-prob differences on one rollout batch (the fp32 run's last), all with the weights that sampled it."""
    from stratarl.trainer.forward import REFERENCE, batch_forward
    from stratarl.trainer.settings import UpdateSettings
    from stratarl.trainer.update import score_batch

    batch = kept["fp32"]["batch"]
    learner32 = runs["fp32"].learner
    model = copy.deepcopy(learner32.model)  # one set of weights for both precisions
    model.load_state_dict(kept["fp32"]["weights"])
    # Scoring with the trainer's fp32 forward: the fp32 arm's config, its old log-probs recomputed.
    cfg32 = runs["fp32"].cfg
    cfg32 = dataclasses.replace(cfg32, algo=dataclasses.replace(cfg32.algo, old_logprobs="recompute")).validate()
    cfg16 = runs["bf16"].cfg
    if UpdateSettings.from_config(cfg16).on_policy_shortcut:  # the bf16 step skips the scoring pass; run it here
        cfg16 = dataclasses.replace(cfg16, trainer=dataclasses.replace(cfg16.trainer, mini_batches=2)).validate()
    s32, s16 = UpdateSettings.from_config(cfg32), UpdateSettings.from_config(cfg16)
    sampled = batch.old_logprobs.clone()  # the fp32 decoder's sampling log-probs
    mask = batch.response_mask.bool()
    learner = copy.copy(learner32)
    learner.model = model
    tokens = batch.tokens()  # scored anew, without the sampler's log-probs
    fp32 = score_batch(learner, tokens, s32)
    bf16 = score_batch(learner, tokens, s16, forward=batch_forward(learner.model, tokens, s16.policy))
    out = {
        "bf16_vs_fp32_scoring_max": float((bf16.old_logprobs - fp32.old_logprobs)[mask].abs().max()),
        "bf16_vs_fp32_scoring_mean": float((bf16.old_logprobs - fp32.old_logprobs)[mask].abs().mean()),
        "fp32_sampling_vs_fp32_scoring_max": float((sampled - fp32.old_logprobs)[mask].abs().max()),
        "policy_tokens": int(mask.sum()),
    }
    # The bf16 decoder's sampling log-probs of its own tokens against bf16 scoring (what `rollout` would use).
    from stratarl.rollout.generation import KVCacheGenerator, SamplingParams

    tokenizer = runs["bf16"].tokenizer
    prompts, responses = [], []
    for row in range(min(batch.size, 8)):
        p = int(batch.prompt_lengths[row])
        n = int(batch.response_lengths[row])
        prompts.append(batch.input_ids[row, :p].tolist())
        responses.append(batch.input_ids[row, p : p + n].tolist())
    generator = KVCacheGenerator(model, tokenizer, seed=0, dtype=torch.bfloat16)
    outputs = generator.generate(prompts, SamplingParams(max_new_tokens=24, temperature=cfg16.rollout.temperature))
    from stratarl.trainer.batch import collate_sequences

    own = collate_sequences(
        prompts,
        [o.token_ids for o in outputs],
        [[1] * len(o.token_ids) for o in outputs],
        pad_id=tokenizer.pad_token_id,
    )
    own = score_batch(learner, own, s16, forward=batch_forward(learner.model, own, s16.policy))
    errors = [abs(float(own.old_logprobs[r, t]) - lp) for r, o in enumerate(outputs) for t, lp in enumerate(o.logprobs)]
    out["bf16_sampling_vs_bf16_scoring_max"] = max(errors) if errors else 0.0
    # The bf16 arm's own last batch, with the prefix its decoder captured while sampling it: scored through
    # that prefix (as its step did), through a computed bf16 prefix, and in fp32 with no prefix (the reference).
    own16 = kept["bf16"]
    prefix16 = own16["forward"].prefix if own16["forward"] is not None else None
    if prefix16 is not None and prefix16.source == "rollouts":
        model.load_state_dict(own16["weights"])
        tokens16 = own16["batch"].tokens()
        scored = {}
        for name, settings, forward in (
            ("fp32", s32, REFERENCE),
            ("computed", s16, batch_forward(learner.model, tokens16, s16.policy)),
            ("captured", s16, own16["forward"]),
        ):
            scored[name] = score_batch(learner, tokens16, settings, forward=forward).old_logprobs
        m = own16["batch"].response_mask.bool()
        for name in ("computed", "captured"):
            diff = (scored[name] - scored["fp32"])[m].abs()
            out[f"bf16_{name}_prefix_vs_fp32_scoring_max"] = float(diff.max())
            out[f"bf16_{name}_prefix_vs_fp32_scoring_mean"] = float(diff.mean())
    return out


def median(rows: list[dict], key: str) -> float:
    values = [float(r.get(key, 0.0) or 0.0) for r in rows]
    return statistics.median(values) if values else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "smollm2.yaml"))
    parser.add_argument("--steps", type=int, default=4, help="steps per arm (the first is a warm-up)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--no-warm-start", action="store_true", help="start from the base model")
    parser.add_argument("--json", help="also write the numbers here")
    parser.add_argument(
        "--policy-lag", type=int, default=0, help="compare trainer.policy_lag=0 with this lag instead of fp32 / bf16"
    )
    parser.add_argument(
        "--no-pass-arm",
        action="store_true",
        help="with --policy-lag: leave out the third arm (the mismatch by a scoring pass), e.g. to fit in memory",
    )
    parser.add_argument("overrides", nargs="*", help="config overrides for both arms")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    if args.policy_lag:
        return lag_main(args)
    from stratarl.infra.precision import cpu_bf16_matmul
    from stratarl.infra.threads import set_threads

    set_threads(args.threads)
    units = cpu_bf16_matmul()
    gemm = gemm_ratio()
    print(
        f"CPU bf16 matmul units: {units or 'none (bf16 is emulated)'}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; GEMM at SmolLM2's MLP shape: fp32 {gemm['fp32_gflops']:.0f} GFLOP/s, "
        f"bf16 {gemm['bf16_gflops']:.0f} GFLOP/s ({gemm['ratio']:.2f}x)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        runs, init = build_arms(args.config, args.overrides, Path(tmp), not args.no_warm_start)
        print(f"policy: {init or 'the base model (no cached warm start)'}")
        started = time.perf_counter()
        rows, kept, first_ratios = timed_steps(runs, max(2, args.steps))
        wall = time.perf_counter() - started
        checks = numerics(runs, kept)
    counted = {arm: r[1:] for arm, r in rows.items()}
    summary: dict = {
        "cpu_bf16_matmul": units,
        "gemm": gemm,
        "threads": torch.get_num_threads(),
        "policy": init,
        "steps_counted": len(counted["fp32"]),
        "wall_s": wall,
        "arms": {},
    }
    print(f"\nmedians over steps 2..{len(rows['fp32'])} ({len(counted['fp32'])} per arm):")
    print(f"{'arm':6s} " + " ".join(f"{p:>13s}" for p in PHASES) + f" {'rollouts/s':>11s} {'reward':>7s}")
    for arm, r in counted.items():
        phases = {p: median(r, f"time/{p}") for p in PHASES}
        rollouts = median(r, "rollout/num")
        per_s = rollouts / phases["step"] if phases["step"] else 0.0
        summary["arms"][arm] = {
            **phases,
            "rollouts_per_s": per_s,
            "reward_mean": median(r, "reward/mean"),
            "search_calls_mean": median(r, "rollout/search_calls_mean"),
            "generation_tokens_per_s": median(r, "perf/generation_tokens_per_s"),
            "update_tokens_per_s": median(r, "perf/update_tokens_per_s"),
            **{
                k.split("/")[1]: median(r, k)
                for k in (
                    "rollout/prompt_length_mean",
                    "rollout/response_length_mean",
                    "rollout/observation_length_mean",
                )
            },
        }
        print(
            f"{arm:6s} "
            + " ".join(f"{phases[p]:12.2f}s" for p in PHASES)
            + f" {per_s:11.3f} {summary['arms'][arm]['reward_mean']:7.2f}"
        )
    a, b = summary["arms"]["fp32"], summary["arms"]["bf16"]
    ratio = a["step"] / b["step"] if b["step"] else 0.0
    summary["step_speedup"] = ratio
    summary["phase_speedup"] = {p: a[p] / b[p] for p in PHASES if b[p] > 0 and a[p] > 0}
    scoring_update_fp32 = a["frozen_prefix"] + a["logprobs"] + a["update"]
    scoring_update_bf16 = b["frozen_prefix"] + b["logprobs"] + b["update"]
    summary["scoring_plus_update_speedup"] = scoring_update_fp32 / scoring_update_bf16 if scoring_update_bf16 else 0.0
    print(
        f"step: fp32 {a['step']:.2f}s, bf16 {b['step']:.2f}s -> {ratio:.2f}x (target >= 2x); generation "
        f"{summary['phase_speedup'].get('generation', 0):.2f}x, prefix + scoring + update "
        f"{summary['scoring_plus_update_speedup']:.2f}x"
    )
    if min(a["reward_mean"], b["reward_mean"]) == 0.0 and max(a["reward_mean"], b["reward_mean"]) == 0.0:
        print("WARNING: every reward was 0 in both arms: the update did no policy-gradient work")
    summary["numerics"] = {**checks, "first_bf16_step_max_log_ratio": max(first_ratios) if first_ratios else None}
    n = summary["numerics"]
    print(
        f"numerics on {n['policy_tokens']} policy tokens: bf16 scoring vs fp32 scoring max |dlogp| "
        f"{n['bf16_vs_fp32_scoring_max']:.4f} (mean {n['bf16_vs_fp32_scoring_mean']:.5f}); fp32 sampling vs fp32 "
        f"scoring {n['fp32_sampling_vs_fp32_scoring_max']:.2e}; bf16 sampling vs bf16 scoring "
        f"{n['bf16_sampling_vs_bf16_scoring_max']:.4f}; first bf16 step max |log ratio| "
        f"{n['first_bf16_step_max_log_ratio']:.2e} (target < 1e-3)"
    )
    if "bf16_captured_prefix_vs_fp32_scoring_max" in n:
        print(
            f"the bf16 arm's last batch scored through the prefix its decoder captured vs fp32 scoring: max |dlogp| "
            f"{n['bf16_captured_prefix_vs_fp32_scoring_max']:.4f} (mean {n['bf16_captured_prefix_vs_fp32_scoring_mean']:.5f}); "
            f"through a computed bf16 prefix {n['bf16_computed_prefix_vs_fp32_scoring_max']:.4f} "
            f"(mean {n['bf16_computed_prefix_vs_fp32_scoring_mean']:.5f})"
        )
    shares = {
        arm: sum(float(m.get("perf/prefix_from_rollouts", 0.0)) for m in r) / max(1, len(r)) for arm, r in rows.items()
    }
    summary["prefix_from_rollouts_share"] = shares
    print("steps whose prefix came from the rollouts: " + ", ".join(f"{arm} {v:.0%}" for arm, v in shares.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return 0


def lag_main(args: argparse.Namespace) -> int:
    """``--policy-lag K``: the fresh step against the stale-weights step, per phase, and their ratio."""
    from stratarl.infra.threads import set_threads

    set_threads(args.threads)
    arms = lag_arms(args.policy_lag, with_pass=not args.no_pass_arm)
    with tempfile.TemporaryDirectory() as tmp:
        runs, init = build_arms(args.config, args.overrides, Path(tmp), not args.no_warm_start, arms)
        if not args.no_pass_arm:
            with_scoring_pass(runs[f"lag{args.policy_lag}+pass"])
        print(f"policy: {init or 'the base model (no cached warm start)'}; {torch.get_num_threads()} threads")
        rows, _, _ = timed_steps(runs, max(2, args.steps), keep=False)
    summary: dict = {"threads": torch.get_num_threads(), "policy": init, "arms": {}}
    print(f"\nmedians over steps 2..{len(rows['lag0'])}:")
    print(f"{'arm':10s} " + " ".join(f"{p:>13s}" for p in PHASES) + f" {'tokens':>8s} {'lag':>5s}")
    for arm, r in rows.items():
        counted = r[1:]
        phases = {p: median(counted, f"time/{p}") for p in PHASES}
        tokens = median(counted, "rollout/response_length_mean")
        lag = median(counted, "offpolicy/lag")
        summary["arms"][arm] = {**phases, "response_length_mean": tokens, "lag": lag}
        print(f"{arm:10s} " + " ".join(f"{phases[p]:12.2f}s" for p in PHASES) + f" {tokens:8.1f} {lag:5.1f}")
    fresh = summary["arms"]["lag0"]
    for arm in list(arms)[1:]:
        # Each stale step against the fresh step run just before it: the pair shares the machine's load.
        pairs = [b["time/step"] / a["time/step"] for a, b in zip(rows["lag0"][1:], rows[arm][1:], strict=True)]
        ratio = summary["arms"][arm]["step"] / fresh["step"] if fresh["step"] else 0.0
        summary["arms"][arm].update(over_fresh=ratio, pair_ratio_median=statistics.median(pairs))
        print(
            f"step: lag 0 {fresh['step']:.3f}s, {arm} {summary['arms'][arm]['step']:.3f}s -> {ratio:.3f}x the "
            f"fresh step; median of the {len(pairs)} step pairs' ratios {statistics.median(pairs):.3f}x "
            "(target <= 1.10)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
