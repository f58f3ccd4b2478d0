"""The ``sft`` section: the warm start (demonstrations, reading pre-training, the reading probe, the cache)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from stratarl.config_errors import fail as _fail
from stratarl.config_tree import check_choices


@dataclass
class SFTConfig:
    enabled: bool = False
    """`stratarl train` first runs the warm-start stage (unless model.init_from is set or the run resumes)."""
    num_demos: int = 256
    """Demonstration trajectories rendered from the synthetic KB's training questions."""
    epochs: int = 1
    """Passes over the demonstrations."""
    lr: float = 1e-4
    """SFT learning rate (AdamW, linear warm-up over 5%, then `schedule`)."""
    schedule: Literal["constant", "cosine"] = "constant"
    """After warm-up: constant, or cosine (decays to 10% of lr at the last step; better for short runs)."""
    batch_size: int = 8
    """Demonstrations per optimizer step."""
    no_search_fraction: float = 0.2
    """Fraction of demonstrations that answer straight away without searching (imperfect on purpose)."""
    guess_on: Literal["any", "guessable"] = "any"
    """Which questions a no-search demonstration may guess on. `any`: every question, `no_search_fraction` of
    all demonstrations. `guessable`: only questions of a guessable family (a small answer set, such as a
    country), `no_search_fraction` of those; the others guess never and keep the other fractions' shares
    among the demonstrations that search. A warm start that guesses the shortcut questions often while it
    reads the rest (docs/lab.md)."""
    wrong_hop_fraction: float = 0.1
    """Fraction of multi-hop demonstrations whose last hop searches with a wrong query (imperfect on purpose)."""
    wrong_hop_pool: Literal["family", "any"] = "family"
    """Where a wrong last hop comes from. `family`: another question of the same family (the same relation about
    a wrong entity, so its answer is of the right type: a country for a country question). `any`: any other
    question (usually another relation, so the answer is rarely even of the right type)."""
    early_answer_fraction: float = 0.0
    """Fraction of multi-hop demonstrations that stop after their first search and answer what it found
    (the first hop's answer): a deliberately weak search policy that RL can improve by searching more."""
    open_fraction: float = 0.5
    """With `open` among rollout.tools: the share of a correct demonstration's later hops that open the previous
    hop's answer by title (a name the last observation showed) instead of searching, so the demonstrations show
    both tools (docs/training.md, "Warm start in another protocol")."""
    seed: int = 0
    """Seeds demonstration choice and order, and the initial weights of a from-scratch model."""
    source: Literal["task", "worlds"] = "task"
    """Where demonstrations come from. `task`: the task's own training questions (`num_demos`, `epochs`).
    `worlds`: a stream of freshly generated synthetic worlds drawn from the task's shared name pool
    (data.synthetic.options.name_pool), none of them the task's own world, so no fact repeats and the
    policy must learn to copy names from the passages it reads (`steps` x `batch_size` demos; docs/lab.md)."""
    steps: int = 0
    """`source: worlds`: optimizer steps (each on `batch_size` demonstrations never seen before)."""
    world_options: dict[str, Any] = field(default_factory=dict)
    """`source: worlds`: generator options of the demonstration worlds, layered over data.synthetic.options
    (e.g. `{size: 300, num_train: 150}`: small worlds are cheap to generate and index)."""
    reading_steps: int = 0
    """`source: worlds`: copy pre-training steps before the trajectories: an observation of a fresh world
    followed by every question about its first passage, loss on the answers only (docs/lab.md)."""
    reading_curriculum: int = 0
    """The first N reading steps shorten the observation to the sentence holding the answer, with
    probability 1 - step / N (a short context first: the tiny model finds what to copy sooner)."""
    reading_batch_size: int = 32
    """Reading examples per optimizer step."""
    reading_agent_fraction: float = 0.0
    """Share of reading examples laid out as the agent sees them: the question in the prompt, a search of
    it, the observation, the answer turn (``render_reading_examples``); the rest ask after the observation."""
    reading_mix: int = 0
    """`source: worlds`: reading examples (full observations, from worlds of their own) added to every
    demonstration batch, so the demonstrations do not erase the copying the reading stage taught."""
    observation_loss: float = 0.0
    """Weight of the next-token loss on observation (retrieved passage) tokens, relative to policy tokens.
    Passages repeat names (title, subject, relations), so this trains copying; the policy never emits them."""
    probe_every: int = 0
    """`source: worlds`: the reading probe (stratarl.trainer.warmstart.probe): greedy rollouts on single-hop and 2-hop
    questions of a world never trained on. 0: off (the warm start ends after `steps`). N > 0: probe after
    `steps`, and if single-hop EM is below `probe_min_em`, train N more steps and probe again, up to
    `max_steps`; a warm start that never passes stops the run with an error (it is not cached)."""
    probe_min_em: float = 0.6
    """Greedy single-hop EM on the probe world that the warm start must reach."""
    probe_questions: int = 40
    """Probe questions of each kind (single-hop, 2-hop)."""
    max_steps: int = 0
    """With the probe: the most demonstration steps before giving up (0: 3 x `steps`)."""
    cache: bool = False
    """Keep the warm start in `$STRATARL_CACHE/warmstart/<hash of what it depends on>` and reuse it in every
    run with the same model, data, retrieval, rollout caps and sft settings (seeds of RL runs share it);
    `stratarl sft CONFIG --rebuild` rebuilds it."""

    @property
    def step_limit(self) -> int:
        """The most demonstration steps with the probe: `max_steps`, or 3 x `steps` when it is 0."""
        return self.max_steps or 3 * self.steps

    def validate(self, p: str) -> None:
        check_choices(self, p)
        for key in ("num_demos", "epochs", "batch_size"):
            if getattr(self, key) < 1:
                _fail(f"{p}.{key}", getattr(self, key), "must be at least 1", "use a positive integer")
        if self.lr <= 0 or self.lr != self.lr or self.lr == float("inf"):
            _fail(f"{p}.lr", self.lr, "must be a positive finite number", "use 1e-4")
        for key in ("no_search_fraction", "wrong_hop_fraction", "early_answer_fraction", "open_fraction"):
            if not 0 <= getattr(self, key) <= 1:
                _fail(f"{p}.{key}", getattr(self, key), "a fraction must lie in [0, 1]", "use e.g. 0.1")
        total = self.no_search_fraction + self.wrong_hop_fraction + self.early_answer_fraction
        if total > 1:
            _fail(
                f"{p}.early_answer_fraction",
                self.early_answer_fraction,
                f"no_search + wrong_hop + early_answer fractions sum to {total:g} > 1",
                "lower them",
            )
        if self.steps < 0:
            _fail(f"{p}.steps", self.steps, "must be >= 0", "use e.g. 1000")
        if self.reading_steps < 0 or self.reading_curriculum < 0 or self.reading_batch_size < 1:
            _fail(
                f"{p}.reading_steps",
                (self.reading_steps, self.reading_curriculum, self.reading_batch_size),
                "reading_steps and reading_curriculum must be >= 0, reading_batch_size >= 1",
                "use e.g. 1000, 800, 32",
            )
        if not 0 <= self.reading_agent_fraction <= 1:
            _fail(
                f"{p}.reading_agent_fraction",
                self.reading_agent_fraction,
                "a fraction must lie in [0, 1]",
                "use e.g. 0.5",
            )
        if self.reading_mix < 0:
            _fail(f"{p}.reading_mix", self.reading_mix, "must be >= 0", "use 0 (off) or e.g. 8")
        if self.observation_loss < 0:
            _fail(
                f"{p}.observation_loss", self.observation_loss, "must be >= 0", "use 0 (policy tokens only) or e.g. 0.5"
            )
        if self.probe_every < 0 or self.max_steps < 0 or self.probe_questions < 1:
            _fail(
                f"{p}.probe_every",
                (self.probe_every, self.max_steps, self.probe_questions),
                "probe_every and max_steps must be >= 0, probe_questions >= 1",
                "use e.g. 20, 0, 40",
            )
        if not 0 <= self.probe_min_em <= 1:
            _fail(f"{p}.probe_min_em", self.probe_min_em, "an EM threshold lies in [0, 1]", "use e.g. 0.6")

    def validate_stage(self, p: str) -> None:
        """The checks of settings taken together, which only a warm start that runs needs (``Config.validate``
        calls it when ``sft.enabled``; ``stratarl sft`` through the warm start's settings always): an RL-only run
        keeps whatever sft section its base config has."""
        if self.source == "worlds" and self.steps < 1:
            _fail(
                f"{p}.steps",
                self.steps,
                "sft.source=worlds trains for `steps` optimizer steps",
                "set e.g. sft.steps=1000",
            )
        if self.reading_mix and self.source != "worlds":
            _fail(
                f"{p}.reading_mix",
                self.reading_mix,
                "rehearsal draws fresh worlds",
                "set sft.source=worlds or sft.reading_mix=0",
            )
        if self.reading_steps and self.source != "worlds":
            _fail(
                f"{p}.reading_steps",
                self.reading_steps,
                "reading pre-training draws fresh worlds",
                "set sft.source=worlds or sft.reading_steps=0",
            )
        if self.probe_every and self.source != "worlds":
            _fail(
                f"{p}.probe_every",
                self.probe_every,
                "the reading probe draws an unseen world",
                "set sft.source=worlds or sft.probe_every=0",
            )
        if self.max_steps and self.max_steps < self.steps:
            _fail(f"{p}.max_steps", self.max_steps, f"is below sft.steps={self.steps}", "use 0 (3 x steps) or raise it")
