"""`python -m fxamp explain`: end to end in a subprocess, error paths in-process (faster)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import fxamp
import fxamp.cli
from examples import models
from fxamp.cli import main
from fxamp.viewer import GraphView
from fxamp.viewer import server as viewer_server

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "fxamp", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_explain_mlp_o2():
    result = run_cli("explain", "examples.models:mlp", "--opt-level", "O2")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("fxamp O2 | dtype bf16 | policy torch-cpu | device cpu\n")
    assert "== forward graph 0 (after fxamp) ==" in out
    assert "fc1_weight: bf16[32,16]" in out  # O2 stores the weights in bf16
    assert "== compute ops ==" in out
    assert "== backward graph" not in out  # only with --backward
    linears = [line for line in out.splitlines() if line.startswith("linear.default")]
    assert len(linears) == 2 and all("-> bf16" in line for line in linears)


def test_zero_for_letter_o_exits_2_with_one_line():
    result = run_cli("explain", "examples.models:mlp", "--opt-level", "01")
    assert result.returncode == 2
    assert result.stderr == (
        "python -m fxamp: error: opt_level '01' is not one of 'O0', 'O1', 'O2', 'O3' "
        "(the prefix is the letter O, not the number zero)\n")
    assert result.stdout == ""


@pytest.mark.parametrize("args, message", [
    (["examples.models"], "TARGET 'examples.models' is not 'package.module:factory'"),
    (["examples.no_such_module:mlp"], "cannot import 'examples.no_such_module'"),
    (["examples.models:no_such_factory"],
     "'examples.models' has no callable 'no_such_factory'"),
    (["examples.models:MLP"], "examples.models:MLP() returned MLP, not (model, "),
    (["examples.models:mlp", "--keep-batchnorm-fp32", "True"],
     "keep_batchnorm_fp32 cannot be set with O1"),
    (["examples.models:mlp", "--op-override", "aten.no_such_op=fp32"],
     "op_overrides key 'aten.no_such_op' is not an ATen op"),
    (["examples.models:mlp", "--module-override", "fc1"], "'fc1' is not KEY=POLICY"),
])
def test_bad_input_exits_2_with_one_line(capsys, args, message):
    code, out, err = run_main(capsys, "explain", *args)
    assert code == 2 and out == ""
    assert message in err and err.startswith("python -m fxamp")
    assert err.count("\n") == 1 and "Traceback" not in err


BCE_MODEL = """
import torch
import torch.nn.functional as F


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 1)

    def forward(self, x, y):
        return F.binary_cross_entropy(torch.sigmoid(self.fc(x)), y)


def bce():
    return Classifier(), (torch.randn(4, 8), torch.rand(4, 1))
"""


def test_banned_op_exits_1_with_the_fix(capsys, tmp_path, monkeypatch):
    (tmp_path / "fxamp_cli_bce_model.py").write_text(BCE_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = run_main(capsys, "explain", "fxamp_cli_bce_model:bce", "--policy", "apex")
    assert code == 1 and out == ""
    assert err.startswith("python -m fxamp: error: aten.binary_cross_entropy.default")
    assert "binary_cross_entropy_with_logits" in err and err.count("\n") == 1


def test_explain_save_writes_the_view_with_its_overlays(tmp_path):
    path = tmp_path / "planted.json"
    result = run_cli("explain", "examples.viewer:planted_overflow", "--dtype", "fp16",
                     "--ranges", "--locate-overflow", "--save", str(path))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"saved {path}\n"
    view = GraphView.load(str(path))
    assert view.label == "fxamp O1 | dtype f16 | policy torch-cpu | device cpu"
    assert view.overlay("first inf or NaN") == {
        "forward 0": {"results": {"matmul": {"value": "here", "bgColor": "#e31a1c"}}}}


def test_locate_overflow_needs_a_view(capsys):
    code, out, err = run_main(capsys, "explain", "examples.models:mlp", "--locate-overflow")
    assert (code, out) == (2, "")
    assert err == ("python -m fxamp: error: --locate-overflow marks the op in the graph view: "
                   "add --view or --save FILE\n")


def test_view_without_model_explorer_says_how_to_install(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(viewer_server.importlib.util, "find_spec", lambda name: None)
    model, inputs = models.mlp()
    path = fxamp.explain(model, *inputs).save(str(tmp_path / "mlp.json"))
    code, out, err = run_main(capsys, "view", path)
    assert (code, out) == (2, "")
    assert err == ("python -m fxamp: error: fxamp's graph viewer needs Model Explorer: pip "
                   'install "fxamp[viewer]", or pip install -e ".[viewer]" in a checkout (Model '
                   "Explorer, the package ai-edge-model-explorer); .save(path) writes the same "
                   "view without it\n")
    code, _, err = run_main(capsys, "view", str(tmp_path / "missing.json"))
    assert code == 2 and "cannot read" in err and "No such file" in err


@pytest.fixture(scope="module")
def saved_mlp(tmp_path_factory):
    model, inputs = models.mlp()
    return fxamp.explain(model, *inputs).save(str(tmp_path_factory.mktemp("view") / "mlp.json"))


@pytest.mark.parametrize("content, message", [
    (b"\x89PNG\r\n", "is not a saved fxamp view: not text (a binary file?); write one with"),
    (b'{"fxamp": {"version": 1}}', "is not a complete fxamp view: label, graphs, "
                                  "fxamp.overlays missing or malformed"),
    (b'{"fxamp": {"version": 2}, "label": "x", "graphs": []}',
     "was saved by a newer fxamp (view format 2; this one reads 1): upgrade fxamp"),
    (b'{"label": "x", "graphs": []}', "it has no 'fxamp': {'version': 1} entry; write one"),
    (b"[1, 2]", "its JSON is a list, not an object"),
])
def test_view_of_a_bad_file_exits_2_with_one_line(capsys, tmp_path, content, message):
    path = tmp_path / "x.json"
    path.write_bytes(content)
    code, out, err = run_main(capsys, "view", str(path))
    assert (code, out) == (2, "")
    assert err.startswith(f"python -m fxamp: error: {path} ") and message in err
    assert err.count("\n") == 1


@pytest.mark.parametrize("port", ["70000", "-5", "0"])
def test_view_on_a_bad_port_exits_2_with_one_line(capsys, saved_mlp, port):
    code, out, err = run_main(capsys, "view", saved_mlp, f"--port={port}")
    assert (code, out) == (2, "")
    assert err == (f"python -m fxamp: error: port {port} is not one to serve on: pass one of "
                   "1-65535, or leave --port out for a free one\n")


def test_view_on_a_port_in_use_says_how_to_get_a_free_one(capsys, saved_mlp):
    with socket.socket() as s:
        s.bind((viewer_server.HOST, 0))
        s.listen()
        port = s.getsockname()[1]
        code, _, err = run_main(capsys, "view", saved_mlp, "--port", str(port))
    assert code == 2
    assert err == (f"python -m fxamp: error: port {port} on 127.0.0.1 is in use: pass another, "
                   "or leave --port out for a free one\n")


def _no_model(spec):
    raise AssertionError(f"the model {spec} ran before the bad option was refused")


@pytest.mark.parametrize("args, message", [
    (["--save", "/no-such-dir/x.json"], "cannot save the view to '/no-such-dir/x.json': there "
                                        "is no directory '/no-such-dir'; create it first"),
    (["--save", "."], "cannot save the view to '.': it is a directory; name a file in it"),
    (["--view", "--port", "70000"], "port 70000 is not one to serve on"),
])
def test_explain_refuses_where_the_view_goes_before_the_model_runs(capsys, monkeypatch, args,
                                                                    message):
    monkeypatch.setattr(fxamp.cli, "load_target", _no_model)
    code, out, err = run_main(capsys, "explain", "examples.models:mlp", *args)
    assert (code, out) == (2, "")
    assert err.startswith(f"python -m fxamp: error: {message}") and err.count("\n") == 1


def test_explain_view_without_model_explorer_fails_before_the_model_runs(capsys, monkeypatch):
    monkeypatch.setattr(viewer_server.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(fxamp.cli, "load_target", _no_model)
    code, _, err = run_main(capsys, "explain", "examples.models:mlp", "--view")
    assert code == 2 and "fxamp's graph viewer needs Model Explorer" in err
