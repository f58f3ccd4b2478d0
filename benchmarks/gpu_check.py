"""One-GPU check: what the single-GPU path of `stratarl train` does on one device, in one run.

    python benchmarks/gpu_check.py --device cuda --size full --out gpu_check.json     # sized for < 5 min on one H200
    python benchmarks/gpu_check.py --device cpu --size full --sections lab            # the lab's CPU reference
    python benchmarks/gpu_check.py --device cpu --size tiny                           # the test's run (< 1 minute)

Four sections, every number measured in this run (``--sections`` picks some):

lab         configs/lab.yaml's RL loop (stratarl.trainer.run.build_run / stratarl.trainer.step.rl_step, what
            `stratarl train` runs) for ``--lab-steps`` timed steps after one warm-up step: RL steps per
            second, then the held-out EM (greedy, the config's max_eval_examples questions).
            ``--init-from DIR`` starts from a warm start (`stratarl sft configs/lab.yaml` writes one; its
            folder is printed); without it the policy starts from random weights and its EM measures
            nothing learned. The CPU reference is the same command with ``--device cpu`` (and the same
            --retriever and --init-from).
generation  greedy decoding, fixed prompt and new-token counts, of a random-weight model with
            SmolLM2-135M's architecture (hidden 576, 30 layers, 9 heads, 3 KV heads, MLP 1536, vocabulary
            49,152, tied embeddings; `tiny`: a 2-layer stand-in) at batch 8, 64 and 256: the trainer's
            generator for this device (``make_generator``: on CUDA the generic KV-cache loop, also
            returning log-probs) vs Hugging Face ``generate`` (tokens only), same model, same precision.
update      optimizer steps of the trainer (stratarl.trainer.update.optimizer_step, grpo, no KL) on a
            batch of distinct prompts with every response token a policy token: update tokens/s and MFU
            against this device's matmul rate, measured here in the update's dtype (bf16 or fp32).
            Model FLOPs per step = 6 x trainable decoder params x tokens + 2 x frozen decoder params x
            tokens + 6 x (vocab x hidden) x policy tokens (the tied LM head, applied only where a
            log-prob is needed). Attention scores and the LM head's recomputation in backward are
            executed but not counted, so MFU is a lower bound; above 100% would be a measurement bug.
memory      torch.cuda.max_memory_allocated per section (on a CPU: the process's peak RSS instead).

Needs only torch, transformers and stratarl's pure-Python dependencies: no network, no bm25s /
PyStemmer (``--retriever builtin``, the default when they are missing, is a small BM25 in this file:
the same lucene weights, no stemming or stop words, so EM is comparable only to a run with the same
``--retriever``), no pyarrow (the lab's task is then generated in memory: the same questions), no gguf
(tokenizers are the lab's word-level one or none).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # run from a plain checkout, without `pip install -e .`

SECTIONS = ("lab", "generation", "update")
SIZES = {
    # SmolLM2-135M's architecture (HuggingFaceTB/SmolLM2-135M config.json).
    "full": {
        "model": {
            "vocab_size": 49152,
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "max_position_embeddings": 8192,
        },
        "batches": (8, 64, 256),
        "prompt_tokens": 128,
        "new_tokens": 128,
        "update": {"rows": 16, "prompt": 256, "response": 768, "steps": 5, "micro_batch_tokens": 8192},
        "lab_steps": 30,
        "gemm": 8192,
    },
    "tiny": {
        "model": {
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 256,
        },
        "batches": (2, 4),
        "prompt_tokens": 8,
        "new_tokens": 8,
        "update": {"rows": 4, "prompt": 16, "response": 32, "steps": 2, "micro_batch_tokens": 1024},
        "lab_steps": 2,
        "gemm": 256,
    },
}
# The lab at the reduced size of tests/trainer/test_trainer_lab_e2e.py (seconds on a CPU).
LAB_TINY = [
    "model.tiny_hidden_size=32",
    "model.tiny_intermediate_size=64",
    "model.tiny_num_heads=2",
    (
        "data.synthetic.options={size: 150, num_train: 40, num_test: 8, hop_mix: [0.3, 0.7, 0.0], guessable: none, "
        "name_pool: 300}"
    ),
    "data.max_eval_examples=8",
    "eval.batch_size=8",
    "trainer.prompts_per_step=2",
    "rollout.group_size=2",
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_memory(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"max_memory_allocated_bytes": int(torch.cuda.max_memory_allocated(device))}
    # ru_maxrss is in KiB on Linux: the whole process's peak, not one section's.
    return {
        "max_memory_allocated_bytes": None,
        "peak_rss_bytes": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024,
    }


# --------------------------------------------------------------------------- retrieval without bm25s


class BuiltinBM25:
    """BM25 (lucene idf log(1 + (N - df + 0.5) / (df + 0.5)), k1 = 1.5, b = 0.75) over lower-cased words of
    2+ word characters, in pure Python: for machines without bm25s / PyStemmer. No stemming, no stop words."""

    WORD = re.compile(r"(?u)\b\w\w+\b")

    def __init__(self, passages, k1: float = 1.5, b: float = 0.75) -> None:
        self.passages = list(passages)
        self.postings: dict[str, list[tuple[int, float]]] = {}
        docs = [self.WORD.findall(p.contents.lower()) for p in self.passages]
        avg = sum(map(len, docs)) / max(1, len(docs))
        n = len(docs)
        counts: list[dict[str, int]] = []
        for words in docs:
            c: dict[str, int] = {}
            for w in words:
                c[w] = c.get(w, 0) + 1
            counts.append(c)
        df: dict[str, int] = {}
        for c in counts:
            for w in c:
                df[w] = df.get(w, 0) + 1
        for i, (c, words) in enumerate(zip(counts, docs)):
            norm = k1 * (1 - b + b * len(words) / avg)
            for w, tf in c.items():
                idf = math.log(1 + (n - df[w] + 0.5) / (df[w] + 0.5))
                self.postings.setdefault(w, []).append((i, idf * tf * (k1 + 1) / (tf + norm)))

    def search(self, queries: list[str], k: int):
        from stratarl.retrieval.base import Passage

        out = []
        for query in queries:
            scores: dict[int, float] = {}
            for w in set(self.WORD.findall(query.lower())):
                for i, s in self.postings.get(w, ()):
                    scores[i] = scores.get(i, 0.0) + s
            best = sorted(scores.items(), key=lambda item: (-item[1], item[0]))[:k]
            out.append([Passage(self.passages[i].id, self.passages[i].contents, s) for i, s in best])
        return out


def _bm25_available() -> bool:
    """Whether stratarl's BM25Retriever can run here (it needs bm25s and PyStemmer)."""
    try:
        import bm25s  # noqa: F401
        import Stemmer  # noqa: F401
    except ImportError:
        return False
    return True


def _pyarrow_available() -> bool:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


def task_in_memory(cfg, work: Path):
    """The synthetic task as ``stratarl.trainer.synthetic.load_synthetic_task`` builds it, without its parquet
    files (pyarrow): the same generator, seed and options, the corpus written as jsonl under ``work``."""
    import dataclasses

    from stratarl.data.synth import generate_knowledge_base, name_pool_words
    from stratarl.retrieval.corpus import write_corpus
    from stratarl.trainer.task import TaskData

    options = cfg.data.synthetic.options
    kb = generate_knowledge_base(seed=cfg.data.synthetic.seed, **options)
    corpus = write_corpus(kb.passages, work / "corpus.jsonl")
    pool = options.get("name_pool")
    return TaskData(
        train=[dataclasses.replace(e, prompt=None) for e in kb.train],
        test=[dataclasses.replace(e, prompt=None) for e in kb.test],
        corpus_path=Path(corpus),
        vocabulary_texts=[" ".join(name_pool_words(int(pool)))] if pool else [],
    )


# --------------------------------------------------------------------------- lab


def lab_section(args, device: torch.device, work: Path) -> dict:
    from contextlib import ExitStack
    from unittest import mock

    from stratarl.evaluation.greedy import evaluate, overall
    from stratarl.retrieval.corpus import load_corpus
    from stratarl.trainer import run as run_module
    from stratarl.trainer.config import load_config
    from stratarl.trainer.setup import eval_settings, limit_per_source
    from stratarl.trainer.step import rl_step

    retriever = args.retriever
    if retriever == "auto":
        retriever = "bm25" if _bm25_available() else "builtin"
    overrides = [
        f"trainer.device={device}",
        f"trainer.precision={args.precision}",
        "logging.progress=false",
        "logging.tensorboard=false",
        "logging.num_transcripts=0",
        "sft.enabled=false",
        f"trainer.output_dir={work}",
    ]
    if args.size == "tiny":
        overrides = LAB_TINY + overrides
    cfg = load_config(REPO / "configs" / "lab.yaml", overrides)
    steps = args.lab_steps or SIZES[args.size]["lab_steps"]
    task_source = "parquet cache" if _pyarrow_available() else "in memory (no pyarrow)"
    # build_run has no seam for the task or the retriever: the fallbacks replace the two functions it calls,
    # in stratarl.trainer.run, while it runs.
    with ExitStack() as fallbacks:
        if retriever == "builtin":
            # build_run indexes the corpus with BM25Retriever (bm25s); this run uses the builtin one instead.
            fallbacks.enter_context(
                mock.patch.object(
                    run_module, "build_task_retriever", lambda cfg, task: BuiltinBM25(load_corpus(task.corpus_path))
                )
            )
        if task_source != "parquet cache":
            # load_task caches the generated task as parquet (pyarrow); generate it in memory instead.
            fallbacks.enter_context(mock.patch.object(run_module, "load_task", lambda cfg: task_in_memory(cfg, work)))
        run = run_module.build_run(cfg, work / "lab", init_from=args.init_from)
    rl_step(run)  # warm-up: first CUDA kernels, allocator, caches
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        run.retriever.start_step()
        last = rl_step(run)
    _sync(device)
    seconds = time.perf_counter() - start
    examples = limit_per_source(run.task.test, cfg.data.max_eval_examples)
    with run.retriever.unbudgeted():
        result = evaluate(
            run.model, run.tokenizer, run.retriever, examples, eval_settings(cfg), num_transcripts=0, progress=False
        )
    em = overall(result).get("em", float("nan"))
    reference = (
        f"python benchmarks/gpu_check.py --device cpu --size {args.size} --sections lab --lab-steps {steps} "
        f"--retriever {retriever} --precision fp32" + (f" --init-from {args.init_from}" if args.init_from else "")
    )
    return {
        "config": "configs/lab.yaml",
        "overrides": overrides,
        "timed_steps": steps,
        "warmup_steps": 1,
        "steps_per_s": steps / seconds,
        "seconds": seconds,
        "retriever": retriever,
        "task": task_source,
        "init_from": args.init_from,
        "eval_questions": len(examples),
        "eval_em": float(em),
        "last_step_reward_mean": float(last.get("reward/mean", float("nan"))),
        "last_step_clip_frac_first_step": float(last.get("loss/clip_frac_first_step", float("nan"))),
        "cpu_reference_command": reference,
    }


# --------------------------------------------------------------------------- generation


class _IdTokenizer:
    """What the generators read of a tokenizer when there are no stop strings: ids and a length."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = vocab_size - 1
        self.pad_token_id = 0

    def __len__(self) -> int:
        return self.vocab_size


def build_smollm2_like(size: str, device: torch.device, seed: int = 0):
    """A random-weight Llama with SmolLM2-135M's architecture (or the tiny stand-in), fp32 master weights,
    SDPA attention. The EOS embedding row is zero, so with tied embeddings EOS's logit is 0 and a greedy
    row (whose largest logit over ~49k random ones is positive) never stops early."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dims = SIZES[size]["model"]
    vocab = dims["vocab_size"]
    config = LlamaConfig(
        **dims,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=vocab - 1,
        attn_implementation="sdpa",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.get_input_embeddings().weight[vocab - 1].zero_()
    model.config.use_cache = True
    return model.to(device).eval(), _IdTokenizer(vocab)


def _time(fn, device: torch.device) -> tuple[float, object]:
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - start, out


def generation_section(args, device: torch.device, policy) -> dict:
    from stratarl.rollout.backends import AutocastGenerator, make_generator
    from stratarl.rollout.generation import KVCacheGenerator, SamplingParams

    spec = SIZES[args.size]
    model, tokenizer = build_smollm2_like(args.size, device)
    new = spec["new_tokens"]
    params = SamplingParams(max_new_tokens=new, greedy=True, stop_strings=(), eos_after=())
    ours = make_generator(model, tokenizer, "kv_cache", seed=0, policy=policy)
    inner = ours.inner if isinstance(ours, AutocastGenerator) else ours
    path = "fast decoder (CPU)" if getattr(inner, "fast_decoder", None) is not None else "generic KV-cache loop"
    fast = None
    if device.type == "cuda":  # the CPU fast decoder on this GPU, for information: the trainer does not use it
        fast = KVCacheGenerator(model, tokenizer, seed=0, fast=True)
        fast = AutocastGenerator(fast, policy) if policy.autocast_dtype is not None else fast
    rows = []
    g = torch.Generator().manual_seed(0)
    for batch in spec["batches"]:
        prompts = torch.randint(2, tokenizer.vocab_size - 1, (batch, spec["prompt_tokens"]), generator=g).tolist()
        ids = torch.tensor(prompts, device=device)
        mask = torch.ones_like(ids)

        def hf():
            with torch.inference_mode(), policy.autocast():
                return model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=0,
                    eos_token_id=tokenizer.eos_token_id,
                )

        def ours_call(generator=ours):
            with torch.inference_mode():
                return generator.generate(prompts, params)

        row = {"batch": batch}
        for name, fn in (("ours", ours_call), ("hf", hf)):
            fn()  # warm-up at this batch size
            seconds, out = _time(fn, device)
            tokens = (
                sum(len(r.token_ids) for r in out)
                if name == "ours"
                else int(out.shape[0] * (out.shape[1] - ids.shape[1]))
            )
            row[f"{name}_tokens"] = tokens
            row[f"{name}_tok_per_s"] = tokens / seconds
        row["ours_over_hf"] = row["ours_tok_per_s"] / row["hf_tok_per_s"]
        if fast is not None:
            try:
                fast_call = lambda: ours_call(fast)  # noqa: E731
                fast_call()
                seconds, out = _time(fast_call, device)
                row["fast_decoder_tok_per_s"] = sum(len(r.token_ids) for r in out) / seconds
            except Exception as error:  # report, do not stop the check
                row["fast_decoder_error"] = f"{type(error).__name__}: {str(error)[:200]}"
        rows.append(row)
    return {
        "model": {**spec["model"], "tie_word_embeddings": True, "weights": "random"},
        "prompt_tokens": spec["prompt_tokens"],
        "new_tokens": new,
        "greedy": True,
        "ours_path": path,
        "hf": "model.generate(do_sample=False, min_new_tokens=max_new_tokens): tokens only; ours also returns "
        "each token's log-prob",
        "rows": rows,
    }


# --------------------------------------------------------------------------- update


def matmul_peak(device: torch.device, dtype: torch.dtype, n: int, seconds: float = 1.0) -> float:
    """Best FLOP/s of an [n, n] @ [n, n] product in ``dtype`` over ``seconds`` of repeats."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    _sync(device)
    best, end, reps = 0.0, time.perf_counter() + seconds, 10 if device.type == "cuda" else 1
    while time.perf_counter() < end:
        start = time.perf_counter()
        for _ in range(reps):
            a @ b
        _sync(device)
        best = max(best, reps * 2 * n**3 / (time.perf_counter() - start))
    return best


def model_flops(model, decoder_tokens: int, head_tokens: int) -> tuple[float, dict]:
    """The module docstring's formula; returns (FLOPs of one optimizer step, the counts it used)."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    decoder = model.get_decoder()
    skip = {id(embedding)}
    trainable = sum(p.numel() for p in decoder.parameters() if id(p) not in skip and p.requires_grad)
    frozen = sum(p.numel() for p in decoder.parameters() if id(p) not in skip and not p.requires_grad)
    head_factor = 6 if head.requires_grad else 2
    flops = 6.0 * trainable * decoder_tokens + 2.0 * frozen * decoder_tokens + head_factor * head.numel() * head_tokens
    return flops, {
        "trainable_decoder_params": trainable,
        "frozen_decoder_params": frozen,
        "lm_head_params": head.numel(),
        "decoder_tokens": decoder_tokens,
        "head_tokens": head_tokens,
    }


def update_section(args, device: torch.device, policy) -> dict:
    from stratarl.trainer.batch import collate_sequences
    from stratarl.trainer.config import config_from_dict
    from stratarl.trainer.learner import build_learner
    from stratarl.trainer.settings import UpdateSettings
    from stratarl.trainer.update import optimizer_step, score_batch

    spec = SIZES[args.size]["update"]
    model, _ = build_smollm2_like(args.size, device, seed=1)
    model.config.use_cache = False
    cfg = config_from_dict(
        {},
        [
            f"trainer.device={device}",
            f"trainer.precision={policy.precision}",
            "algo.name=grpo",
            "algo.kl_coef=0",
            f"trainer.micro_batch_tokens={spec['micro_batch_tokens']}",
            "trainer.logprob_chunk_tokens=4096",
            "trainer.prompts_per_step=1",
            f"rollout.group_size={spec['rows']}",
        ],
    )
    learner = build_learner(model, cfg, total_optimizer_steps=spec["steps"] + 1)
    settings = UpdateSettings.from_config(cfg)
    g = torch.Generator().manual_seed(2)
    vocab = model.config.vocab_size
    prompts = torch.randint(2, vocab - 1, (spec["rows"], spec["prompt"]), generator=g).tolist()  # all distinct
    responses = torch.randint(2, vocab - 1, (spec["rows"], spec["response"]), generator=g).tolist()
    batch = collate_sequences(prompts, responses, [[1] * spec["response"]] * spec["rows"], 0).to(device)
    scored = score_batch(learner, batch, settings)  # old log-probs: the first step's ratios are 1
    advantages = torch.randn(spec["rows"], 1, generator=g).to(device) * batch.response_mask
    batch = scored.with_advantages(advantages, advantages)  # grpo's returns are its advantages (no critic)
    learner.model.train()
    optimizer_step(learner, batch, settings)  # warm-up
    _sync(device)
    start = time.perf_counter()
    for _ in range(spec["steps"]):
        optimizer_step(learner, batch, settings)
    _sync(device)
    seconds = (time.perf_counter() - start) / spec["steps"]
    decoder_tokens, head_tokens = int(batch.attention_mask.sum()), int(batch.response_mask.sum())
    flops, counts = model_flops(model, decoder_tokens, head_tokens)
    dtype = torch.bfloat16 if policy.precision == "bf16" else torch.float32
    peak = matmul_peak(device, dtype, SIZES[args.size]["gemm"])
    mfu = flops / seconds / peak
    return {
        "rows": spec["rows"],
        "prompt_tokens": spec["prompt"],
        "response_tokens": spec["response"],
        "seconds_per_step": seconds,
        "tokens_per_s": decoder_tokens / seconds,
        "model_flops_per_step": flops,
        "flop_counts": counts,
        "achieved_flops_per_s": flops / seconds,
        "peak_matmul_flops_per_s": peak,
        "peak_dtype": str(dtype).removeprefix("torch."),
        "mfu": mfu,
        "mfu_valid": bool(0 < mfu <= 1),
        "formula": "6 x trainable decoder params x tokens + 2 x frozen decoder params x tokens + "
        "6 x vocab x hidden x policy tokens (attention scores and head recomputation not counted)",
    }


# --------------------------------------------------------------------------- main


def _print(results: dict) -> None:
    print(
        f"device {results['device']} ({results['device_name']}), precision {results['precision']}, "
        f"torch {results['torch']}, transformers {results['transformers']}, size {results['size']}"
    )
    lab = results.get("lab")
    if lab:
        print(
            f"[lab] configs/lab.yaml, {lab['timed_steps']} timed RL steps (+{lab['warmup_steps']} warm-up), "
            f"retriever {lab['retriever']}, task {lab['task']}, init_from {lab['init_from'] or 'none (random weights)'}"
        )
        print(
            f"[lab] {lab['steps_per_s']:.3f} RL steps/s; held-out EM {lab['eval_em']:.3f} on "
            f"{lab['eval_questions']} questions"
        )
        print(f"[lab] CPU reference: {lab['cpu_reference_command']}")
    gen = results.get("generation")
    if gen:
        print(
            f"[generation] {gen['model']['num_hidden_layers']}-layer random Llama, prompt {gen['prompt_tokens']}, "
            f"{gen['new_tokens']} new tokens greedy; ours = {gen['ours_path']}"
        )
        for row in gen["rows"]:
            extra = (
                f", fast decoder {row['fast_decoder_tok_per_s']:.0f}"
                if "fast_decoder_tok_per_s" in row
                else f", fast decoder failed: {row['fast_decoder_error']}"
                if "fast_decoder_error" in row
                else ""
            )
            print(
                f"[generation] batch {row['batch']:>4}: ours {row['ours_tok_per_s']:.0f} tok/s, HF generate "
                f"{row['hf_tok_per_s']:.0f} tok/s, ratio {row['ours_over_hf']:.2f}x{extra}"
            )
    up = results.get("update")
    if up:
        print(
            f"[update] {up['rows']} rows x ({up['prompt_tokens']} prompt + {up['response_tokens']} response) tokens: "
            f"{up['seconds_per_step'] * 1e3:.1f} ms/step, {up['tokens_per_s']:.0f} tokens/s"
        )
        print(
            f"[update] MFU {100 * up['mfu']:.3g}% = {up['achieved_flops_per_s'] / 1e12:.3f} TFLOP/s of a measured "
            f"{up['peak_dtype']} matmul peak {up['peak_matmul_flops_per_s'] / 1e12:.3f} TFLOP/s"
            + ("" if up["mfu_valid"] else "  <- outside (0, 100%]: a measurement bug")
        )
        print(f"[update] FLOPs: {up['formula']}")
    for name, mem in results["memory"].items():
        value = mem.get("max_memory_allocated_bytes")
        text = (
            f"{value / 2**30:.2f} GiB max allocated"
            if value is not None
            else f"n/a on cpu (process peak RSS {mem['peak_rss_bytes'] / 2**30:.2f} GiB)"
        )
        print(f"[memory] {name}: {text}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=tuple(SIZES), default="full")
    parser.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto")
    parser.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}"
    )
    parser.add_argument("--lab-steps", type=int, default=0, help="timed RL steps of the lab (default: 30 full, 2 tiny)")
    parser.add_argument(
        "--init-from", default=None, help="the lab's warm-start model folder (`stratarl sft configs/lab.yaml`)"
    )
    parser.add_argument("--retriever", choices=("auto", "bm25", "builtin"), default="auto")
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {unknown}; use a subset of {','.join(SECTIONS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible to this torch build; use --device cpu")
    if args.retriever == "bm25" and not _bm25_available():
        parser.error(
            "--retriever bm25 needs bm25s and PyStemmer (pip install bm25s PyStemmer); or use --retriever builtin"
        )
    import transformers

    from stratarl.infra.precision import DevicePolicy

    device = torch.device(args.device)
    policy = DevicePolicy.create(device, args.precision)
    args.precision = policy.precision
    torch.manual_seed(0)
    results: dict = {
        "device": str(device),
        "size": args.size,
        "precision": policy.precision,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "memory": {},
    }
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as work:
        for name in SECTIONS:
            if name not in sections:
                continue
            _reset_memory(device)
            start = time.perf_counter()
            if name == "lab":
                results["lab"] = lab_section(args, device, Path(work))
            elif name == "generation":
                results["generation"] = generation_section(args, device, policy)
            else:
                results["update"] = update_section(args, device, policy)
            results[name]["section_seconds"] = time.perf_counter() - start
            results["memory"][name] = _peak_memory(device)
            print(f"[{name}] done in {results[name]['section_seconds']:.1f}s", flush=True)
    _print(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
