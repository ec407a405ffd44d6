"""``--input-shape NAME=2x3x224x224[:dtype]`` on plan / inspect / estimate: parsing, clear errors,
and a vision model planned at the shape the user gives (no example in the factory)."""

from __future__ import annotations

import argparse
import re

import pytest

from meshplan.cli import main
from meshplan.plan import Plan
from meshplan.shapes import input_shape, input_shapes

FACTORY = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 10)

    def forward(self, pixel_values, scale):
        return self.head(self.conv(pixel_values).mean(dim=(2, 3)) * scale.float().mean())


def build():
    return Net()
'''


def test_parse_input_shapes():
    assert input_shape("pixel_values=2x3x224x224") == ("pixel_values", (2, 3, 224, 224))
    assert input_shape("input_ids=1x512:int64") == ("input_ids", ((1, 512), "int64"))
    assert input_shape("x=4X16:bfloat16") == ("x", ((4, 16), "bfloat16"))
    assert input_shapes([input_shape("a=1x2"), input_shape("b=3")]) == {"a": (1, 2), "b": (3,)}
    assert input_shapes(None) is None


@pytest.mark.parametrize(
    ("text", "why"),
    [("2x3x4", "expected NAME="), ("pixel values=2x3", "expected NAME="), ("x=2x0", "dimension '0' of x"),
     ("x=2xa", "dimension 'a' of x"), ("x=", "dimension '' of x"), ("x=2x3:float", "dtype 'float' of x unknown")],
)
def test_bad_input_shape_syntax(text, why):
    with pytest.raises(argparse.ArgumentTypeError, match=why):
        input_shape(text)


def test_duplicate_name_is_an_error():
    with pytest.raises(ValueError, match="--input-shape x is given twice"):
        input_shapes([("x", (1,)), ("x", (2,))])


def test_cli_bad_shape_exits_with_the_reason(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "gpt-tiny", "-n", "2", "--input-shape", "idx=8xfoo"])
    assert e.value.code == 2
    assert "dimension 'foo' of idx is not a positive integer" in capsys.readouterr().err
    assert main(["plan", "gpt-tiny", "-n", "2", "--seq", "16", "--input-shape", "idx=1x16", "--quiet"]) == 1
    assert "--seq and --input-shape both given" in capsys.readouterr().err


def test_plan_and_inspect_a_vision_factory_at_the_given_shape(tmp_path, capsys):
    f = tmp_path / "vision.py"
    f.write_text(FACTORY)
    out = tmp_path / "plan.json"
    args = ["--input-shape", "pixel_values=1x3x32x32", "--input-shape", "scale=1:int64"]
    assert main(["plan", f"{f}:build", "-n", "2", "--global-batch", "4", "--quiet", "--no-cache", *args,
                 "-o", str(out)]) == 0, capsys.readouterr().err
    plan = Plan.load(out)
    assert plan.world_size == 2
    capsys.readouterr()
    assert main(["inspect", f"{f}:build", *args]) == 0
    text = capsys.readouterr().out
    # traced at 1x3x32x32: the 3x3 conv 3->8 over 32x32 pixels is 2*27*8*1024 = 442,368 FLOPs (+ the head)
    assert re.search(r"forward FLOPs \(traced batch\)\s+443 kFLOP", text), text[:800]


ONE_INPUT = '''
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 10)

    def forward(self, pixel_values):
        return self.head(self.conv(pixel_values).mean(dim=(2, 3)))


def build():
    return Net()
'''


def test_run_command_forwards_input_shapes(tmp_path):
    from meshplan.commands import run as run_cmd

    f = tmp_path / "vision.py"
    f.write_text(ONE_INPUT)
    out = tmp_path / "plan.json"
    assert main(["plan", f"{f}:build", "-n", "2", "--global-batch", "4", "--quiet", "--no-cache",
                 "--input-shape", "pixel_values=1x3x16x16", "-o", str(out)]) == 0
    p = argparse.ArgumentParser()
    run_cmd.add_arguments(p)
    args = p.parse_args([str(out), "--model", f"{f}:build", "--input-shape", "pixel_values=1x3x16x16:float32"])
    cmd = run_cmd.build_command(args)
    assert cmd[cmd.index("--input-shape") + 1] == "pixel_values=1x3x16x16:float32"
    again = run_cmd.run_argv(args)
    assert again[again.index("--input-shape") + 1] == "pixel_values=1x3x16x16:float32"


@pytest.mark.distributed
def test_run_a_factory_without_examples_at_the_given_shape(tmp_path):
    """`meshplan run --input-shape` trains a model whose factory gives no example inputs; dp2 equals one device."""
    import json

    from cluster_cases import meshplan

    f = tmp_path / "vision.py"
    f.write_text(ONE_INPUT)
    shape = ["--input-shape", "pixel_values=1x3x16x16"]
    losses = {}
    for n in ("1", "2"):
        plan = tmp_path / f"plan{n}.json"
        assert main(["plan", f"{f}:build", "-n", n, "--global-batch", "4", "--quiet", "--no-cache", "--dp", n,
                     *shape, "-o", str(plan)]) == 0
        rec = tmp_path / f"rec{n}.json"
        res = meshplan("run", str(plan), "--model", f"{f}:build", "--steps", "3", "--dtype", "fp32",
                       "--record", str(rec), *shape, timeout=300)
        assert res.returncode == 0, res.stderr[-4000:]
        losses[n] = [s["loss"] for s in json.loads(rec.read_text())["steps"]]
    assert len(losses["1"]) == 3
    assert losses["2"] == pytest.approx(losses["1"], abs=1e-6), losses
