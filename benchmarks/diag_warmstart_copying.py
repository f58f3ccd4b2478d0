"""Where the lab's warm start learns (or loses) copying: the table "Copying has to be learnt in the agent's
layout" in docs/lab.md.

    python benchmarks/diag_warmstart_copying.py 1003                                   # the lab's recipe on world 1003
    python benchmarks/diag_warmstart_copying.py 1003 sft.reading_agent_fraction=0.0    # the old reading layout
    python benchmarks/diag_warmstart_copying.py 1003 sft.reading_agent_fraction=0.0 sft.reading_mix=8

Builds the warm start of configs/demo.yaml with ``data.synthetic.seed=WORLD`` (and the overrides) into
``--out`` (not the cache) and prints, after the reading stage and every ``--every`` demonstration steps:

- reading accuracy: the share of questions whose every answer token is the argmax under teacher forcing, on
  150 reading examples (question after the observation) of two worlds no stage trains on;
- the reading probe (stratarl.trainer.warmstart.probe): greedy single-hop EM on an unseen world, and the 2-hop search
  behaviour.

The warm start itself is the library's (stratarl.trainer.warmstart.stages.warm_start, the same lr schedule and stopping
rule); this script only wraps its reading stage and its step callback to measure in between, so probes
before ``sft.steps`` are extra measurements that do not end the warm start.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

import stratarl.trainer.warmstart.stages as warmstart
from stratarl.trainer.config import load_config
from stratarl.trainer.warmstart.demos import render_reading_examples
from stratarl.trainer.warmstart.probe import PROBE_WORLD_OFFSET, WarmStartFailed, probe_questions, run_probe
from stratarl.trainer.warmstart.settings import WarmStartSettings
from stratarl.trainer.warmstart.worlds import _world, world_seed

REPO = Path(__file__).resolve().parents[1]
# Worlds of the reading-accuracy check: inside the task's stride, away from every stage's range.
CHECK_WORLDS = 900_000


def reading_accuracy(settings: WarmStartSettings, model, tokenizer, *, num_examples: int = 150) -> float:
    """Share of questions of ``num_examples`` reading examples answered token for token (teacher-forced argmax)."""
    rng = random.Random(0)
    examples = []
    for i in range(2):
        kb, retriever = _world(settings.worlds, CHECK_WORLDS + i, hop_mix=(1.0, 0.0, 0.0))
        examples += render_reading_examples(
            kb.train,
            tokenizer,
            retriever,
            {p.id: p.contents for p in kb.passages},
            topk=settings.style.topk,
            max_obs_tokens=settings.style.max_obs_tokens,
            rng=rng,
        )
    right = total = 0
    model.eval()
    with torch.no_grad():
        for d in examples[:num_examples]:
            logits = model(input_ids=torch.tensor([d.prompt_ids + d.response_ids])).logits[0]
            predicted = logits[len(d.prompt_ids) - 1 : -1].argmax(-1).tolist()
            ok, inside = True, False
            for t, m in enumerate([*d.response_mask, 0]):  # a run of target tokens is one answer
                if m:
                    inside, ok = True, ok and predicted[t] == d.response_ids[t]
                elif inside:
                    right, total, ok, inside = right + ok, total + 1, True, False
    return right / max(total, 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("world", type=int, help="the task world's seed (data.synthetic.seed)")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. sft.reading_mix=8")
    ap.add_argument("--config", default=str(REPO / "configs" / "demo.yaml"))
    ap.add_argument("--every", type=int, default=200, help="demonstration steps between measurements")
    ap.add_argument("--out", default=None, help="folder of the warm start (default: a temporary one)")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, [f"data.synthetic.seed={args.world}", "logging.progress=false", *args.overrides])
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix=f"copying-{args.world}-"))

    reading_stage = warmstart._reading_stage

    def measured_reading_stage(settings_, model, tokenizer, *, progress):
        summary = reading_stage(settings_, model, tokenizer, progress=progress)
        print(
            f"after the reading stage: reading accuracy {reading_accuracy(settings_, model, tokenizer):.3f}", flush=True
        )
        measured["model"], measured["tokenizer"] = model, tokenizer
        return summary

    measured: dict = {}
    settings = WarmStartSettings.from_config(cfg)
    questions = probe_questions(
        settings.worlds, settings.probe.questions, seed=world_seed(settings.worlds.task_seed, PROBE_WORLD_OFFSET)
    )
    run_sft = warmstart.run_sft

    def measured_run_sft(model, demos, pad_id, **kw):
        if kw.get("done") is None:  # the reading stage
            return run_sft(model, demos, pad_id, **kw)
        inner = kw["on_step"]

        def on_step(step, total, metrics):
            inner(step, total, metrics)
            if step % args.every == 0 and step < total:  # from sft.steps on the library probes itself
                result = run_probe(model, measured["tokenizer"], settings.probe, questions, step=step)
                accuracy = reading_accuracy(settings, model, measured["tokenizer"])
                model.train()
                print(f"{result.line()}; reading accuracy {accuracy:.3f}", flush=True)

        return run_sft(model, demos, pad_id, **{**kw, "on_step": on_step})

    # warm_start calls both through stratarl.trainer.warmstart.stages's names (run_sft for either stage).
    warmstart._reading_stage, warmstart.run_sft = measured_reading_stage, measured_run_sft
    started = time.perf_counter()
    try:
        summary = warmstart.warm_start(cfg, out, progress=False)
    except WarmStartFailed as error:
        print(f"FAILED after {time.perf_counter() - started:.0f}s: {error}", flush=True)
        return 1
    print(f"passed at step {summary['steps']} in {time.perf_counter() - started:.0f}s -> {out / 'model'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
