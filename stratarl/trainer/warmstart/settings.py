"""What the warm start's stages read, resolved once from the config into small frozen values.

``WarmStartSettings.from_config(cfg)`` (``warm_start`` calls it once, as ``build_run`` resolves ``RunSettings``)
checks the sft section's settings taken together (``Config.check_warm_start``: also when ``sft.enabled`` is false,
since ``stratarl sft`` builds a warm start all the same) and copies the plain values the stages read. No stage reads
the config tree: the reading stage, the demonstrations, the fresh-world streams and the probe each get these.

    WarmStartSettings  the optimizer loop (lr, batches, steps, schedule), the demonstration source, progress
    WorldSettings      how fresh worlds are drawn: the task's seed and generator options, sft.world_options
    DemoStyle          how a demonstration is rendered: prompt, search depth, observation cap, imperfect-demo mix
    ReadingSettings    reading pre-training and its rehearsal (sft.reading_*)
    ProbeSettings      the reading probe: when, on how many questions, the bar, how it evaluates
    LoopSettings       what every ``run_sft`` call shares: seed, micro-batching, chunks, clipping, device policy
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from stratarl.evaluation.greedy import EvalSettings
from stratarl.infra.precision import DevicePolicy

if TYPE_CHECKING:
    from collections.abc import Mapping

    from stratarl.trainer.config import Config


def _fields(settings: Any) -> dict[str, Any]:
    """A settings value's fields by name, as keyword arguments (not copied, unlike ``dataclasses.asdict``)."""
    return {f.name: getattr(settings, f.name) for f in fields(settings)}


@dataclass(frozen=True)
class WorldSettings:
    """How the warm start's fresh worlds are drawn (demonstration, reading, rehearsal and probe worlds)."""

    task_seed: int
    """The task's knowledge-base seed (``data.synthetic.seed``): every world seed derives from it (``world_seed``)."""
    options: Mapping[str, Any]
    """The task's generator options (``data.synthetic.options``)."""
    world_options: Mapping[str, Any]
    """``sft.world_options``, layered over ``options``."""

    def generator_options(self, **overrides: Any) -> dict[str, Any]:
        """``generate_knowledge_base``'s keyword arguments: the task's options, ``world_options``, ``overrides``."""
        return {**self.options, **self.world_options, **overrides}


@dataclass(frozen=True)
class DemoStyle:
    """``render_demonstrations``'s keyword arguments that every demonstration source shares (``sft.source``: task
    or worlds): the prompt, the search depth, the observation cap, the imperfect-demo mix, and the protocol and
    tools the demonstrations are written in (``rollout.protocol``, ``rollout.tools``, ``rollout.tool_params``,
    ``sft.open_fraction``)."""

    topk: int
    max_obs_tokens: int
    no_search_fraction: float
    guess_on: str
    wrong_hop_pool: str
    wrong_hop_fraction: float
    early_answer_fraction: float
    prompt_template: str
    protocol: str = "search_r1"
    tools: tuple[str, ...] = ("search",)
    tool_params: Mapping[str, Any] = field(default_factory=dict)
    open_fraction: float = 0.5

    def kwargs(self) -> dict[str, Any]:
        return _fields(self)


@dataclass(frozen=True)
class ReadingSettings:
    """Reading pre-training (``sft.reading_steps`` steps of ``batch_size`` reading examples, observations shortened
    to a sentence over the first ``curriculum`` batches) and its rehearsal (``mix`` examples per demonstration
    batch); ``agent_fraction`` of reading examples are written as the agent's turns."""

    steps: int
    batch_size: int
    curriculum: int
    agent_fraction: float
    mix: int


@dataclass(frozen=True)
class ProbeSettings:
    """The reading probe: after ``sft.steps`` and every ``every`` steps after that (0: no probe), greedy rollouts
    on ``questions`` questions of each kind; it passes at single-hop EM ``min_em``. ``eval``: how its rollouts run
    (the run's rollout section, EM scoring, device); ``backend``: the generator the sampled rollouts use."""

    every: int
    questions: int
    min_em: float
    eval: EvalSettings
    backend: str


@dataclass(frozen=True)
class LoopSettings:
    """What every ``run_sft`` call of the warm start shares (``run_sft``'s keyword arguments of the same names)."""

    seed: int
    micro_batch_tokens: int
    chunk_tokens: int
    grad_clip: float
    policy: DevicePolicy

    def kwargs(self) -> dict[str, Any]:
        return _fields(self)


@dataclass(frozen=True)
class WarmStartSettings:
    """The warm start's settings (``sft.*`` unless said otherwise), resolved once."""

    seed: int
    source: str
    """``task``: the task's own training questions; ``worlds``: a stream of fresh worlds."""
    num_demos: int
    epochs: int
    batch_size: int
    lr: float
    schedule: str
    observation_loss: float
    steps: int
    """``source: worlds``: optimizer steps before the probe decides (``sft.steps``)."""
    step_limit: int
    """With the probe: the most demonstration steps (``sft.max_steps``, or 3 x ``steps``)."""
    progress: bool
    """Progress bars (``logging.progress``)."""
    tensorboard: bool
    """``logging.tensorboard``: sft_metrics also as TensorBoard events."""
    worlds: WorldSettings
    style: DemoStyle
    reading: ReadingSettings
    probe: ProbeSettings
    loop: LoopSettings

    @classmethod
    def from_config(cls, cfg: Config) -> WarmStartSettings:
        """Check the sft section taken together (``Config.check_warm_start``) and resolve it once."""
        from stratarl.trainer.setup import eval_settings  # the set-up imports the demonstrations' thoughts

        cfg.check_warm_start()
        s = cfg.sft
        return cls(
            seed=s.seed,
            source=s.source,
            num_demos=s.num_demos,
            epochs=s.epochs,
            batch_size=s.batch_size,
            lr=s.lr,
            schedule=s.schedule,
            observation_loss=s.observation_loss,
            steps=s.steps,
            step_limit=s.step_limit,
            progress=cfg.logging.progress,
            tensorboard=cfg.logging.tensorboard,
            worlds=WorldSettings(
                task_seed=cfg.data.synthetic.seed,
                options=MappingProxyType(dict(cfg.data.synthetic.options)),
                world_options=MappingProxyType(dict(s.world_options)),
            ),
            style=DemoStyle(
                topk=cfg.retrieval.topk,
                max_obs_tokens=cfg.rollout.max_obs_tokens,
                no_search_fraction=s.no_search_fraction,
                guess_on=s.guess_on,
                wrong_hop_pool=s.wrong_hop_pool,
                wrong_hop_fraction=s.wrong_hop_fraction,
                early_answer_fraction=s.early_answer_fraction,
                prompt_template=cfg.rollout.prompt_template,
                protocol=cfg.rollout.protocol,
                tools=tuple(cfg.rollout.tools),
                tool_params=MappingProxyType({k: dict(v) for k, v in cfg.rollout.tool_params.items()}),
                open_fraction=s.open_fraction,
            ),
            reading=ReadingSettings(
                steps=s.reading_steps,
                batch_size=s.reading_batch_size,
                curriculum=s.reading_curriculum,
                agent_fraction=s.reading_agent_fraction,
                mix=s.reading_mix,
            ),
            probe=ProbeSettings(
                every=s.probe_every,
                questions=s.probe_questions,
                min_em=s.probe_min_em,
                eval=eval_settings(cfg),
                backend=cfg.rollout.backend,
            ),
            loop=LoopSettings(
                seed=s.seed,
                micro_batch_tokens=cfg.trainer.micro_batch_tokens,
                chunk_tokens=cfg.trainer.logprob_chunk_tokens,
                grad_clip=cfg.optim.grad_clip,
                policy=cfg.device_policy,
            ),
        )
