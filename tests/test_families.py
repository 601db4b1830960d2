"""The family registry (models.families): one module per family, found by model_type or architectures."""

import json
import pathlib

import pytest

from jpa.models import families, hf
from jpa.models.families import Family, family_of, register

HF = pathlib.Path(__file__).parent / "data" / "hf"


def test_every_supported_model_type_is_read_by_one_family_module():
    seen = {}
    for t in hf.SUPPORTED_MODEL_TYPES:
        fam, got = family_of({"model_type": t})
        assert got == t and t in fam.model_types
        seen.setdefault(fam.name, []).append(t)
    assert set(seen) == set(families._MODULES)


@pytest.mark.parametrize("name", sorted(p.name for p in HF.iterdir() if (p / "config.json").is_file()))
def test_a_config_without_model_type_is_found_by_its_architecture(name):
    """The tiny checkpoints' configs (made with transformers) load the same config from their architectures
    alone as from their model_type."""
    cfg = json.loads((HF / name / "config.json").read_text())
    fam, t = family_of(cfg)
    bare = {k: v for k, v in cfg.items() if k != "model_type"}
    assert family_of(bare) == (fam, t)
    if fam.load_model is None:  # a models.GPT family; the hybrids' configs are read by their load_model
        assert hf.config_from_hf(bare) == hf.config_from_hf(cfg)
    else:
        with pytest.raises(hf.CheckpointError, match="is not a models.GPT"):
            hf.config_from_hf(cfg)


def test_unknown_types_and_duplicate_registrations_are_refused():
    with pytest.raises(hf.CheckpointError, match=r"model_type 'mamba' is not supported; jpa loads \['llama'"):
        family_of({"model_type": "mamba"})
    with pytest.raises(hf.CheckpointError, match="model_type None is not supported"):
        family_of({"architectures": ["NoSuchForCausalLM"]})
    with pytest.raises(ValueError, match="'qwen3' is already registered by family 'llama'"):
        register(Family(name="other", model_types=("qwen3",), architectures=("X",), options=lambda *a: {}))
    with pytest.raises(ValueError, match="architectures must name one class per model type"):
        register(Family(name="other", model_types=("x1", "x2"), architectures=("X",), options=lambda *a: {}))
