"""examples/grpo.py (issue 53): GRPO over jpa rollouts in one process: the reward rises, one compile each."""

import importlib.util
import pathlib

import pytest

EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "grpo.py"


def load():
    spec = importlib.util.spec_from_file_location("grpo_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_reward_is_the_fraction_of_digits():
    mod = load()
    assert mod.reward([ord("1"), ord("a"), ord("9"), ord(" ")]) == 0.5 and mod.reward([ord("x")]) == 0.0


@pytest.mark.bench   # about 15 s: the engine's and the trainer's compiles, 30 steps (20 left some seeds short of the threshold)
def test_reward_rises_with_one_compile_each(tmp_path, capsys):
    import json
    import random

    out = tmp_path / "curve.json"
    curve = load().main(["--steps", "30", "--seed", str(random.randrange(1000)), "--out", str(out)])
    first, last = curve[0]["reward"], max(c["reward"] for c in curve[-5:])
    assert last > first + 0.3, [c["reward"] for c in curve]
    assert [c["version"] for c in curve] == list(range(1, 31))
    assert json.loads(out.read_text())["step_compiles"] == 1
    assert "train step compiles: 1" in capsys.readouterr().out
