"""Speed of one RL step of the lab config (a 0.4 M-parameter word-level policy), where its time goes,
and what the same work would cost at this machine's matmul rate.

    python benchmarks/bench_lab.py --init-from /tmp/speed/warm/model            # 20 timed steps, grpo
    python benchmarks/bench_lab.py --init-from DIR --algo so_ppo --steps 30 --threads 1
    python benchmarks/bench_lab.py --init-from DIR --compare-head               # before (HEAD) vs now, interleaved
    python benchmarks/bench_lab.py --init-from DIR rollout.temperature=0.8      # dotted overrides

The steps run through the trainer's own code (``stratarl.trainer.run.build_run`` /
``stratarl.trainer.step.rl_step``, what ``stratarl train`` runs, plus the per-step metrics log line), after
``--warmup`` untimed steps.
Printed, all measured in this run:

1. the fp32 matmul rate of this machine at a relevant shape (the update's LM head: policy tokens x
   hidden @ hidden x vocab) and at a large square (the practical peak every percentage below is of);
2. seconds per step and per phase: generation (the rollout engine minus retrieval), retrieval,
   log-probs (the trainer's no-grad pass: PPO values, recomputed old or reference log-probs), update
   (forward + backward + optimizer), other (batching, advantages, metrics, transcripts, the log line);
3. FLOPs per step: the useful work (every token through the decoder once per pass, the LM head only
   where a log-prob is needed; a group's prompt once), what it would take at the measured peak, and
   the executed FLOPs of one extra step counted by ``torch.utils.flop_counter`` (padding and
   recomputation included), as a share of the peak: a number above 100 % would be a measurement bug
   and is reported as such;
4. a verdict against the target: >= 1.1 steps/s (1,000 steps in 15 minutes).

``--compare-head`` runs the same benchmark in subprocesses on this tree and on a copy of it whose
rollout / trainer-step files are taken from git HEAD (the code before this work), alternating
``--rounds`` times so load drift hits both alike, and prints the ratio.
On a CPU shared with other jobs set ``--threads 1`` (or compare both): OpenMP threads that wait
for a busy core make every one of the step's thousands of tiny ops milliseconds slower.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TARGET_STEPS_PER_S = 1.1
PHASES = ("generation", "retrieval", "logprobs", "update")
# Files whose HEAD versions make the "before" tree of --compare-head: the step's code path that the
# speed work changed (files other work changes stay as they are in the tree).
STEP_FILES = (
    "stratarl/trainer/step.py",
    "stratarl/trainer/run.py",
    "stratarl/trainer/update.py",
    "stratarl/trainer/batch.py",
    "stratarl/trainer/logprobs.py",
    "stratarl/trainer/prefix.py",
    "stratarl/rollout/collect.py",
    "stratarl/rollout/engine.py",
    "stratarl/rollout/backends.py",
    "stratarl/rollout/generation.py",
    "stratarl/rollout/generator.py",
    "stratarl/rollout/stopping.py",
    "stratarl/rollout/sampling.py",
    "stratarl/rollout/kv_cache_generator.py",
    "stratarl/rollout/prefix_cache.py",
    "stratarl/rollout/hf_generator.py",
    "stratarl/rollout/fast_forward.py",
    "stratarl/rollout/fast_decode_support.py",
    "stratarl/rollout/decoder_weights.py",
)


# --------------------------------------------------------------------------- matmul rate


def gemm_rate(m: int, k: int, n: int, seconds: float = 0.5, dtype: torch.dtype = torch.float32) -> float:
    """Best FLOP/s of ``[m, k] @ [k, n]`` in ``dtype`` over ``seconds`` of repeats (the best run is the least
    disturbed)."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    a @ b
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        a @ b
        best = max(best, 2 * m * k * n / (time.perf_counter() - start))
    return best


# --------------------------------------------------------------------------- FLOP model


class FlopModel:
    """Analytic FLOPs of the policy: per token through the decoder, attention per (query, key) pair, LM head per row."""

    def __init__(self, model) -> None:
        config = model.config
        self.hidden = config.hidden_size
        self.vocab = config.vocab_size
        self.layers = config.num_hidden_layers
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or self.hidden // heads
        self.attn_width = heads * head_dim
        per_layer = self.hidden * (heads + 2 * kv_heads) * head_dim + self.attn_width * self.hidden
        per_layer += 3 * self.hidden * config.intermediate_size
        self.per_token = 2 * self.layers * per_layer  # linear layers, one forward
        self.head = 2 * self.hidden * self.vocab

    def tokens(self, n: int, context_sum: int) -> float:
        """n tokens through the decoder; ``context_sum`` = sum over them of the keys each attends to."""
        return n * self.per_token + 4 * self.layers * self.attn_width * context_sum

    def sequence(self, start: int, n: int) -> float:
        """n tokens at positions start, ..., start + n - 1 (each attends to itself and everything before)."""
        return self.tokens(n, n * start + n * (n + 1) // 2)


def useful_flops(fm: FlopModel, collected, cfg) -> dict[str, float]:
    """The work a step cannot avoid: a group's prompt once, every later token once per pass, the LM
    head once per sampled token in generation and once per policy token where log-probs are needed."""
    rollouts, groups = collected.rollouts, collected.group_ids
    prompt_once: dict[int, int] = {}
    for r, g in zip(rollouts, groups):
        prompt_once[g] = len(r.prompt_ids)
    prompts = sum(fm.sequence(0, p) for p in prompt_once.values())
    responses = sum(fm.sequence(len(r.prompt_ids), len(r.response_ids)) for r in rollouts)
    fed_last = sum(fm.tokens(1, r.total_length) for r in rollouts if r.response_ids)  # the last token is never fed
    policy = sum(sum(r.response_mask) for r in rollouts)
    decoder_pass = prompts + responses
    generation = decoder_pass - fed_last + policy * fm.head
    passes = (cfg.algo.old_logprobs == "recompute" or cfg.algorithm.uses_critic) + (cfg.algo.kl_coef > 0)
    head_passes = (cfg.algo.old_logprobs == "recompute") + (cfg.algo.kl_coef > 0)
    logprobs = passes * decoder_pass + head_passes * policy * fm.head
    update = 3 * cfg.trainer.epochs * (decoder_pass + policy * fm.head)  # forward + backward (2x)
    return {"generation": generation, "logprobs": logprobs, "update": update}


def _linear_flops(x, *args, out_val=None, **kwargs) -> int:
    # x [..., K] @ W^T [K, N]: 2 K N per row of x (oneDNN's packed linear and aten.linear, which
    # under inference_mode reaches the dispatcher whole instead of as a matmul).
    return 2 * x.numel() * out_val.shape[-1]


def _matmul_flops(a, b, *args, out_val=None, **kwargs) -> int:
    return 2 * out_val.numel() * a.shape[-1]


def _cpu_attention_flops(q, k, v, *args, out_val=None, **kwargs) -> int:
    # softmax(q k^T) v: two products of B * heads * L * S * D multiply-adds.
    return 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]


def _cpu_attention_backward_flops(grad, q, k, v, *args, out_val=None, **kwargs) -> int:
    return 10 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]  # recompute + dq, dk, dv, dp


def counted_step(run, step_fn) -> tuple[float, dict]:
    """Executed FLOPs of one step: every matmul, linear and attention op the step dispatched, backward
    included (``torch.utils.flop_counter``'s formulas, plus oneDNN's packed linear, CPU flash attention and
    the composite linear / matmul / attention ops that inference_mode dispatches undecomposed)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    registry = dict(flop_registry)
    # Composite ops arrive whole under inference_mode (generation): count them as such.
    registry[torch.ops.aten.linear] = _linear_flops
    registry[torch.ops.aten.matmul] = _matmul_flops
    registry[torch.ops.aten.scaled_dot_product_attention] = _cpu_attention_flops
    if hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        registry[torch.ops.mkldnn._linear_pointwise] = _linear_flops
    if hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"):
        registry[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu] = _cpu_attention_flops
        registry[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward] = _cpu_attention_backward_flops
    total = [0]

    class Counter(TorchDispatchMode):  # FlopCounterMode's module tracker fails under inference_mode
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            formula = registry.get(func.overloadpacket)
            if formula is not None:
                total[0] += int(formula(*args, **kwargs, out_val=out))
            return out

    with Counter():
        metrics = step_fn(run)
    return float(total[0]), metrics


# --------------------------------------------------------------------------- the benchmark


def build(args) -> tuple:
    from stratarl.infra.threads import set_threads
    from stratarl.trainer.config import load_config
    from stratarl.trainer.run import build_run

    tmp = tempfile.mkdtemp(prefix="bench_lab_")
    overrides = [
        f"trainer.num_threads={args.threads}",
        f"trainer.output_dir={tmp}",
        "logging.tensorboard=false",
        f"trainer.steps={args.warmup + args.steps + 1}",
        "eval.before_after=false",
    ]
    if args.algo:
        overrides.append(f"algo.name={args.algo}")
    init_from = args.init_from
    if not init_from and load_config(args.config, list(args.overrides)).sft.enabled:
        # The lab's step is the warm-started policy's (it searches, reads and answers); a from-scratch policy
        # never searches and scores 0, so its step would measure other work.
        from stratarl.trainer.warmstart.stages import cached_warm_start

        init_from = str(cached_warm_start(load_config(args.config, list(args.overrides)))[0])
    if init_from:
        overrides += [f"model.init_from={init_from}", "sft.enabled=false"]
    cfg = load_config(args.config, overrides + list(args.overrides))
    set_threads(cfg.trainer.num_threads)
    run = build_run(cfg, Path(tmp) / "run")
    return cfg, run, tmp


def run_bench(args) -> dict:
    from stratarl.trainer.step import rl_step

    cfg, run, tmp = build(args)
    fm = FlopModel(run.model)
    captured: list = []
    original_collect = run.parts.collect

    def collect(*a, **kw):  # the run's collection, wrapped: it sees every step's rollouts
        out = original_collect(*a, **kw)
        captured.append(out)
        return out

    run.parts = dataclasses.replace(run.parts, collect=collect)

    def step(run) -> dict:
        start = time.perf_counter()
        metrics = rl_step(run)
        run.step += 1
        logged = time.perf_counter()
        run.logger.log(run.step, metrics)  # what `stratarl train` does after every step
        metrics["time/log"] = time.perf_counter() - logged
        metrics["time/total"] = time.perf_counter() - start
        return metrics

    try:
        for _ in range(args.warmup):
            step(run)
        captured.clear()
        rows, started = [], time.perf_counter()
        for _ in range(args.steps):
            rows.append(step(run))
        wall = time.perf_counter() - started
        work = [useful_flops(fm, c, cfg) for c in captured]
        executed, _counted_metrics = counted_step(run, step)
        counted_useful = sum(useful_flops(fm, captured[-1], cfg).values())
    finally:
        run.logger.close()
        shutil.rmtree(tmp, ignore_errors=True)
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in rows)  # noqa: E731
    phases = {p: mean(f"time/{p}") for p in PHASES}
    per_step = wall / args.steps
    phases["other"] = per_step - sum(phases.values())
    return {
        "algo": cfg.algo.name,
        "threads": torch.get_num_threads(),
        "steps": args.steps,
        "step_threads": mean("perf/threads") or torch.get_num_threads(),  # what the step ran on (HEAD: no key)
        "wall_s": wall,
        "step_s": per_step,
        "steps_per_s": args.steps / wall,
        "phases": phases,
        "useful_flops": {p: statistics.fmean(w[p] for w in work) for p in ("generation", "logprobs", "update")},
        "executed_per_useful": executed / counted_useful if counted_useful else float("nan"),
        "executed_flops_counted_step": executed,
        "reward": mean("reward/mean"),
        "answered": mean("rollout/answered_rate"),
        "searches": mean("rollout/search_calls_mean"),
        "response_len": mean("rollout/response_length_mean"),
        "observation_len": mean("rollout/observation_length_mean"),
        "prompt_len": mean("rollout/prompt_length_mean"),
        "policy_tokens": mean("perf/update_policy_tokens"),
        "params": sum(p.numel() for p in run.model.parameters()),
        "hidden": fm.hidden,
        "vocab": fm.vocab,
        "load": os.getloadavg()[0],
        "compute_dtype": str(run.settings.policy.compute_dtype).removeprefix("torch."),
    }


def report(result: dict, peak: float, head_rate: float, head_shape: tuple[int, int, int]) -> list[str]:
    """Human-readable lines of one result; the last one is the verdict."""
    lines = []
    r, ph = result, result["phases"]
    lines.append(
        f"policy: {r['params'] / 1e6:.2f} M params (hidden {r['hidden']}, vocab {r['vocab']}); algo {r['algo']}; "
        f"trainer.num_threads {r['threads']}, the step ran on {r['step_threads']:.0f}; load average {r['load']:.2f}"
    )
    lines.append(
        f"rollouts: prompt {r['prompt_len']:.0f} tok, policy {r['response_len']:.1f} tok, observations "
        f"{r['observation_len']:.1f} tok, {r['searches']:.2f} searches, answered {r['answered']:.2f}, "
        f"reward {r['reward']:.3f}"
    )
    lines.append(
        f"step: {r['step_s'] * 1000:.0f} ms = "
        + ", ".join(f"{k} {v * 1000:.0f} ms ({v / r['step_s']:.0%})" for k, v in ph.items())
    )
    useful = sum(r["useful_flops"].values())
    at_peak = useful / peak
    lines.append(
        f"useful work: {useful / 1e9:.2f} GFLOP/step ("
        + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in r["useful_flops"].items())
        + f"); at the peak {peak / 1e9:.0f} GFLOP/s: "
        f"{at_peak * 1000:.1f} ms/step, at the LM-head GEMM rate {head_rate / 1e9:.0f} GFLOP/s "
        f"({head_shape[0]}x{head_shape[1]} @ {head_shape[1]}x{head_shape[2]}): {useful / head_rate * 1000:.1f} ms/step"
    )
    achieved = useful / r["step_s"]
    executed_rate = achieved * r["executed_per_useful"]
    lines.append(
        f"achieved: useful {achieved / 1e9:.2f} GFLOP/s = {achieved / peak:.2%} of peak; executed "
        f"(flop_counter, one step: {r['executed_per_useful']:.2f}x the useful work) ~{executed_rate / 1e9:.2f} "
        f"GFLOP/s = {executed_rate / peak:.2%} of peak"
        + ("  <-- ABOVE 100 %: a measurement bug" if executed_rate > peak or achieved > peak else "")
    )
    verdict = "PASS" if r["steps_per_s"] >= TARGET_STEPS_PER_S else "FAIL"
    lines.append(
        f"VERDICT {verdict}: {r['steps_per_s']:.2f} steps/s ({r['step_s'] * 1000:.0f} ms/step) vs target "
        f">= {TARGET_STEPS_PER_S} steps/s; 1,000 steps would take {1000 * r['step_s'] / 60:.1f} min "
        f"({r['algo']}, {r['step_threads']:.0f} thread(s), load {r['load']:.2f})"
    )
    return lines


def measure_rates(result: dict) -> tuple[float, float, tuple[int, int, int]]:
    """(peak FLOP/s, FLOP/s at the update's LM-head shape, that shape) on the threads the step ran on, in the
    dtype of the step's matmuls (bf16 for a bf16 policy: its fp32 peak would put a bf16 step above 100%)."""
    shape = (max(int(result["policy_tokens"]), 1), result["hidden"], result["vocab"])
    dtype = getattr(torch, result.get("compute_dtype", "float32"))
    before = torch.get_num_threads()
    torch.set_num_threads(int(result["step_threads"]))
    try:
        peak = max(gemm_rate(1024, 1024, 1024, 1.0, dtype), gemm_rate(2048, 2048, 2048, 1.0, dtype))
        return peak, gemm_rate(*shape, seconds=1.0, dtype=dtype), shape
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------- before vs after


def head_tree(dest: Path) -> Path:
    """A copy of this tree's ``stratarl`` package with ``STEP_FILES`` as in git HEAD (read-only git use)."""
    shutil.copytree(REPO / "stratarl", dest / "stratarl", ignore=shutil.ignore_patterns("__pycache__"))
    for name in STEP_FILES:
        text = subprocess.run(
            ["git", "show", f"HEAD:{name}"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout
        (dest / name).write_text(text)
    return dest


def child(args, pythonpath: Path) -> dict:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--json",
        "--config",
        args.config,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
    ]
    if args.init_from:
        command += ["--init-from", args.init_from]
    if args.algo:
        command += ["--algo", args.algo]
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    out = subprocess.run(command + list(args.overrides), cwd=REPO, env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"benchmark child failed ({pythonpath}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare_head(args) -> None:
    with tempfile.TemporaryDirectory(prefix="bench_lab_head_") as tmp:
        before_tree = head_tree(Path(tmp))
        results: dict[str, list[dict]] = {"before (HEAD)": [], "after (tree)": []}
        for round_index in range(args.rounds):
            for label, path in (("before (HEAD)", before_tree), ("after (tree)", REPO)):
                result = child(args, path)
                results[label].append(result)
                print(
                    f"round {round_index + 1} {label}: {result['steps_per_s']:.2f} steps/s, "
                    f"{result['step_s'] * 1000:.0f} ms/step (load {result['load']:.2f})",
                    flush=True,
                )
    for label, rows in results.items():
        best = min(rows, key=lambda r: r["step_s"])
        print(f"\n== {label}: best of {len(rows)} rounds")
        print("\n".join(report(best, *measure_rates(best))))
    before = statistics.median(r["step_s"] for r in results["before (HEAD)"])
    after = statistics.median(r["step_s"] for r in results["after (tree)"])
    print(f"\nmedian step: before {before * 1000:.0f} ms, after {after * 1000:.0f} ms: {before / after:.2f}x faster")
    # The two trees' policies drift apart after the first update (their rollouts then differ in length), so each
    # phase is also compared per unit of its useful work: seconds per useful TFLOP, medians over the rounds.
    for phase in ("generation", "update", "step"):
        rates = {
            label: statistics.median(_seconds_per_tflop(r, phase) for r in rows) for label, rows in results.items()
        }
        b, a = rates["before (HEAD)"], rates["after (tree)"]
        print(f"{phase}: before {b:.2f} s, after {a:.2f} s per useful TFLOP: {b / a:.2f}x")


def _seconds_per_tflop(result: dict, phase: str) -> float:
    work = result["useful_flops"]
    if phase == "step":
        return result["step_s"] / (sum(work.values()) / 1e12)
    return result["phases"][phase] / (work[phase] / 1e12)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default=str(REPO / "configs" / "lab.yaml"))
    parser.add_argument(
        "--init-from",
        default=None,
        help="model.init_from (e.g. a `stratarl sft` output's model/; "
        "default: the config's cached warm start when its sft section is enabled, built if missing)",
    )
    parser.add_argument("--steps", type=int, default=20, help="timed RL steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (trainer.num_threads)")
    parser.add_argument("--algo", default=None, help="algo.name (grpo, stratified_grpo, ppo, so_ppo, so_grpo)")
    parser.add_argument("--compare-head", action="store_true", help="before (git HEAD step files) vs this tree")
    parser.add_argument("--rounds", type=int, default=2, help="alternations for --compare-head")
    parser.add_argument("--json", action="store_true", help="print one JSON line (used by --compare-head)")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides")
    args = parser.parse_args(argv)
    if args.compare_head:
        compare_head(args)
        return
    result = run_bench(args)
    if args.json:
        print(json.dumps(result))
        return
    peak, head_rate, shape = measure_rates(result)
    print(
        f"matmul fp32, {result['step_threads']:.0f} thread(s): peak {peak / 1e9:.0f} GFLOP/s (best of 1024^3, 2048^3); "
        f"LM-head shape {shape[0]}x{shape[1]} @ {shape[1]}x{shape[2]}: {head_rate / 1e9:.0f} GFLOP/s"
    )
    print("\n".join(report(result, peak, head_rate, shape)))


if __name__ == "__main__":
    main()
