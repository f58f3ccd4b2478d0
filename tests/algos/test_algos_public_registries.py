"""Every registry of stratarl.algos is public at the package root with its three functions (register, get,
names), the gradient normaliser's too (README: `register_grad_normalizer` works like the others): a part
registered through ``stratarl.algos`` is one a config can name."""

from __future__ import annotations

from pathlib import Path

import pytest

import stratarl.algos as algos
from stratarl.algos import registry
from stratarl.config_errors import ConfigError
from stratarl.trainer.config import load_config

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
NAME = "i57_test_scaled_normalizer"


@pytest.mark.parametrize(
    "kind", ["advantage", "policy_loss", "grad_normalizer", "behaviour_correction"], ids=lambda k: k
)
def test_each_registry_is_exported_from_the_package_root(kind):
    for name in (f"register_{kind}", f"get_{kind}", f"{kind}_names"):
        assert name in algos.__all__ and getattr(algos, name) is getattr(registry, name), name


@pytest.fixture
def normalizer():
    """A normaliser registered through the package root, with a declared range; unregistered afterwards."""

    @algos.register_grad_normalizer(NAME, params={"scale": algos.Param.number(gt=0)})
    def scaled(parameters, *, scale: float = 1.0) -> algos.GradNormalizer:
        return algos.ClipBiasNormalizer(parameters, delta=scale)

    yield scaled
    del registry._NORMALIZERS[NAME]
    registry._PARAMS["normalizer"].pop(NAME, None)


def test_a_normalizer_registered_from_the_package_root_is_one_a_config_names(normalizer):
    assert NAME in algos.grad_normalizer_names() and algos.get_grad_normalizer(NAME) is normalizer
    cfg = load_config(TINY, [f"algo.normalizer={NAME}", "algo.normalizer_params.scale=2.0"])
    assert cfg.algorithm.normalizer == NAME and dict(cfg.algorithm.normalizer_params) == {"scale": 2.0}
    with pytest.raises(ConfigError, match="scale"):  # its declared range is checked when the config loads
        load_config(TINY, [f"algo.normalizer={NAME}", "algo.normalizer_params.scale=-1"])
