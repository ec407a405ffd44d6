"""``meshplan run`` refuses in the launching process, before torchrun or any rank starts, in one line:
a plan made for another model, a plan this node cannot hold (GPUs, CPU cores, several nodes), and
what ``runtime.apply.checks.check_plan`` refuses on the model. torchrun is replaced by a recorder:
a refusal leaves it uncalled; a plan that fits reaches it once. No process is spawned here."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import meshplan.runtime.apply.checks  # noqa: F401  (imported at collection: its imports' noise is not the test's)
from meshplan.cli import main
from meshplan.models import load_model
from meshplan.runtime.apply import handplan
from meshplan.runtime.launch import devices, supervise
from meshplan.runtime.launch.devices import NodeDevices, fit_problem
from meshplan.runtime.launch.torchrun import Launch

CPU2 = NodeDevices(gpus=0, cores=2)


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """torchrun commands ``meshplan run`` would start (none is started); this node: 2 cores, no GPU."""
    calls: list[list[str]] = []
    monkeypatch.setattr(supervise, "run_tree", lambda cmd, **kw: calls.append(list(cmd)) or 0)
    monkeypatch.setattr(devices, "local_devices", lambda: CPU2)
    return calls


def _plan(tmp_path: Path, model: str = "mlp", dp: int = 1, name: str = "plan.json", **replace: object) -> str:
    spec = load_model(model, batch_size=4)
    plan = handplan.manual_plan(spec.model, None, model_name=model, dp=dp, micro_batch_size=4)
    if replace:
        plan = dataclasses.replace(plan, **replace)
    plan.save(tmp_path / name)
    return str(tmp_path / name)


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], launched: list[list[str]]) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert not launched, "torchrun was started"
    assert len(err.splitlines()) == 1, err
    assert err.startswith("meshplan run: error: ")
    return err


def test_plan_for_another_model_is_refused_before_torchrun(tmp_path, capsys, launched) -> None:
    plan = _plan(tmp_path, "mlp")
    err = _refused(["run", plan, "--model", "mlp-deep", "--record", str(tmp_path / "r.json")], capsys, launched)
    assert "the plan was made for another model ('mlp'" in err and "--model 'mlp-deep'" in err


def test_same_names_other_widths_are_refused(tmp_path, capsys, launched) -> None:
    f = tmp_path / "wide.py"
    f.write_text("from meshplan.models.mlp import MLP\n\ndef build():\n    return MLP(64, 512, 64, 2)\n")
    plan = _plan(tmp_path, "mlp")
    err = _refused(["run", plan, "--model", f"{f}:build"], capsys, launched)
    assert "model_fingerprint" in err


def test_oversubscribed_cpu_run_is_refused_and_the_flag_lets_it_start(tmp_path, capsys, launched) -> None:
    plan = _plan(tmp_path, "mlp", dp=4)
    err = _refused(["run", plan, "--model", "mlp"], capsys, launched)
    assert "4 ranks x 1 thread(s) on 2 CPU cores" in err and "--oversubscribe" in err
    assert main(["run", plan, "--model", "mlp", "--oversubscribe"]) == 0  # the checks pass: torchrun is reached
    assert len(launched) == 1 and "--nproc-per-node=4" in launched[0]


def test_threads_count_against_the_cores(tmp_path, capsys, launched) -> None:
    plan = _plan(tmp_path, "mlp", dp=2)
    assert main(["run", plan, "--model", "mlp"]) == 0 and len(launched) == 1
    launched.clear()
    err = _refused(["run", plan, "--model", "mlp", "--threads", "2"], capsys, launched)
    assert "2 ranks x 2 thread(s) on 2 CPU cores" in err and "--threads 1" in err


def test_multi_node_plan_on_one_node_names_the_command_for_each_node(tmp_path, capsys, launched) -> None:
    cluster = {"name": "h100", "devices_per_node": 8}
    plan = _plan(tmp_path, "mlp", dp=64, cluster=cluster)
    err = _refused(["run", plan, "--model", "mlp", "--steps", "5"], capsys, launched)
    assert "the plan needs 64 ranks on nodes of 8" in err and "32x oversubscribed" in err
    assert f"`meshplan run {plan} --model mlp --steps 5 --nnodes 8 --nproc-per-node 8 --rdzv-endpoint HOST:29500`" in err


def test_more_ranks_than_gpus_is_refused_with_the_nodes_it_needs(tmp_path, capsys, launched, monkeypatch) -> None:
    monkeypatch.setattr(devices, "local_devices", lambda: NodeDevices(gpus=4, cores=64))
    plan = _plan(tmp_path, "mlp", dp=8)
    err = _refused(["run", plan, "--model", "mlp"], capsys, launched)
    assert "needs 8 ranks and this node has 4 GPU(s)" in err and "--nnodes 2 --nproc-per-node 4" in err


def test_check_plan_refusals_come_from_the_launcher(tmp_path, capsys, launched) -> None:
    plan = _plan(tmp_path, "mlp", dtype="fp8")
    err = _refused(["run", plan, "--model", "mlp"], capsys, launched)
    assert "fp8" in err and "not executed by the meshplan runtime" in err
    err = _refused(["run", plan, "--model", "mlp", "--build", "host"], capsys, launched)  # checked on meta all the same
    assert "not executed by the meshplan runtime" in err


def test_seq_past_the_models_maximum_is_refused(tmp_path, capsys, launched) -> None:
    plan = _plan(tmp_path, "gpt-tiny", seq_len=4096)
    err = _refused(["run", plan, "--model", "gpt-tiny"], capsys, launched)
    assert "exceeds the model's block_size" in err


def test_eval_every_needs_a_token_file(tmp_path, capsys, launched) -> None:
    plan = _plan(tmp_path, "mlp")
    err = _refused(["run", plan, "--model", "mlp", "--eval-every", "2", "--data", "examples.data_hook:batches"],
                   capsys, launched)
    assert "--eval-every needs --data tokens.bin" in err


@pytest.mark.parametrize(("node", "launch", "kw", "want"), [
    (CPU2, Launch(nproc_per_node=2), {}, ""),
    (CPU2, Launch(nproc_per_node=3), {}, "3 ranks x 1 thread(s) on 2 CPU cores (no GPU): oversubscribed"),
    (CPU2, Launch(nproc_per_node=3), {"oversubscribe": True}, ""),
    (CPU2, Launch(nproc_per_node=1), {"threads": 4}, "1 ranks x 4 thread(s)"),
    (NodeDevices(gpus=8, cores=2), Launch(nproc_per_node=8), {}, ""),  # GPUs: cores do not count
    (NodeDevices(gpus=8, cores=2), Launch(nproc_per_node=16), {"oversubscribe": True},
     "this node has 8 GPU(s), one rank each; run it on 2 nodes of 8 ranks"),
    (NodeDevices(gpus=4, cores=64), Launch(nproc_per_node=8, nnodes=2, rdzv_endpoint="h:1"), {},
     "--nproc-per-node 8: this node has 4 GPU(s), one rank each; use --nproc-per-node 4 (and --nnodes 4)"),
    (NodeDevices(gpus=4, cores=64), Launch(nproc_per_node=6), {}, "run it on 2 nodes of 3 ranks"),
    (NodeDevices(gpus=4, cores=64), Launch(nproc_per_node=6, nnodes=2, rdzv_endpoint="h:1"), {},
     "--nproc-per-node 6: this node has 4 GPU(s), one rank each; use --nproc-per-node 4 (and --nnodes 3)"),
    (CPU2, Launch(nproc_per_node=8, nnodes=8, rdzv_endpoint="h:1"), {}, "run it on 32 nodes of 2 ranks"),
])
def test_fit_problem(node, launch, kw, want) -> None:
    got = fit_problem(launch.world_size, launch, node, **kw)
    assert (want in got) if want else got == "", got
    assert "\n" not in got


def test_init_from_names_and_shapes_are_checked_in_the_launcher(tmp_path, capsys, launched) -> None:
    """HF safetensors and DCP: what load_pretrained would refuse on every rank, from the headers only."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from meshplan.runtime.weights.pretrained import check_pretrained, load_pretrained

    plan = _plan(tmp_path, "mlp")
    state = {k: v.contiguous() for k, v in load_model("mlp").model.state_dict().items()}
    cases = {"good": state, "wide": {**state, next(iter(state)): torch.zeros(3, 3)},
             "short": dict(list(state.items())[1:])}
    for name, sd in cases.items():
        (tmp_path / name).mkdir()
        save_file(sd, str(tmp_path / name / "model.safetensors"))
        dcp.save(sd, checkpoint_id=str(tmp_path / f"{name}_dcp"))
    first = next(iter(state))
    for kind in ("", "_dcp"):
        assert main(["run", plan, "--model", "mlp", "--init-from", str(tmp_path / f"good{kind}")]) == 0
        assert len(launched) == 1
        launched.clear()
        err = _refused(["run", plan, "--model", "mlp", "--init-from", str(tmp_path / f"wide{kind}")], capsys, launched)
        assert f"{first} has shape (3, 3) in the checkpoint" in err
        err = _refused(["run", plan, "--model", "mlp", "--init-from", str(tmp_path / f"short{kind}")], capsys, launched)
        assert f"the model's {first}" in err and "is not in the checkpoint" in err
        for bad in ("wide", "short"):  # the ranks' loader refuses with the same words
            with pytest.raises(ValueError) as ranks:
                load_pretrained(load_model("mlp").model, tmp_path / f"{bad}{kind}")
            with pytest.raises(ValueError) as launcher:
                check_pretrained(load_model("mlp", device="meta").model, tmp_path / f"{bad}{kind}")
            assert str(launcher.value) == str(ranks.value)


def test_a_real_cli_refusal_is_one_line_on_stderr(tmp_path) -> None:
    """As a user sees it (a fresh process, third-party start-up noise and all): one line, exit 1, no torchrun."""
    import subprocess
    import sys

    plan = _plan(tmp_path, "mlp", dtype="fp8")
    out = subprocess.run([sys.executable, "-m", "meshplan.cli", "run", plan, "--model", "mlp"],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [out.stderr.strip()], out.stderr
    assert out.stderr.startswith("meshplan run: error: ") and "fp8" in out.stderr
    assert "torch.distributed.run" not in out.stderr + out.stdout and out.stdout == ""


def test_resume_of_another_models_checkpoint_is_refused_in_the_launcher(tmp_path, capsys, launched) -> None:
    import json

    plan = _plan(tmp_path, "mlp")

    def checkpoint(d: str, model: str, transpose: bool = False) -> str:
        sd = load_model(model, device="meta").model.state_dict()
        fp = {k: [list(v.shape)[::-1] if transpose and v.dim() == 2 else list(v.shape), "float32"] for k, v in sd.items()}
        (tmp_path / d / "step-000003").mkdir(parents=True)
        (tmp_path / d / "step-000003" / "meshplan.json").write_text(json.dumps({"step": 3, "model_fingerprint": fp}))
        return str(tmp_path / d)

    for d in (checkpoint("same", "mlp"), checkpoint("tp", "mlp", transpose=True)):  # HF Conv1D as Linear: same model
        assert main(["run", plan, "--model", "mlp", "--resume", "--checkpoint-dir", d]) == 0
    assert len(launched) == 2
    launched.clear()
    tied = _plan(tmp_path, "hf-gpt2-tiny", name="gpt2.json")  # its LM head is the embedding: named once is enough
    d = checkpoint("tied", "hf-gpt2-tiny")
    man = tmp_path / "tied" / "step-000003" / "meshplan.json"
    m = json.loads(man.read_text())
    del m["model_fingerprint"]["model.lm_head.weight"]
    man.write_text(json.dumps(m))
    assert main(["run", tied, "--model", "hf-gpt2-tiny", "--resume", "--checkpoint-dir", d]) == 0
    launched.clear()
    other = checkpoint("other", "mlp-deep")
    err = _refused(["run", plan, "--model", "mlp", "--resume", "--checkpoint-dir", other], capsys, launched)
    assert f"checkpoint {other}/step-000003 was written for a different model" in err


def test_token_file_is_opened_as_the_ranks_open_it(tmp_path, capsys, launched) -> None:
    import numpy as np

    plan = _plan(tmp_path, "gpt-tiny", seq_len=32)
    vocab = load_model("gpt-tiny", device="meta").model.config.vocab_size

    def tokens(name: str, n: int, top: int) -> str:
        np.arange(n, dtype=np.uint16).__mod__(top + 1).tofile(tmp_path / name)
        return str(tmp_path / name)

    good = tokens("good.bin", 4096, vocab - 1)
    assert main(["run", plan, "--model", "gpt-tiny", "--data", good]) == 0 and len(launched) == 1
    launched.clear()
    err = _refused(["run", plan, "--model", "gpt-tiny", "--data", tokens("wide.bin", 4096, vocab)], capsys, launched)
    assert f"largest token id is {vocab} but the model's vocabulary has {vocab} entries" in err
    err = _refused(["run", plan, "--model", "gpt-tiny", "--data", tokens("short.bin", 20, 5)], capsys, launched)
    assert "fewer than one window of seq_len+1 = 33" in err
    tokens("good.val.bin", 40, 5)  # one window, not a global batch of them
    err = _refused(["run", plan, "--model", "gpt-tiny", "--data", good, "--eval-every", "5"], capsys, launched)
    assert "fewer than one global batch" in err
