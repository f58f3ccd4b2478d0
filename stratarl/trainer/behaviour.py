"""The behaviour policy: the weights and numerics that sample a step's rollouts, apart from the learner's.

Two sources make real training off-policy, and a run can have either or both (docs/training.md,
Off-policy training):

- **Stale weights** (``trainer.policy_lag`` k). The batch trained at RL step s is sampled with the weights of
  step s − ℓ: ℓ = min(k, s) (``policy_lag_mode: fixed``), or ℓ drawn uniformly from 0..min(k, s)
  (``uniform``, as a bounded-staleness asynchronous pipeline: AReaL's ``max_head_offpolicyness``, veRL's
  ``staleness_threshold``). The draw is seeded by ``trainer.seed`` and the step, so a resumed run draws the
  same lags. A weights *version* is the number of RL steps (rollout batches) the learner had trained when
  those weights were current; with one optimizer step per batch it is the optimizer step.
- **Sampler numerics** (``rollout.precision``): the sampler runs in fp32, bf16 (autocast; on a CPU the fast
  decoder's bf16 weight copies) or with int8 fake-quantised weights (per output channel, symmetric, fp32
  compute), while the learner keeps ``trainer.precision``.

Snapshots hold the trainable parameters only: frozen layers never change, so the frozen prefix stays valid
across versions, and the sampler copy shares the learner's frozen parameters (fp32 / bf16 samplers; an int8
sampler keeps its own quantised copy of them, made once). With neither source (k = 0 and no
``rollout.precision``) there is no copy and no snapshot: the learner samples, as it always did.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from stratarl.config_errors import ConfigError
from stratarl.infra.checkpoint import CheckpointError
from stratarl.infra.precision import DevicePolicy, Precision

LAG_MODES = ("fixed", "uniform")


class LagResumeError(ConfigError):
    """A resume whose checkpoint cannot reproduce the run's policy lags (`BehaviourPolicy.resume_problem`)."""


def lag_for_step(max_lag: int, mode: str, seed: int, step: int) -> int:
    """The lag ℓ of RL step ``step`` (0-based): ``fixed`` min(k, step); ``uniform`` a draw from 0..min(k, step),
    seeded by (``seed``, ``step``) alone. Never above k, never above the versions that exist."""
    if max_lag < 0:
        raise ValueError(f"policy lag must be >= 0, got {max_lag}")
    bound = min(max_lag, step)
    if mode == "fixed" or bound == 0:
        return bound
    if mode != "uniform":
        raise ValueError(f"unknown policy_lag_mode {mode!r}; use one of {', '.join(LAG_MODES)}")
    generator = torch.Generator().manual_seed(seed * 1_000_003 + 7_919 * step + 17)
    return int(torch.randint(0, bound + 1, (1,), generator=generator))


@torch.no_grad()
def fake_quantize_int8(weight: torch.Tensor) -> torch.Tensor:
    """Symmetric per-output-channel int8 fake quantisation of a 2-D weight [out, in]:

        s_o = max_i |W_oi| / 127,   Q(W)_oi = s_o · clamp(round(W_oi / s_o), −127, 127)

    (a row of zeros stays zero). Returned in the weight's dtype: the int8 grid, computed in fp32 (weight-only
    quantisation as int8 inference engines apply it, e.g. LLM.int8's weight grid without outliers)."""
    if weight.dim() != 2:
        raise ValueError(f"fake_quantize_int8 takes a 2-D weight [out, in], got shape {tuple(weight.shape)}")
    scale = weight.abs().amax(dim=1, keepdim=True) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.clamp(torch.round(weight / safe), -127, 127) * safe).to(weight.dtype)


def quantizable_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The 2-D weights an int8 sampler quantises, by name: every ``nn.Linear`` and ``nn.Embedding`` weight (a
    tied LM head is its embedding, listed once)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            out[f"{module_name}.weight" if module_name else "weight"] = module.weight
    return out


@dataclass
class PolicySnapshots:
    """Copies of the trainable parameters by version (the learner's ``policy_parameters`` order)."""

    weights: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    def push(self, version: int, params: list[torch.Tensor]) -> None:
        """Keep a detached copy of ``params`` as ``version`` (replacing one of the same version)."""
        self.weights[version] = [p.detach().clone() for p in params]

    def keep_from(self, version: int) -> None:
        """Drop every version older than ``version``."""
        for old in [v for v in self.weights if v < version]:
            del self.weights[old]

    def keep_until(self, version: int) -> None:
        """Drop every version newer than ``version`` (a restore to an earlier step)."""
        for new in [v for v in self.weights if v > version]:
            del self.weights[new]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.weights.values() for t in ts)

    def state_dict(self) -> dict:
        versions = sorted(self.weights)
        return {"versions": versions, "weights": [self.weights[v] for v in versions]}

    def load_state_dict(self, state: dict) -> None:
        self.weights = {int(v): [t.clone() for t in ts] for v, ts in zip(state["versions"], state["weights"])}


def sampler_copy(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """A copy of ``model`` to sample with: no parameter requires grad; for fp32 / bf16 it shares the frozen
    parameters with ``model`` (they never change); for int8 every quantisable weight is its own fake-quantised
    copy (``refresh_sampler`` re-quantises the trainable ones after each load)."""
    memo: dict[int, torch.Tensor] = {}
    if precision != "int8":
        memo = {id(p): p for p in model.parameters() if not p.requires_grad}
    sampler = copy.deepcopy(model, memo)
    sampler.eval()
    for p in sampler.parameters():
        p.requires_grad_(False)
    if precision == "int8":
        for weight in quantizable_weights(sampler).values():
            weight.copy_(fake_quantize_int8(weight))
    return sampler


@dataclass
class BehaviourPolicy:
    """The sampler of a run with an off-policy source: a copy of the policy, loaded before each step's
    collection with the trainable weights of version s − ℓ, in ``precision``.

    ``trainable``: the names of the learner's trainable parameters (the snapshot order); ``policy``: the
    device policy the sampler's generator runs under."""

    learner: torch.nn.Module
    sampler: torch.nn.Module
    precision: str
    policy: DevicePolicy
    max_lag: int
    mode: str
    seed: int
    trainable: list[str]
    snapshots: PolicySnapshots = field(default_factory=PolicySnapshots)
    quantized: frozenset[str] = frozenset()
    """The names of the weights an int8 sampler keeps fake-quantised (``quantizable_weights``); empty otherwise."""

    @classmethod
    def create(
        cls,
        learner: torch.nn.Module,
        *,
        precision: str | None,
        learner_policy: DevicePolicy,
        max_lag: int,
        mode: str,
        seed: int,
    ) -> BehaviourPolicy:
        """``precision`` None: the learner's numerics (``learner_policy``); else fp32, bf16 or int8."""
        numerics = learner_policy.precision if precision is None else precision
        compute: Precision = "bf16" if numerics == "bf16" else "fp32"
        trainable = [name for name, p in learner.named_parameters() if p.requires_grad]
        sampler = sampler_copy(learner, numerics)
        quantized = frozenset(quantizable_weights(sampler)) if numerics == "int8" else frozenset()
        return cls(
            learner,
            sampler,
            numerics,
            DevicePolicy(learner_policy.device, compute),
            max_lag,
            mode,
            seed,
            trainable,
            quantized=quantized,
        )

    def same_numerics(self, learner_policy: DevicePolicy) -> bool:
        """Whether the sampler computes as the learner does (then its captured frozen states are the
        learner's frozen prefix: the frozen parameters are shared)."""
        return self.precision != "int8" and self.policy.precision == learner_policy.precision

    def _live(self) -> list[torch.Tensor]:
        named = dict(self.learner.named_parameters())
        return [named[name] for name in self.trainable]

    @torch.no_grad()
    def prepare(self, step: int) -> tuple[int, int]:
        """Before step ``step``'s collection: keep the live weights as version ``step``, drop versions no step
        can use any more, load version step − ℓ into the sampler. Returns (version, ℓ)."""
        lag = lag_for_step(self.max_lag, self.mode, self.seed, step)
        if self.max_lag > 0:
            self.snapshots.push(step, self._live())
            self.snapshots.keep_from(step - self.max_lag)
        version = step - lag
        if self.max_lag > 0:
            # After a restore past steps that took no update (retrieval faults), an older version may be gone:
            # the nearest newer one is used, so the lag only shrinks and the bound holds.
            version = min(v for v in self.snapshots.weights if v >= version)
        weights = self.snapshots.weights[version] if self.max_lag > 0 else self._live()
        named = dict(self.sampler.named_parameters())
        for name, value in zip(self.trainable, weights):
            named[name].copy_(fake_quantize_int8(value) if name in self.quantized else value)
        return version, step - version

    def needed_versions(self, step: int) -> list[int]:
        """The versions the steps after a checkpoint at ``step`` may sample with: max(0, step − k) .. step − 1
        (version ``step`` is the live weights)."""
        return list(range(max(0, step - self.max_lag), step)) if self.max_lag > 0 else []

    def state_dict(self, step: int | None = None) -> dict:
        """The snapshots, with the lag settings they were kept for; a checkpoint of ``step`` also lists the
        versions it lacks by design (``shortened``: dropped before a restore past steps without an update)."""
        state = {**self.snapshots.state_dict(), "max_lag": self.max_lag, "mode": self.mode}
        if step is not None:
            state["shortened"] = [v for v in self.needed_versions(step) if v not in self.snapshots.weights]
        return state

    def resume_problem(self, state: dict | None, step: int) -> str | None:
        """Why a checkpoint at ``step`` with behaviour state ``state`` (None: it has none) cannot reproduce this
        run's lags: another ``trainer.policy_lag`` / ``policy_lag_mode``, or missing weight snapshots. None
        when it can."""
        if step == 0:  # nothing was sampled yet: the run from here is a run with this lag
            return None
        if state is None:
            if self.max_lag > 0:
                return (
                    f"the checkpoint holds no weight snapshots (its run had trainer.policy_lag 0), but this run has "
                    f"trainer.policy_lag {self.max_lag}: steps {step}..{step + self.max_lag - 1} would sample with "
                    "shorter lags"
                )
            return None
        saved_lag, saved_mode = state.get("max_lag"), state.get("mode")
        if saved_lag is not None and (int(saved_lag), saved_mode) != (self.max_lag, self.mode):
            return (
                f"the checkpoint was written with trainer.policy_lag {saved_lag} ({saved_mode}), this run has "
                f"{self.max_lag} ({self.mode}): the lags after step {step} would differ from the run's"
            )
        have = {int(v) for v in state.get("versions", [])}
        missing = [v for v in self.needed_versions(step) if v not in have and v not in state.get("shortened", [])]
        if missing:
            return (
                f"the checkpoint lacks the weight snapshots of versions {missing} that trainer.policy_lag "
                f"{self.max_lag} needs after step {step}: those steps would sample with shorter lags"
            )
        return None

    def check_shapes(self, state: dict, where: str) -> None:
        """A `CheckpointError` (so a resume falls back to the previous checkpoint) when a snapshot does not fit
        the learner's trainable parameters (count or shapes)."""
        live = self._live()
        versions, weights = state.get("versions"), state.get("weights")
        if not isinstance(versions, list) or not isinstance(weights, list) or len(versions) != len(weights):
            raise CheckpointError(f"{where}: its weight snapshots are damaged (versions and weights do not pair up)")
        for version, tensors in zip(versions, weights):
            if not isinstance(tensors, list) or len(tensors) != len(live):
                raise CheckpointError(
                    f"{where}: the weight snapshot of version {version} does not hold the {len(live)} trainable "
                    "parameters of this model"
                )
            for name, tensor, param in zip(self.trainable, tensors, live):
                if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != tuple(param.shape):
                    shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                    raise CheckpointError(
                        f"{where}: the weight snapshot of version {version} has {name} of shape {shape}, the model's "
                        f"is {tuple(param.shape)}"
                    )

    def load_state_dict(self, state: dict, step: int) -> None:
        """Restore the snapshots of a checkpoint taken at ``step`` (newer versions, if any, are dropped)."""
        self.snapshots.load_state_dict(state)
        self.snapshots.keep_until(step)
