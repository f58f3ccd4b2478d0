"""Generation speed of stratarl's KV-cache sampling loop vs Hugging Face ``generate`` on
SmolLM2-135M-Instruct (fp32, CPU), and as a fraction of this machine's decode limit.

Same run, same model, same left-padded ~200-token prompts (distinct per row), greedy,
exactly ``--new-tokens`` tokens per row (EOS and stop strings off, so both do equal work):

- HF: ``model.generate(min_new_tokens=N, max_new_tokens=N, do_sample=False)``.
- ours: ``KVCacheGenerator.generate`` (our stop rule and log-prob bookkeeping included),
  on its fast Llama-family forward (``stratarl.rollout.fast_forward``), with a new
  generator per call, so the weight fusion and packing that follow every policy update in
  training are paid every time; "generic" (``--generic``) is the same loop on the model's
  own forward with a ``DynamicCache`` (``fast=False``).

Columns. "tok/s" is end to end (batch x N tokens over the whole call). The decode phase is
timed inside the same call, not by subtracting a second run: for HF from the first call of
a ``StoppingCriteria`` (made right after the prefill and the first token) to the end of
``generate``; for ours from the end of the prefill to the end of ``generate``; both cover
N - 1 one-token forward steps. Each figure is the best of ``--repeats`` runs, HF and ours
alternating, so background load hits both alike. On a machine shared with other jobs,
``--threads 1 --clock cpu`` times this process's CPU time instead of the wall clock, which
leaves out the time spent waiting for a core (memory-bandwidth contention still counts).
A decode time under 1 ms (or N < 2) is printed as "n/a" rather than divided by.

The decode limit: one step at batch b must read every weight and the KV cache (at the
mean context, prompt + N/2) once and do ``2 * params * b`` FLOPs plus attention, so a
step takes at least ``max(bytes / read_bandwidth, flops / matmul_flops)``, both measured
in this run (reading 512 MiB by a sum or a GEMV for bandwidth, a 2048^3 matmul for FLOP/s); the "bound" column
says which term binds ("memory" at these sizes). No decode rate may exceed the limit: one
that does is flagged "!" (a timing error), never hidden.

Targets: ours >= 2x HF end to end at batch 8 and 32. ``--grouped 32`` adds the RL case:
32 rows = 8 prompts x 4 samples (a GRPO group), where our prefill runs each prompt once.

Also measures whether dropping finished rows from the batch beats keeping them
(``--drop-check``), on a batch whose rows stop at different lengths.

    python benchmarks/bench_generation.py [--batch-sizes 1 8 32] [--new-tokens 64] [--prompt-tokens 200]
        [--repeats 3] [--threads N] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import time

import torch

from stratarl.models import load_model_and_tokenizer
from stratarl.rollout import KVCacheGenerator, SamplingParams, encode_prompt

FILLER = (
    'Doc 1(Title: "Paris") Paris is the capital and most populous city of France, on the Seine. '
    'Doc 2(Title: "Lyon") Lyon is the third-largest city of France, at the confluence of rivers. '
)
MIN_DECODE_SECONDS = 1e-3  # shorter decode phases are below what a clock around a Python loop resolves
clock = time.perf_counter  # wall clock; ``--clock cpu`` swaps in this process's CPU time


def make_prompts(tokenizer, batch: int, prompt_tokens: int) -> list[list[int]]:
    """~prompt_tokens-token Search-R1 prompts: the row number is in the question (the kept tail),
    so rows are distinct; lengths vary by up to 8 tokens (left padding is exercised)."""
    prompts = []
    for row in range(batch):
        question = FILLER * 8 + f" Which city is the capital of France (case {row})"
        ids = encode_prompt(tokenizer, question)
        target = prompt_tokens - (row % 9)
        prompts.append(ids[-target:] if len(ids) >= target else ids)
    return prompts


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return min(times)


def measure_bandwidth(megabytes: int = 512) -> float:
    """Bytes/s of reading a large fp32 tensor once, the faster of a sum and a matrix-vector
    product over it (MKL's GEMV streams memory better than a reduction does), best of 5."""
    x = torch.ones(megabytes * 2**20 // 4)
    matrix, vector = x.view(-1, 1024), torch.ones(1024)
    seconds = min(best_time(x.sum, 5), best_time(lambda: torch.mv(matrix, vector), 5))
    return x.numel() * 4 / seconds


def measure_flops(n: int = 2048) -> float:
    """FLOP/s of an n^3 fp32 matmul, best of 3."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    seconds = best_time(lambda: a @ b, 3)
    return 2 * n**3 / seconds


def decode_rate(batch: int, new_tokens: int, decode_seconds: float | None) -> float | None:
    """Decode-phase tokens/s (batch x (N - 1) tokens), or None when there is no decode phase
    (N < 2) or it is too short to time (so no near-zero time is ever divided by)."""
    if new_tokens < 2 or decode_seconds is None or decode_seconds < MIN_DECODE_SECONDS:
        return None
    return batch * (new_tokens - 1) / decode_seconds


def step_limit(
    config, weight_bytes: int, params: int, batch: int, context: float, bandwidth: float, flops: float
) -> tuple[float, str]:
    """Lower bound on one decode step's seconds at ``batch`` rows and ``context`` cached tokens:
    every weight and the rows' K/V are read once (memory), and the matmul FLOPs are done
    (compute). Returns (seconds, which bound binds)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_bytes = 2 * config.num_hidden_layers * batch * kv_heads * context * head_dim * 4  # K and V, fp32
    attention_flops = 4 * config.num_hidden_layers * batch * heads * head_dim * context  # q k^T and p v
    memory = (weight_bytes + kv_bytes) / bandwidth
    compute = (2 * params * batch + attention_flops) / flops
    return (memory, "memory") if memory >= compute else (compute, "compute")


class _FirstCall:
    """HF ``StoppingCriteria`` that stops nothing and records when ``generate`` first calls it
    (right after the prefill and the first sampled token)."""

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self, input_ids, scores=None, **kwargs):
        if self.at is None:
            self.at = clock()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def hf_generate(model, tokenizer, prompts, new_tokens):
    """(ids [B, L + N], seconds, decode seconds) of one HF generate call."""
    from transformers import StoppingCriteriaList

    from stratarl.rollout.generation import left_pad

    ids, mask = left_pad(prompts, tokenizer.pad_token_id, "cpu")
    first = _FirstCall()
    start = clock()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            min_new_tokens=new_tokens,
            max_new_tokens=new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            stopping_criteria=StoppingCriteriaList([first]),
        )
    end = clock()
    return out, end - start, (end - first.at) if first.at is not None else None


def ours_generate(model, tokenizer, prompts, new_tokens, drop_finished=True, limits=None, fast=None):
    """(generations, seconds, decode seconds) of one call of a new ``KVCacheGenerator``."""
    start = clock()
    generator = KVCacheGenerator(model, tokenizer, drop_finished=drop_finished, fast=fast)
    generator.eos_ids = {-1}  # equal work: never stop at EOS (HF side uses min_new_tokens)
    prefilled: list[float] = []
    for name in ("_start_fast", "_start_generic"):  # note when the prefill returns
        original = getattr(generator, name)

        def timed(*args, _original=original, **kwargs):
            result = _original(*args, **kwargs)
            prefilled.append(clock())
            return result

        setattr(generator, name, timed)
    params = SamplingParams(max_new_tokens=new_tokens, greedy=True, stop_strings=())
    out = generator.generate(prompts, params, limits)
    end = clock()
    return out, end - start, (end - prefilled[0]) if prefilled else None


def same_until_eos(ours: list[int], hf: list[int], eos_id: int) -> bool:
    """Greedy ids agree up to our first EOS (HF's min_new_tokens forbids EOS, so rows differ after it)."""
    end = ours.index(eos_id) if eos_id in ours else len(ours)
    return ours[:end] == hf[:end]


def fmt(value: float | None, width: int, limit: float | None = None) -> str:
    if value is None:
        return f"{'n/a':>{width}}"
    flag = "!" if limit is not None and value > limit else ""
    return f"{value:>{width - len(flag)}.1f}{flag}"


def main() -> None:
    global clock
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs per measurement")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--no-drop-check", action="store_true", help="skip the drop-vs-mask comparison")
    parser.add_argument(
        "--grouped",
        type=int,
        nargs="*",
        default=[32],
        help="also these batch sizes as GRPO groups: batch / group-size prompts, each sampled group-size times",
    )
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall: elapsed time; cpu: this process's CPU time, which on a machine shared with other "
        "jobs leaves out the time spent waiting for a core (needs --threads 1)",
    )
    parser.add_argument(
        "--generic", action="store_true", help="also time our loop on the model's own forward (fast=False)"
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu needs --threads 1: idle OpenMP workers spin, so their CPU time is not work")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        clock = time.process_time

    model, tokenizer = load_model_and_tokenizer()
    model.eval()
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth, flops = measure_bandwidth(), measure_flops()
    print(
        f"threads={torch.get_num_threads()} params={params / 1e6:.1f}M weights={weight_bytes / 2**20:.0f} MiB "
        f"read bandwidth={bandwidth / 1e9:.1f} GB/s matmul={flops / 1e9:.1f} GFLOP/s "
        f"(best of {args.repeats} runs each, HF and ours alternating; {args.clock} clock)"
    )
    print(
        f"{'batch':>5} {'prompts':>7} {'HF tok/s':>9} {'ours tok/s':>10} {'ours/HF':>7} {'same ids':>8} "
        f"{'HF dec tok/s':>12} {'our dec tok/s':>13} {'dec ours/HF':>11} {'limit tok/s':>11} {'bound':>7} {'of limit':>8}"
        + (f" {'generic tok/s':>13}" if args.generic else "")
    )
    cases = [(batch, batch) for batch in args.batch_sizes]
    cases += [(batch, batch // args.group_size) for batch in args.grouped if batch % args.group_size == 0]
    ratios: list[tuple[int, int, float, float | None, float | None]] = []
    same_total = rows_total = 0
    any_over = False
    for batch, num_prompts in cases:
        distinct = make_prompts(tokenizer, num_prompts, args.prompt_tokens)
        prompts = [p for p in distinct for _ in range(batch // num_prompts)]  # a GRPO group: G rows per prompt
        hf_times, hf_decodes, our_times, our_decodes = [], [], [], []
        for _ in range(args.repeats):
            hf_out, seconds, decode = hf_generate(model, tokenizer, prompts, args.new_tokens)
            hf_times.append(seconds)
            hf_decodes.append(decode)
            ours_out, seconds, decode = ours_generate(model, tokenizer, prompts, args.new_tokens)
            our_times.append(seconds)
            our_decodes.append(decode)
        hf_time, ours_time = min(hf_times), min(our_times)
        hf_decode = min((d for d in hf_decodes if d is not None), default=None)
        our_decode = min((d for d in our_decodes if d is not None), default=None)
        width = max(len(p) for p in prompts)
        same = sum(
            same_until_eos(o.token_ids, hf_out[row, width:].tolist(), tokenizer.eos_token_id)
            for row, o in enumerate(ours_out)
        )
        same_total, rows_total = same_total + same, rows_total + batch
        context = sum(len(p) for p in prompts) / batch + args.new_tokens / 2
        limit_step, bound = step_limit(model.config, weight_bytes, params, batch, context, bandwidth, flops)
        limit_rate = batch / limit_step
        hf_rate = decode_rate(batch, args.new_tokens, hf_decode)
        our_rate = decode_rate(batch, args.new_tokens, our_decode)
        any_over |= any(r is not None and r > limit_rate for r in (hf_rate, our_rate))
        dec_ratio = our_rate / hf_rate if our_rate is not None and hf_rate is not None else None
        # Our whole call if its decode phase ran at the limit (prefill and weight packing as measured):
        # the most any decode speed-up can give end to end.
        ceiling = (
            hf_time / (ours_time - our_decode + (args.new_tokens - 1) * limit_step) if our_decode is not None else None
        )
        ratios.append((batch, num_prompts, hf_time / ours_time, dec_ratio, ceiling))
        tokens = batch * args.new_tokens
        line = (
            f"{batch:>5} {num_prompts:>7} {tokens / hf_time:>9.1f} {tokens / ours_time:>10.1f} {hf_time / ours_time:>6.2f}x "
            f"{same:>4}/{batch:<3} {fmt(hf_rate, 12, limit_rate)} {fmt(our_rate, 13, limit_rate)} "
            f"{fmt(dec_ratio, 10)}{'x' if dec_ratio is not None else ' '} {limit_rate:>11.1f} {bound:>7} "
            + (f"{our_rate / limit_rate:>7.0%}" if our_rate is not None else f"{'n/a':>8}")
        )
        if args.generic:
            generic_time = best_time(
                lambda: ours_generate(model, tokenizer, prompts, args.new_tokens, fast=False), args.repeats
            )
            line += f" {tokens / generic_time:>13.1f}"
        print(line, flush=True)
    if args.new_tokens < 2:
        print("decode columns n/a: --new-tokens < 2 leaves no decode phase")
    if any_over:
        print("! a decode rate above the limit is a timing error (too few tokens or repeats?), not a result")

    def summary(column: int) -> str:
        return ", ".join(
            f"batch {r[0]}{f' ({r[1]} prompts)' if r[1] != r[0] else ''} "
            + (f"{r[column]:.2f}x" if r[column] is not None else "n/a")
            for r in ratios
        )

    print(f"ours / HF end to end: {summary(2)}")
    print(f"ours / HF decode phase: {summary(3)}")
    print(f"ours / HF end to end if our decode ran at the limit (prefill and packing as measured): {summary(4)}")
    print(
        f"greedy ids equal to HF generate: {same_total}/{rows_total} rows "
        f"({'all equal' if same_total == rows_total else 'MISMATCH'})"
    )

    if not args.no_drop_check:
        batch = 8
        prompts = make_prompts(tokenizer, batch, args.prompt_tokens)
        limits = [args.new_tokens // (1 + row) for row in range(batch)]  # rows finish early, at different steps
        kept = best_time(lambda: ours_generate(model, tokenizer, prompts, args.new_tokens, False, limits), args.repeats)
        dropped = best_time(
            lambda: ours_generate(model, tokenizer, prompts, args.new_tokens, True, limits), args.repeats
        )
        print(
            f"finished rows, batch {batch}, row budgets {limits}: keep {kept:.2f} s, drop {dropped:.2f} s "
            f"(drop is {kept / dropped:.2f}x)"
        )


if __name__ == "__main__":
    main()
