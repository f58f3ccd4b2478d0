"""SORL's step on one and on two FSDP2 data-parallel ranks (gloo, CPU), on the same global batch.

    PYTHONPATH=tests/verl python -m harness.dp_check --workdir /tmp/verl-dp [--ranks 2]

veRL's own actor worker (``ActorRolloutRefWorker``, role ``actor``: FSDP2 engine, ``ppo_loss``, its
mini-batch loop) with stratarl's ``SORLTrainingWorker`` installed as the plugins install it, started in
plain processes with a gloo process group, as Ray starts them (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``); the config is veRL's ``ppo_trainer`` with the multi-turn smoke's overrides
(:func:`harness.smoke_multiturn.main_ppo_overrides`), the optimizer set to SGD without
weight decay so that a parameter update is the gradient times the learning rate and two runs can be compared
element by element (Adam's first step is ±lr wherever a gradient is not exactly 0, which turns float noise
into full-size differences).

The batch: 2 prompts × 6 multi-turn rollouts of the smoke's tiny policy (0–3 search rounds: the hermes
call, the tool response masked out, then an answer), rewards 1 for Paris; advantages from veRL's own
``compute_advantage`` with ``stratified_grpo`` over the whole batch (as the driver does); old log-probs the
model's own, moved by ±0.01 per token so that both mini-batches clip (clip range 0.001; ‖C‖ > 0 in each).
The run with N ranks hands rank r veRL's ``chunk_tensordict`` chunk r of the batch, ordered so that each
optimizer step (mini-batch) covers the same global rows as in the one-rank run.

Writes ``<workdir>/world<N>_rank<r>.json`` (‖C‖, scale, grad norm per SORL step; digest of the full
parameters after the update) and ``<workdir>/params_world<N>.pt`` (rank 0); prints one line per rank and
the comparison. See docs/verl.md, "Several data-parallel ranks".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness import smoke, smoke_multiturn
from harness.agent_model import TOOL_CALL, build_agent_model
from stratarl.algos import STRATIFIED_ALPHA, stratified_advantages

GROUP_SIZE = 6
PROMPT_LENGTH = 16
RESPONSE_LENGTH = 64
OLD_LOGPROB_SHIFT = 0.01
# (tool rounds, answer) per rollout of each prompt group: several strata per group, rewards mixed.
ROLLOUTS = [
    [(0, "Paris"), (0, "Rome"), (1, "Paris"), (1, "Rome"), (2, "Paris"), (3, "Rome")],
    [(0, "Rome"), (1, "Paris"), (1, "Paris"), (2, "Rome"), (2, "Paris"), (0, "Paris")],
]
QUESTIONS = ["What is the capital of France ?", "Which city is the capital of France ?"]
TOOL_RESPONSE = ["<|im_end|>", "<|im_start|>", "tool", "France", "is", "<|im_end|>", "<|im_start|>", "assistant"]


def build_batch(model_dir: Path):
    """The global batch (padded, veRL's legacy layout) and what the driver computed for it."""
    import numpy as np  # start-up cost: the check only
    import torch  # start-up cost: the check only
    from omegaconf import OmegaConf  # veRL: only in .venv-verl
    from transformers import AutoModelForCausalLM, AutoTokenizer  # start-up cost: the check only
    from verl import DataProto  # veRL: only in .venv-verl
    from verl.trainer.ppo.ray_trainer import compute_advantage  # veRL: only in .venv-verl

    import stratarl.integrations.verl  # noqa: F401  (registers stratified_grpo)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer.convert_tokens_to_ids
    pad = tokenizer.pad_token_id
    rows: list[tuple[Any, Any, list[int]]] = []  # (prompt ids, response ids, mask); the tokenizer's ids are untyped
    uids, rewards, strata = [], [], []
    for g, (question, rollouts) in enumerate(zip(QUESTIONS, ROLLOUTS)):
        prompt = ["<|im_start|>", "user", "Question:", *question.split(), "<|im_end|>", "<|im_start|>", "assistant"]
        for rounds, answer in rollouts:
            tokens, mask = [], []
            for _ in range(rounds):
                tokens += TOOL_CALL
                mask += [1] * len(TOOL_CALL)
                tokens += TOOL_RESPONSE
                mask += [0] * len(TOOL_RESPONSE)
            answer_tokens = ["<answer>", answer, "</answer>", "<|im_end|>"]
            tokens += answer_tokens
            mask += [1] * len(answer_tokens)
            rows.append((ids(prompt), ids(tokens), mask))
            uids.append(f"group-{g}")
            rewards.append(1.0 if answer == "Paris" else 0.0)
            strata.append(rounds)
    batch = len(rows)
    prompts = torch.full((batch, PROMPT_LENGTH), pad, dtype=torch.long)
    responses = torch.full((batch, RESPONSE_LENGTH), pad, dtype=torch.long)
    attention = torch.zeros(batch, PROMPT_LENGTH + RESPONSE_LENGTH, dtype=torch.long)
    response_mask = torch.zeros(batch, RESPONSE_LENGTH, dtype=torch.long)
    for b, (prompt_ids, response_ids, mask_row) in enumerate(rows):
        prompts[b, PROMPT_LENGTH - len(prompt_ids) :] = torch.tensor(prompt_ids)  # left padded
        responses[b, : len(response_ids)] = torch.tensor(response_ids)  # right padded
        attention[b, PROMPT_LENGTH - len(prompt_ids) : PROMPT_LENGTH + len(response_ids)] = 1
        response_mask[b, : len(mask_row)] = torch.tensor(mask_row)
    input_ids = torch.cat([prompts, responses], dim=1)
    position_ids = (attention.cumsum(dim=1) - 1).clamp(min=0) * attention

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention, position_ids=position_ids).logits
    logp = torch.log_softmax(logits[:, PROMPT_LENGTH - 1 : -1].float(), dim=-1)
    logp = logp.gather(-1, responses[..., None]).squeeze(-1)
    sign = torch.where(torch.arange(RESPONSE_LENGTH) % 2 == 0, 1.0, -1.0)
    old_log_probs = (logp + OLD_LOGPROB_SHIFT * sign) * response_mask

    scores = torch.zeros(batch, RESPONSE_LENGTH)
    for b in range(batch):
        scores[b, int(response_mask[b].nonzero().max())] = rewards[b]
    data = DataProto.from_dict(
        tensors={"token_level_rewards": scores, "response_mask": response_mask.float()},
        non_tensors={"uid": np.array(uids, dtype=object)},
    )
    algorithm = OmegaConf.create(
        {
            "adv_estimator": "stratified_grpo",
            "norm_adv_by_std_in_grpo": True,
            "stratified_grpo": {"eps": smoke.STRATIFIED_EPS},
        }
    )
    advantages = compute_advantage(data, adv_estimator="stratified_grpo", config=algorithm).batch["advantages"]
    expected = stratified_advantages(
        torch.tensor(rewards),
        torch.tensor([int(u[-1]) for u in uids]),
        torch.tensor(strata),
        alpha=STRATIFIED_ALPHA,
        eps=smoke.STRATIFIED_EPS,
        std_ddof=1,
    )
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": input_ids,
        "attention_mask": attention,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "old_log_probs": old_log_probs,
        "advantages": advantages,
        "rewards": torch.tensor(rewards),
        "strata": torch.tensor(strata),
        "expected_advantages": expected,
    }


def rank_order(batch_size: int, world: int, mini_batches: int) -> list[int]:
    """Global row order whose ``world`` contiguous chunks give every optimizer step the same global rows.

    One rank takes mini-batch k = rows [k·M, (k+1)·M) (M = batch / mini_batches). With ``world`` ranks,
    rank r takes its k-th mini-batch from the front of its chunk, so its chunk must be the r-th slice of
    every global mini-batch, in order.
    """
    per_mini = batch_size // mini_batches
    per_rank = per_mini // world
    order: list[int] = []
    for r in range(world):
        for k in range(mini_batches):
            start = k * per_mini + r * per_rank
            order.extend(range(start, start + per_rank))
    return order


def worker_overrides(workdir: Path, world: int) -> list[str]:
    """veRL's ppo_trainer overrides for the actor: the multi-turn smoke's, with SGD and this world size."""

    base = smoke_multiturn.main_ppo_overrides(workdir, "http://127.0.0.1:1", trainer="v1", n_ranks=world)
    return smoke.with_overrides(
        base,
        [
            f"actor_rollout_ref.model.path={workdir / 'model'}",
            "actor_rollout_ref.actor.optim.optimizer=SGD",
            "actor_rollout_ref.actor.optim.weight_decay=0.0",
            # The same micro-batches of 3 rows in every world size (the rank split is the only difference).
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={GROUP_SIZE // 2}",
            f"data.max_prompt_length={PROMPT_LENGTH}",
            f"data.max_response_length={RESPONSE_LENGTH}",
        ],
    )


def run_worker(workdir: Path, rank: int, world: int) -> None:
    """One rank: veRL's actor worker with SORL, one update_actor call on its chunk of the batch."""
    import torch  # start-up cost: the check only
    import verl.trainer.config  # veRL: only in .venv-verl
    from hydra import compose, initialize_config_dir  # veRL: only in .venv-verl
    from verl import DataProto  # veRL: only in .venv-verl
    from verl.utils import tensordict_utils as tu  # veRL: only in .venv-verl
    from verl.workers.engine_workers import ActorRolloutRefWorker  # veRL: only in .venv-verl
    from verl.workers.utils.padding import left_right_2_no_padding  # veRL: only in .venv-verl

    from stratarl.integrations.verl import worker as sorl_worker  # veRL: only in .venv-verl (the worker imports it)

    if ActorRolloutRefWorker.actor_worker_cls is not sorl_worker.SORLTrainingWorker:
        raise RuntimeError(f"the plugins did not install SORLTrainingWorker: {ActorRolloutRefWorker.actor_worker_cls}")
    config_dir = Path(verl.trainer.config.__file__).parent
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=worker_overrides(workdir, world))
    actor = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
    actor.init_model()

    saved = torch.load(workdir / "batch.pt")
    batch_size = saved["prompts"].shape[0]
    mini_rows = cfg.actor_rollout_ref.actor.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n
    order = rank_order(batch_size, world, batch_size // mini_rows)
    keys = [
        "prompts",
        "responses",
        "input_ids",
        "attention_mask",
        "position_ids",
        "response_mask",
        "old_log_probs",
        "advantages",
    ]
    data = DataProto.from_dict(tensors={k: saved[k][order] for k in keys})
    data.meta_info.update(multi_turn=True, temperature=cfg.actor_rollout_ref.rollout.temperature)
    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(
        td,
        calculate_entropy=False,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=mini_rows,
        mini_batch_size=mini_rows,
        epochs=1,
        seed=cfg.actor_rollout_ref.actor.data_loader_seed,
        dataloader_kwargs={"shuffle": False},
        compute_loss=True,
    )
    chunk = tu.chunk_tensordict(td, world)[rank]  # what veRL's dispatch hands data-parallel rank `rank`
    actor.update_actor(chunk)

    params = sorl_worker.full_parameters(actor.actor.engine.module)  # a collective: every rank calls it
    digest = hashlib.sha256()
    for name, tensor in params:
        digest.update(name.encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    if rank == 0:
        torch.save(dict(params), workdir / f"params_world{world}.pt")
    steps = [json.loads(line) for line in (workdir / f"sorl_world{world}.jsonl").read_text().splitlines()]
    mine = [s for s in steps if s["rank"] == rank]
    (workdir / f"world{world}_rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "world": world,
                "rows": [order[i] for i in range(rank * len(order) // world, (rank + 1) * len(order) // world)],
                "c_norm": [s["c_norm"] for s in mine],
                "scale": [s["scale"] for s in mine],
                "grad_norm": [s["grad_norm"] for s in mine],
                "params_sha": digest.hexdigest(),
            }
        )
    )
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def launch(workdir: Path, world: int, timeout_s: float = 600) -> list[dict]:
    """Start ``world`` rank processes (gloo on 127.0.0.1) and return their records."""
    port = smoke_multiturn.free_port()
    (workdir / f"sorl_world{world}.jsonl").unlink(missing_ok=True)
    processes = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "VERL_USE_EXTERNAL_MODULES": smoke.PLUGINS,
            "VERL_PLATFORM": "stratarl_cpu",
            "PYTHONPATH": smoke.pythonpath(),
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
            "STRATARL_VERL_SORL_DUMP": str(workdir / f"sorl_world{world}.jsonl"),
        }
        command = [
            sys.executable,
            "-m",
            "harness.dp_check",
            "--workdir",
            str(workdir),
            "--worker-rank",
            str(rank),
            "--world",
            str(world),
        ]
        # The child holds its own copy of the log's descriptor, so ours can close once it has started.
        with open(workdir / f"world{world}_rank{rank}.log", "w") as log:
            processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    codes = []
    for process in processes:
        try:
            codes.append(process.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for p in processes:
                p.kill()
            raise
    if any(codes):
        tails = [(workdir / f"world{world}_rank{r}.log").read_text()[-3000:] for r in range(world)]
        raise RuntimeError(f"world {world}: rank exit codes {codes}\n" + "\n".join(tails))
    return [json.loads((workdir / f"world{world}_rank{r}.json").read_text()) for r in range(world)]


def compare(workdir: Path, ranks: int) -> dict:
    """Run the one-rank and the ``ranks``-rank update on the same batch; return both and their differences."""
    import torch  # start-up cost: the check only

    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    build_model_dir = build_agent_model(workdir / "model")
    batch = build_batch(build_model_dir)
    torch.save(batch, workdir / "batch.pt")
    single = launch(workdir, 1)
    several = launch(workdir, ranks)
    one = torch.load(workdir / "params_world1.pt")
    many = torch.load(workdir / f"params_world{ranks}.pt")
    initial = build_model_dir  # parameters moved at all: compare with the saved initial model
    from safetensors.torch import load_file  # start-up cost: the check only

    start = load_file(str(initial / "model.safetensors"))
    moved = max(float((one[name] - start[name]).abs().max()) for name in one if name in start)
    return {
        "single": single,
        "several": several,
        "param_max_abs_diff": max(float((one[name] - many[name]).abs().max()) for name in one),
        "param_max_abs_update": moved,
        "advantages_max_abs_diff": float(
            (batch["advantages"].sum(-1) / batch["response_mask"].sum(-1) - batch["expected_advantages"]).abs().max()
        ),
    }


def report(result: dict) -> str:
    lines = [
        f"world {record['world']} rank {record['rank']}: rows {record['rows']}; ‖C‖ per step "
        f"{[round(c, 6) for c in record['c_norm']]}, scale {[round(s, 4) for s in record['scale']]}, "
        f"grad norm {[round(g, 6) for g in record['grad_norm']]}, params sha {record['params_sha'][:12]}"
        for record in result["single"] + result["several"]
    ]
    lines.append(
        f"max |θ(world {result['several'][0]['world']}) − θ(world 1)| after the update: "
        f"{result['param_max_abs_diff']:.3g} (largest update {result['param_max_abs_update']:.3g}); "
        f"advantages vs stratified_advantages over the whole batch: max diff "
        f"{result['advantages_max_abs_diff']:.3g}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--ranks", type=int, default=2, help="data-parallel ranks to compare with one (default 2)")
    parser.add_argument("--worker-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker_rank is not None:
        run_worker(args.workdir.resolve(), args.worker_rank, args.world)
        return 0
    result = compare(args.workdir, args.ranks)
    (args.workdir / "result.json").write_text(json.dumps(result, indent=1))
    print(report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
