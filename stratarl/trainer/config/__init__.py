"""One typed config tree for `stratarl train`, `sft` and `eval`.

Loaded from YAML, then dotted command-line overrides are applied
(``stratarl train configs/demo.yaml algo.name=grpo trainer.steps=20``), then older spellings are
rewritten (stratarl.trainer.config.legacy), then the whole tree is validated. Every error names the field
path, the bad value, why it is wrong and how to fix it. Unknown keys list the valid ones with a close-match
suggestion. The resolved tree is saved as ``config.yaml`` in the run directory.

Validation also checks that the algorithm resolves (stratarl.trainer.config.resolve), and gives the rollout section
its passages per search (``retrieval.topk``, the one place that sets it). The config stores nothing resolved:
``Config.algorithm`` and ``Config.device_policy`` (stratarl.infra.precision; it depends on the machine) are derived
from their sections on each read, so a copy (``dataclasses.replace``) cannot lose them. A run resolves both once,
into frozen values its step and update read (``stratarl.trainer.settings.RunSettings``; ``build_run`` does it
first, so bf16 on a GPU without it fails before any work).

The package: the root here (``Config``, ``load_config``, ``save_config``), the sections in ``sections``, ``algo``
and ``sft``, the older spellings in ``legacy`` and the algorithm's resolution in ``resolve``.

Defaults follow Search-R1 / the two papers (docs/algorithms.md) where they apply to any model size; the
shipped configs shrink sizes for CPU runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from stratarl.algos.presets import AlgorithmSpec
from stratarl.algos.registry import advantage_info
from stratarl.algos.sorl import DELTA_RULES as SORL_DELTA_RULES
from stratarl.config_errors import ConfigError, yaml_syntax_error
from stratarl.config_errors import fail as _fail
from stratarl.config_tree import apply_overrides, build, parse_override
from stratarl.infra.precision import DevicePolicy, policy_of
from stratarl.rollout.collect import named_tools
from stratarl.rollout.config import RolloutConfig
from stratarl.trainer.config.algo import ALGORITHMS, LOSS_AGGREGATIONS, SORL_ORDERS, AlgoConfig
from stratarl.trainer.config.legacy import rewrite_legacy
from stratarl.trainer.config.resolve import move_knob_params, resolve_algorithm
from stratarl.trainer.config.sections import (
    OPTIMIZERS,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    RetrievalConfig,
    SyntheticDataConfig,
    TrainerConfig,
)
from stratarl.trainer.config.sft import SFTConfig

__all__ = [
    "ALGORITHMS",
    "LOSS_AGGREGATIONS",
    "OPTIMIZERS",
    "SORL_DELTA_RULES",
    "SORL_ORDERS",
    "AlgoConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "RetrievalConfig",
    "SFTConfig",
    "SyntheticDataConfig",
    "TrainerConfig",
    "apply_overrides",
    "config_from_dict",
    "load_config",
    "parse_override",
    "save_config",
]

# Models whose tokenizer is SmolLM2's (ChatML: its end-of-sequence token is <|im_end|>).
CHATML_MODELS = ("smollm2-135m-instruct", "tiny-random")


@dataclass
class Config:
    """The whole tree. ``validate()`` checks every section and their combinations (``load_config`` and
    ``config_from_dict`` validate; a copy changed by ``dataclasses.replace`` is checked by ``validate()`` again).
    ``algorithm`` and ``device_policy`` are derived from their sections; nothing resolved is stored."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self) -> Config:
        self.algo = move_knob_params(self.algo)  # a knob's keyword inside algo.*_params: read as the knob
        for f in dataclasses.fields(self):
            sub = getattr(self, f.name)
            if hasattr(sub, "validate"):
                sub.validate(f.name)
        self._check_across_sections()
        if self.sft.enabled:  # a disabled warm start's settings taken together are not checked
            self.check_warm_start()
        self.rollout = self.rollout.replace(topk=self.retrieval.topk)  # retrieval.topk is the one place for it
        return self

    def check_warm_start(self) -> None:
        """The sft section's settings taken together, and what they need of the other sections: at load when
        ``sft.enabled``, else when a warm start is built all the same (``stratarl sft``: WarmStartSettings)."""
        self.sft.validate_stage("sft")
        if self.sft.source == "worlds":
            if self.data.source != "synthetic":
                _fail(
                    "sft.source",
                    "worlds",
                    "demonstration worlds are synthetic knowledge bases",
                    "use data.source=synthetic, or sft.source=task",
                )
            # A word-level vocabulary is built from the task: only a shared pool lets it spell other worlds'
            # names. A subword tokenizer spells any invented name, so every world may invent its own.
            if (
                self.model.name == "word-tiny"
                and not self.model.init_from
                and not {**self.data.synthetic.options, **self.sft.world_options}.get("name_pool")
            ):
                _fail(
                    "data.synthetic.options.name_pool",
                    None,
                    "sft.source=worlds with model.name=word-tiny needs a shared name pool (otherwise every "
                    "world invents words that the task's vocabulary does not know)",
                    "set e.g. data.synthetic.options.name_pool=2000",
                )

    @property
    def algorithm(self) -> AlgorithmSpec:
        """The resolved algorithm: its five parts and their complete keyword arguments (frozen), derived from the
        ``algo`` section on each read (a run reads it once: ``RunSettings``)."""
        return resolve_algorithm(self.algo)

    @property
    def device_policy(self) -> DevicePolicy:
        """Where the run computes and in what precision (``trainer.device``, ``trainer.precision``), derived on
        each read: it depends on the machine (a config written for a GPU loads on a laptop)."""
        return policy_of(self.trainer)

    def _check_across_sections(self) -> None:
        if self.rollout.greedy:
            _fail(
                "rollout.greedy",
                True,
                "training rollouts sample (eval is always greedy)",
                "drop rollout.greedy, or lower rollout.temperature",
            )
        rollouts = self.trainer.prompts_per_step * self.rollout.group_size
        if self.trainer.mini_batches > rollouts:
            _fail(
                "trainer.mini_batches",
                self.trainer.mini_batches,
                f"a step has only prompts_per_step x group_size = {self.trainer.prompts_per_step} x "
                f"{self.rollout.group_size} = {rollouts} rollouts to cut into mini-batches",
                f"use trainer.mini_batches <= {rollouts}, or raise trainer.prompts_per_step / rollout.group_size",
            )
        if self.model.name == "word-tiny" and (
            self.rollout.protocol != "search_r1" or self.rollout.tools != ["search"]
        ):
            _fail(
                "rollout.protocol" if self.rollout.protocol != "search_r1" else "rollout.tools",
                self.rollout.protocol if self.rollout.protocol != "search_r1" else self.rollout.tools,
                "model.name=word-tiny's vocabulary holds the words of the search_r1 protocol with its search tool only",
                "use a subword tokenizer's model (tiny-random, smollm2-135m-instruct), or rollout.protocol=search_r1 "
                "with rollout.tools=[search]",
            )
        if self.sft.enabled:
            self._check_warm_start_protocol()
        counted = named_tools(self.algo.stratum_key) or []
        missing = [t for t in counted if t not in self.rollout.tools]
        if missing:
            _fail(
                "algo.stratum_key",
                self.algo.stratum_key,
                f"counts calls of {', '.join(missing)}, which rollout.tools ({', '.join(self.rollout.tools)}) lacks",
                "name tools of rollout.tools, or add the tool there",
            )
        spec = resolve_algorithm(self.algo)  # an algorithm that does not resolve fails here, naming the field
        if self.rollout.group_size < 2 and advantage_info(spec.advantage).group_relative:
            _fail(
                "rollout.group_size",
                self.rollout.group_size,
                f"advantage estimator {spec.advantage!r} compares the rollouts of one prompt, so a group of one "
                "rollout gets advantage 0 and the policy never moves",
                "use rollout.group_size >= 2 (Search-R1: 5), or an estimator with a critic (algo.name=ppo)",
            )

    def _check_warm_start_protocol(self) -> None:
        """The warm start writes its demonstrations in the run's protocol (stratarl.trainer.warmstart.render); a
        protocol whose call turn ends with the model's EOS (llama3_json) needs that EOS to open the tool turn,
        which the bundled ChatML tokenizers' does not."""
        tokenizer = self.model.tokenizer or self.model.name
        if self.rollout.tool_protocol().call_ends_with_eos and tokenizer in CHATML_MODELS:
            _fail(
                "rollout.protocol",
                self.rollout.protocol,
                f"the warm start cannot show the end of a {self.rollout.protocol} call turn with {tokenizer}'s "
                "tokenizer (its end-of-sequence token is not the one that opens that protocol's tool turn)",
                "use rollout.protocol=hermes (ChatML, as SmolLM2 speaks it), or sft.enabled=false",
            )

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["rollout"].pop("topk")  # retrieval.topk is the one place for it (see validate)
        return data


# --------------------------------------------------------------------------- loading


def config_from_dict(data: dict, overrides: list[str] | None = None) -> Config:
    """Build and validate a Config from a (YAML-shaped) dict plus dotted overrides."""
    if not isinstance(data, dict):
        raise ConfigError(
            f"a config must be a mapping of sections, got {type(data).__name__}. Fix: start the file with e.g. `trainer:`."
        )
    data = rewrite_legacy(apply_overrides(data, overrides or []))
    rollout = data.get("rollout")
    if isinstance(rollout, dict) and "topk" in rollout:
        raise ConfigError(
            f"config field `rollout.topk` = {rollout['topk']!r}: passages per search are set once, in "
            "`retrieval.topk`. Fix: write retrieval.topk instead."
        )
    return build(Config, data).validate()


class _DuplicateKey(yaml.YAMLError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                first = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: let SafeLoader report it
                continue
            if first != key_node.start_mark.line + 1:
                raise _DuplicateKey(
                    f"key `{key}` appears twice (lines {first} and {key_node.start_mark.line + 1}); "
                    "the second would silently replace the first. Fix: merge them into one"
                )
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config file (or the defaults when ``path`` is None), apply overrides, validate."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} not found. Fix: pass a path such as configs/demo.yaml.")
        try:
            data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}  # noqa: S506  a SafeLoader
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"config file {str(path)!r} is not UTF-8 text (byte {e.start} cannot be decoded). "
                "Fix: pass a YAML config such as configs/demo.yaml."
            ) from None
        except _DuplicateKey as e:
            raise ConfigError(f"config file {str(path)!r}: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {yaml_syntax_error(path, e)}") from None
        if not isinstance(data, dict):
            raise ConfigError(
                f"config file {str(path)!r} must be a mapping of sections. Fix: start it with e.g. `trainer:`."
            )
    try:
        return config_from_dict(data, overrides)
    except ConfigError as e:
        where = f" (in {path})" if path is not None else ""
        raise ConfigError(f"{e}{where}") from None


def save_config(config: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (loadable by `load_config`)."""
    Path(path).write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
