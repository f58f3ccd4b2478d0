"""Generation speed of stratarl's KV-cache sampling loop vs Hugging Face ``generate`` on
SmolLM2-135M-Instruct (fp32, CPU), and as a fraction of this machine's decode limit.

Same run, same model, same left-padded ~200-token prompts, greedy, exactly
``--new-tokens`` tokens per row (EOS and stop strings off, so both do equal work):

- HF: ``model.generate(min_new_tokens=N, max_new_tokens=N, do_sample=False)``.
- ours: ``KVCacheGenerator.generate`` (our stop rule and log-prob bookkeeping included),
  on its fast Llama-family forward (``stratarl.rollout.fast_forward``); "generic" is
  the same loop on the model's own forward with a ``DynamicCache`` (``fast=False``).

The machine limit for one decode step at batch b is
``max(weight_bytes / read_bandwidth, 2 * params * b / matmul_flops)``, both measured
here with torch (a large-tensor sum for bandwidth, a 2048^3 matmul for FLOP/s). Our
decode-phase tokens/s (time for N tokens minus time for 1 token) is reported against it.
Targets: ours >= 2x HF at batch 8 and 32, >= 35% of the limit at batch 32.

Both backends pay the same prefill (~200 x batch prompt tokens, compute-bound), so the
end-to-end ratio is bounded by it; the decode phase is also reported on its own for
both (time for N tokens minus time for 1). ``--grouped 32`` adds the RL case: 32 rows
= 8 prompts x 4 samples (a GRPO group), where our prefill runs each prompt once.

Also measures whether dropping finished rows from the batch beats keeping them
(``--drop-check``), on a batch whose rows stop at different lengths.

    python benchmarks/bench_generation.py [--batch-sizes 1 8 32] [--new-tokens 64] [--prompt-tokens 200] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch

from stratarl.data.models import load_model_and_tokenizer
from stratarl.rollout import KVCacheGenerator, SamplingParams, encode_prompt

FILLER = ("Doc 1(Title: \"Paris\") Paris is the capital and most populous city of France, on the Seine. "
          "Doc 2(Title: \"Lyon\") Lyon is the third-largest city of France, at the confluence of rivers. ")


def make_prompts(tokenizer, batch: int, prompt_tokens: int) -> list[list[int]]:
    """~prompt_tokens-token Search-R1 prompts, lengths varying by up to 8 tokens (left padding is exercised)."""
    prompts = []
    for row in range(batch):
        question = f"(case {row}) " + FILLER * 8 + " Which city is the capital of France"
        ids = encode_prompt(tokenizer, question)
        target = prompt_tokens - (row % 9)
        prompts.append(ids[-target:] if len(ids) >= target else ids)
    return prompts


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_bandwidth(megabytes: int = 512) -> float:
    """Bytes/s of reading a large fp32 tensor (sum), best of 5."""
    x = torch.ones(megabytes * 2**20 // 4)
    seconds = best_time(lambda: x.sum(), 5)
    return x.numel() * 4 / seconds


def measure_flops(n: int = 2048) -> float:
    """FLOP/s of an n^3 fp32 matmul, best of 3."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    seconds = best_time(lambda: a @ b, 3)
    return 2 * n**3 / seconds


def hf_generate(model, tokenizer, prompts, new_tokens):
    from stratarl.rollout.generation import left_pad

    ids, mask = left_pad(prompts, tokenizer.pad_token_id, "cpu")
    with torch.inference_mode():
        return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, min_new_tokens=new_tokens,
                              max_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id)


def ours_generate(model, tokenizer, prompts, new_tokens, drop_finished=True, limits=None, fast=None):
    # A new generator per call: the fast path's weight fusion is paid every time, as after
    # every policy update in training.
    generator = KVCacheGenerator(model, tokenizer, drop_finished=drop_finished, fast=fast)
    generator.eos_ids = {-1}  # equal work: never stop at EOS (HF side uses min_new_tokens)
    params = SamplingParams(max_new_tokens=new_tokens, greedy=True, stop_strings=())
    return generator.generate(prompts, params, limits)


def same_until_eos(ours: list[int], hf: list[int], eos_id: int) -> bool:
    """Greedy ids agree up to our first EOS (HF's min_new_tokens forbids EOS, so rows differ after it)."""
    end = ours.index(eos_id) if eos_id in ours else len(ours)
    return ours[:end] == hf[:end]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=1, help="best of this many runs per measurement")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--no-drop-check", action="store_true", help="skip the drop-vs-mask comparison")
    parser.add_argument("--grouped", type=int, nargs="*", default=[32],
                        help="also these batch sizes as GRPO groups: batch / group-size prompts, each sampled group-size times")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--generic", action="store_true",
                        help="also time our loop on the model's own forward (fast=False)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_model_and_tokenizer()
    model.eval()
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth, flops = measure_bandwidth(), measure_flops()
    print(f"threads={torch.get_num_threads()} params={params / 1e6:.1f}M weights={weight_bytes / 2**20:.0f} MiB "
          f"read bandwidth={bandwidth / 1e9:.1f} GB/s matmul={flops / 1e9:.1f} GFLOP/s")
    print(f"{'batch':>5} {'prompts':>7} {'HF tok/s':>9} {'ours tok/s':>10} {'ours/HF':>7} {'same ids':>8} "
          f"{'HF dec tok/s':>12} {'our dec tok/s':>13} {'dec ours/HF':>11} {'limit tok/s':>11} {'of limit':>8}"
          + (f" {'generic tok/s':>13}" if args.generic else ""))
    cases = [(batch, batch) for batch in args.batch_sizes]
    cases += [(batch, batch // args.group_size) for batch in args.grouped if batch % args.group_size == 0]
    for batch, num_prompts in cases:
        distinct = make_prompts(tokenizer, num_prompts, args.prompt_tokens)
        prompts = [p for p in distinct for _ in range(batch // num_prompts)]  # a GRPO group: G rows per prompt
        start = time.perf_counter()
        hf_out = hf_generate(model, tokenizer, prompts, args.new_tokens)
        hf_time = time.perf_counter() - start
        start = time.perf_counter()
        ours_out = ours_generate(model, tokenizer, prompts, args.new_tokens)
        ours_time = time.perf_counter() - start
        if args.repeats > 1:
            hf_time = min(hf_time, best_time(lambda: hf_generate(model, tokenizer, prompts, args.new_tokens), args.repeats - 1))
            ours_time = min(ours_time, best_time(lambda: ours_generate(model, tokenizer, prompts, args.new_tokens), args.repeats - 1))
        width = max(len(p) for p in prompts)
        same = sum(same_until_eos(o.token_ids, hf_out[row, width:].tolist(), tokenizer.eos_token_id)
                   for row, o in enumerate(ours_out))
        # Decode phase = time for N tokens minus time for the first one (the prefill), for both.
        first_token = best_time(lambda: ours_generate(model, tokenizer, prompts, 1), args.repeats)
        hf_first_token = best_time(lambda: hf_generate(model, tokenizer, prompts, 1), args.repeats)
        decode_rate = batch * (args.new_tokens - 1) / max(ours_time - first_token, 1e-9)
        hf_decode_rate = batch * (args.new_tokens - 1) / max(hf_time - hf_first_token, 1e-9)
        step_limit = max(weight_bytes / bandwidth, 2 * params * batch / flops)
        limit_rate = batch / step_limit
        tokens = batch * args.new_tokens
        line = (f"{batch:>5} {num_prompts:>7} {tokens / hf_time:>9.1f} {tokens / ours_time:>10.1f} {hf_time / ours_time:>6.2f}x "
                f"{same:>4}/{batch:<3} {hf_decode_rate:>12.1f} {decode_rate:>13.1f} {decode_rate / hf_decode_rate:>10.2f}x "
                f"{limit_rate:>11.1f} {decode_rate / limit_rate:>7.0%}")
        if args.generic:
            generic_time = best_time(lambda: ours_generate(model, tokenizer, prompts, args.new_tokens, fast=False), args.repeats)
            line += f" {tokens / generic_time:>13.1f}"
        print(line, flush=True)

    if not args.no_drop_check:
        batch = 8
        prompts = make_prompts(tokenizer, batch, args.prompt_tokens)
        limits = [args.new_tokens // (1 + row) for row in range(batch)]  # rows finish early, at different steps
        kept = best_time(lambda: ours_generate(model, tokenizer, prompts, args.new_tokens, False, limits), args.repeats)
        dropped = best_time(lambda: ours_generate(model, tokenizer, prompts, args.new_tokens, True, limits), args.repeats)
        print(f"finished rows, batch {batch}, row budgets {limits}: keep {kept:.2f} s, drop {dropped:.2f} s "
              f"(drop is {kept / dropped:.2f}x)")


if __name__ == "__main__":
    main()
