"""The graph view's data: fxamp's graphs and measurements as Model Explorer JSON, without the
viewer package (the browser tests are tests/test_viewer_browser.py)."""

import colorsys
import dataclasses
import json
import os

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline

import fxamp
from examples import models
from examples.debug_overflow import planted_model
from fxamp.errors import ConfigError
from fxamp.planner.cost import as_target
from fxamp.planner.plan import PlannedGemm, PrecisionPlan
from fxamp.viewer.overlays import _plan_note
from fxamp.viewer import GraphView, ViewerMissing, graph_view
from fxamp.viewer import server as viewer_server
from fxamp.viewer.graph import BOUNDARY_BORDER, CAST_BORDER, DTYPE_COLOURS
from fxamp.viewer.overlays import OVERFLOW, RED, WHITE


def _attrs(node: dict) -> dict:
    attrs = {a["key"]: a["value"] for a in node["attrs"]}
    if "source" in attrs:  # machine-dependent path: keep the file name and line
        attrs["source"] = os.path.basename(attrs["source"].split(" in ")[0])
    return attrs


def golden(view: GraphView) -> str:
    """One JSON line per node: what Model Explorer gets, the source path shortened."""
    lines = [f"label: {view.label}"]
    for g in view.graphs:
        lines.append(f"graph {g['id']!r} groups "
                     + json.dumps({k: v for k, v in g["groupNodeAttributes"].items() if k}))
        for n in g["nodes"]:
            shown = {"id": n["id"], "label": n["label"], "ns": n["namespace"],
                     "in": [e["sourceNodeId"] for e in n["incomingEdges"]],
                     "style": n.get("style"), **_attrs(n)}
            lines.append(json.dumps({k: v for k, v in shown.items() if v not in (None, [])}))
    lines += [f"overlay {o['name']!r}: {json.dumps(o['nodeData'])}" for o in view.overlays]
    return "\n".join(lines)


@pytest.fixture(scope="module")
def mlp_view():
    model, inputs = models.mlp()
    return fxamp.explain(model, *inputs, opt_level="O1").graph_view()


def test_golden_mlp_o1(mlp_view):
    assert_expected_inline(golden(mlp_view), """\
label: fxamp O1 | dtype bf16 | policy torch-cpu | device cpu
graph 'forward 0' groups {"fc1": {"module": "fc1", "class": "Linear"}, "fc2": {"module": "fc2", "class": "Linear"}}
{"id": "fc1_weight", "label": "fc1_weight", "ns": "fc1", "style": {"backgroundColor": "#9ecae1"}, "op": "placeholder", "runs in": "f32", "output": "f32[32,16]"}
{"id": "fc1_bias", "label": "fc1_bias", "ns": "fc1", "style": {"backgroundColor": "#9ecae1"}, "op": "placeholder", "runs in": "f32", "output": "f32[32]"}
{"id": "args_0", "label": "args_0", "ns": "fc1", "style": {"backgroundColor": "#9ecae1"}, "op": "placeholder", "runs in": "f32", "output": "f32[8,16]"}
{"id": "fc2_weight", "label": "fc2_weight", "ns": "fc2", "style": {"backgroundColor": "#9ecae1"}, "op": "placeholder", "runs in": "f32", "output": "f32[4,32]"}
{"id": "fc2_bias", "label": "fc2_bias", "ns": "fc2", "style": {"backgroundColor": "#9ecae1"}, "op": "placeholder", "runs in": "f32", "output": "f32[4]"}
{"id": "args_0_bf16", "label": "args_0_bf16", "ns": "fc1", "in": ["args_0"], "style": {"backgroundColor": "#a1d99b", "borderColor": "#d6007e"}, "op": "aten._to_copy.default", "runs in": "bf16", "output": "bf16[8,16]", "input dtypes before fxamp's casts": "f32", "policy": "lower", "why": "lower input of linear", "fxamp": "cast inserted by fxamp", "module": "fc1 (Linear)", "source": "models.py:27"}
{"id": "fc1_weight_bf16", "label": "fc1_weight_bf16", "ns": "fc1", "in": ["fc1_weight"], "style": {"backgroundColor": "#a1d99b", "borderColor": "#d6007e"}, "op": "aten._to_copy.default", "runs in": "bf16", "output": "bf16[32,16]", "input dtypes before fxamp's casts": "f32", "policy": "lower", "why": "lower input of linear", "fxamp": "cast inserted by fxamp", "module": "fc1 (Linear)", "source": "models.py:27"}
{"id": "fc1_bias_bf16", "label": "fc1_bias_bf16", "ns": "fc1", "in": ["fc1_bias"], "style": {"backgroundColor": "#a1d99b", "borderColor": "#d6007e"}, "op": "aten._to_copy.default", "runs in": "bf16", "output": "bf16[32]", "input dtypes before fxamp's casts": "f32", "policy": "lower", "why": "lower input of linear", "fxamp": "cast inserted by fxamp", "module": "fc1 (Linear)", "source": "models.py:27"}
{"id": "fc2_weight_bf16", "label": "fc2_weight_bf16", "ns": "fc2", "in": ["fc2_weight"], "style": {"backgroundColor": "#a1d99b", "borderColor": "#d6007e"}, "op": "aten._to_copy.default", "runs in": "bf16", "output": "bf16[4,32]", "input dtypes before fxamp's casts": "f32", "policy": "lower", "why": "lower input of linear_1", "fxamp": "cast inserted by fxamp", "module": "fc2 (Linear)", "source": "models.py:27"}
{"id": "fc2_bias_bf16", "label": "fc2_bias_bf16", "ns": "fc2", "in": ["fc2_bias"], "style": {"backgroundColor": "#a1d99b", "borderColor": "#d6007e"}, "op": "aten._to_copy.default", "runs in": "bf16", "output": "bf16[4]", "input dtypes before fxamp's casts": "f32", "policy": "lower", "why": "lower input of linear_1", "fxamp": "cast inserted by fxamp", "module": "fc2 (Linear)", "source": "models.py:27"}
{"id": "linear", "label": "linear (fc1)", "ns": "fc1", "in": ["args_0_bf16", "fc1_weight_bf16", "fc1_bias_bf16"], "style": {"backgroundColor": "#a1d99b"}, "op": "aten.linear.default", "runs in": "bf16", "output": "bf16[8,32]", "input dtypes before fxamp's casts": "f32,f32,f32", "policy": "lower", "why": "torch-cpu table", "module": "fc1 (Linear)", "source": "models.py:27"}
{"id": "relu", "label": "relu", "ns": "", "in": ["linear"], "style": {"backgroundColor": "#a1d99b"}, "op": "aten.relu.default", "runs in": "bf16", "output": "bf16[8,32]", "input dtypes before fxamp's casts": "bf16", "policy": "keep", "why": "not in the table: runs in its inputs' dtype", "source": "models.py:27"}
{"id": "linear_1", "label": "linear (fc2)", "ns": "fc2", "in": ["relu", "fc2_weight_bf16", "fc2_bias_bf16"], "style": {"backgroundColor": "#a1d99b"}, "op": "aten.linear.default", "runs in": "bf16", "output": "bf16[8,4]", "input dtypes before fxamp's casts": "bf16,f32,f32", "policy": "lower", "why": "torch-cpu table", "module": "fc2 (Linear)", "source": "models.py:27"}
{"id": "to", "label": "boundary cast to f32", "ns": "", "in": ["linear_1"], "style": {"backgroundColor": "#9ecae1", "borderColor": "#54278f"}, "op": "aten.to.dtype", "runs in": "f32", "output": "f32[8,4]", "input dtypes before fxamp's casts": "bf16", "policy": "keep", "why": "model boundary cast (fxamp.compile)", "fxamp": "model-boundary cast of fxamp.compile"}
{"id": "output", "label": "output", "ns": "", "in": ["to"], "op": "output", "runs in": "-", "output": "-"}
overlay 'runs in': {"forward 0": {"results": {"fc1_weight": {"value": "f32", "bgColor": "#9ecae1"}, "fc1_bias": {"value": "f32", "bgColor": "#9ecae1"}, "args_0": {"value": "f32", "bgColor": "#9ecae1"}, "fc2_weight": {"value": "f32", "bgColor": "#9ecae1"}, "fc2_bias": {"value": "f32", "bgColor": "#9ecae1"}, "args_0_bf16": {"value": "bf16", "bgColor": "#a1d99b"}, "fc1_weight_bf16": {"value": "bf16", "bgColor": "#a1d99b"}, "fc1_bias_bf16": {"value": "bf16", "bgColor": "#a1d99b"}, "fc2_weight_bf16": {"value": "bf16", "bgColor": "#a1d99b"}, "fc2_bias_bf16": {"value": "bf16", "bgColor": "#a1d99b"}, "linear": {"value": "bf16", "bgColor": "#a1d99b"}, "relu": {"value": "bf16", "bgColor": "#a1d99b"}, "linear_1": {"value": "bf16", "bgColor": "#a1d99b"}, "to": {"value": "f32", "bgColor": "#9ecae1"}}}}""")


@pytest.fixture(scope="module")
def overflow_views():
    model, (x, target) = planted_model()
    located = fxamp.locate_overflow(model, (x, target), F.mse_loss, dtype=torch.float16)
    report = fxamp.explain(model, x, dtype=torch.float16, ranges=True)
    return located, report.graph_view(overflow=located)


def test_modules_become_nested_layers(overflow_views):
    _, view = overflow_views
    nodes = {n["id"]: n for n in view.graphs[0]["nodes"]}
    assert nodes["matmul"]["namespace"] == "attn"
    assert nodes["gelu"]["namespace"] == "mlp/1"  # Sequential "mlp", its child "1"
    groups = view.graphs[0]["groupNodeAttributes"]
    assert groups["mlp/1"] == {"module": "mlp.1", "class": "GELU"}
    assert groups["attn"] == {"module": "attn", "class": "Attention"}
    # a weight sits in the layer of the module that uses it, the batch at the top
    assert nodes["qkv_weight"]["namespace"] == "qkv"


def test_ops_are_labelled_with_their_module_to_be_told_apart(overflow_views):
    _, view = overflow_views
    labels = {n["id"]: n["label"] for n in view.graphs[0]["nodes"]}
    assert [labels[f"linear{s}"] for s in ("", "_1", "_2", "_3")] == [
        "linear (qkv)", "linear (proj)", "linear (mlp.0)", "linear (mlp.2)"]
    # two matmuls in one module: named by their nodes
    assert (labels["matmul"], labels["matmul_1"]) == ("matmul (attn)", "matmul_1 (attn)")
    assert labels["gelu"] == "gelu (mlp.1)" and labels["qkv_weight_f16"] == "qkv_weight_f16"
    assert len(set(labels.values())) == len(labels)


def test_the_side_panel_says_its_input_dtypes_are_before_the_casts(mlp_view):
    # Model Explorer's own INPUTS section lists the tensors after them
    linear = next(n for n in mlp_view.graphs[0]["nodes"] if n["id"] == "linear")
    assert _attrs(linear)["input dtypes before fxamp's casts"] == "f32,f32,f32"
    assert "inputs" not in _attrs(linear)


def test_nodes_are_filled_by_dtype_and_casts_outlined(overflow_views):
    _, view = overflow_views
    nodes = {n["id"]: n for n in view.graphs[0]["nodes"]}
    assert nodes["matmul"]["style"] == {"backgroundColor": DTYPE_COLOURS["f16"]}
    norm = nodes["layer_norm"]  # on the fp32 input, not in the fp16 table
    assert _attrs(norm)["runs in"] == "f32"
    assert norm["style"]["backgroundColor"] == DTYPE_COLOURS["f32"]
    assert (_attrs(norm)["policy"], _attrs(norm)["why"]) == (
        "keep", "not in the table: runs in its inputs' dtype")
    assert _attrs(nodes["matmul"])["why"] == "torch-cpu table"
    casts = [n for n in nodes.values() if _attrs(n).get("fxamp") == "cast inserted by fxamp"]
    assert casts and all(n["style"]["borderColor"] == CAST_BORDER for n in casts)


def test_overflow_overlay_marks_the_op_locate_overflow_found(overflow_views):
    located, view = overflow_views
    assert located.site.source_node == "matmul"
    assert view.overlays[-1]["name"] == OVERFLOW  # the last overlay colours the graph
    assert view.overlay(OVERFLOW) == {
        "forward 0": {"results": {"matmul": {"value": "here", "bgColor": RED}}}}
    matmul = next(n for n in view.graphs[0]["nodes"] if n["id"] == "matmul")
    assert _attrs(matmul)[OVERFLOW].startswith("forward: aten.matmul.default in attn")
    assert view.graphs[0]["groupNodeAttributes"][""][OVERFLOW].startswith("forward: ")


def test_headroom_is_65504_over_max_abs_red_at_overflow(overflow_views):
    _, view = overflow_views
    data = view.overlay("fp16 headroom")["forward 0"]
    assert data["thresholds"][0] == {"value": 1.0, "bgColor": RED}
    assert data["results"]["matmul"] == {"value": 0.0}  # inf: no headroom
    ln1 = data["results"]["layer_norm"]["value"]
    assert 16 < ln1 < 65504  # a LayerNorm output of a few units


def _hue_and_saturation(colour: str) -> tuple[float, float]:
    h, _, s = colorsys.rgb_to_hls(*(int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)))
    return h * 360, s


def _overlay_colours(view: GraphView) -> set[str]:
    # every colour an overlay paints but those showing a dtype ("runs in", "plan precision")
    colours = set()
    for o in view.overlays:
        for data in o["nodeData"].values():
            colours |= {t["bgColor"] for t in data.get("thresholds", ())}
            if o["name"] not in ("runs in", "plan precision"):
                colours |= {r["bgColor"] for r in data["results"].values() if "bgColor" in r}
    return colours


def test_no_overlay_paints_a_node_in_a_dtype_s_hue(overflow_views):
    _, view = overflow_views
    colours = _overlay_colours(view)
    assert len(colours) == 3, colours  # headroom's three, the culprit's red among them
    dtype_hues = [_hue_and_saturation(c)[0] for c in DTYPE_COLOURS.values()
                  if _hue_and_saturation(c)[1] > 0.1]
    for colour in colours:
        hue, saturation = _hue_and_saturation(colour)
        if saturation <= 0.1:  # a grey: only white, which no dtype is
            assert colour == WHITE
            continue
        distance = min(min(abs(hue - h), 360 - abs(hue - h)) for h in dtype_hues)
        assert distance >= 25, (colour, distance)


def test_the_view_opens_on_the_dtypes(overflow_views):
    # Model Explorer colours the graph by the last overlay: the dtypes, unless a
    # locate_overflow report was given (then its culprit, test below)
    model, (x, _) = planted_model()
    view = fxamp.explain(model, x, dtype=torch.float16, ranges=True).graph_view()
    assert [o["name"] for o in view.overlays] == ["fp16 headroom", "runs in"]
    # and the graph's info panel says how to switch
    assert "the one whose eye is open colours the graph" in view.graphs[0][
        "groupNodeAttributes"][""]["overlays"]


def test_float8_purple_is_no_paler_than_the_other_dtypes():
    # a pale lavender (#bcbddc) read as white but at high zoom
    def lightness(colour):
        return colorsys.rgb_to_hls(*(int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)))[1]

    assert lightness(DTYPE_COLOURS["float8"]) <= min(
        lightness(DTYPE_COLOURS[d]) for d in ("f32", "bf16", "f16"))


def test_headroom_values_are_the_range_table_s():
    model, inputs = models.mlp()
    report = fxamp.explain(model, *inputs, opt_level="O1", ranges=True, backward=True)
    view = report.graph_view()
    out = view.overlay("fp16 headroom")["forward 0"]["results"]
    row = report.ranges.select(phase="forward", op="aten.addmm.default", module="fc2")[0]
    assert row.source_node == "linear_1"
    assert out["linear_1"]["value"] == pytest.approx(65504 / row.max_abs, rel=1e-2)
    grads = view.overlay("fp16 headroom, gradients")["forward 0"]["results"]
    worst = max(r.max_abs for r in report.ranges.rows
                if r.phase == "backward" and r.source_node == "linear")
    assert grads["linear"]["value"] == pytest.approx(65504 / worst, rel=1e-2)
    assert {g["id"] for g in view.graphs} == {"forward 0", "backward 0"}


def test_float8_choices_and_scales():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    x = torch.randn(32, 64)
    report = fxamp.explain(model, x, opt_level="O1", float8="tensorwise", ranges=True)
    view = report.graph_view()
    nodes = {n["id"]: n for n in view.graphs[0]["nodes"]}
    assert _attrs(nodes["float8_linear"])["float8"].startswith("runs in float8: tensorwise")
    assert nodes["float8_linear"]["style"]["backgroundColor"] == DTYPE_COLOURS["float8"]
    assert _attrs(nodes["linear_1"])["float8"].startswith("stays: ")  # N = 8 < min_dim
    scales = view.overlay("float8 input scale")["forward 0"]["results"]
    amax = max(r.max_abs for r in report.ranges.rows if r.source_node == "args_0_bf16")
    assert scales["float8_linear"]["value"] == pytest.approx(448 / amax, rel=1e-2)


def test_plan_overlays_match_gemms_by_module_op_and_rank(mlp_view):
    model, inputs = models.mlp()
    report = fxamp.explain(model, *inputs, opt_level="O1")
    sites = tuple(PlannedGemm("forward", 0, name, "aten.linear.default",
                              "aten.linear.default", module, "Linear", "models.py:28",
                              (8, 16, 32), 0, ("grad_input",), "too small", errors,
                              (("fp32", 2e-6), ("bf16", 1e-6)), 3.0, precision, why)
                  for name, module, errors, precision, why in [
                      ("linear", "fc1", (("bf16", 0.004),), "bf16", "within budget"),
                      ("linear_1", "fc2", (("bf16", 0.5),), "fp32", "over budget")])
    plan = PrecisionPlan(as_target("h100"), 0.1, "bf16", None, sites)
    view = report.graph_view(plan=plan)
    assert view.overlay("plan precision")["forward 0"]["results"] == {
        "linear": {"value": "bf16", "bgColor": DTYPE_COLOURS["bf16"]},
        "linear_1": {"value": "fp32", "bgColor": DTYPE_COLOURS["f32"]}}
    errors = view.overlay("plan bf16 error")["forward 0"]
    assert errors["results"] == {"linear": {"value": 0.004}, "linear_1": {"value": 0.5}}
    assert errors["thresholds"][0] == {"value": 0.1, "bgColor": WHITE}
    assert view.overlay("plan modeled us")["forward 0"]["results"]["linear"] == {"value": 1.0}


def test_a_plan_note_names_the_precision_once():
    # the planner's reasons already start with their precision ("bf16: ..."): not "bf16: bf16:"
    site = PlannedGemm("forward", 0, "linear", "aten.linear.default", "aten.linear.default",
                       "fc1", "Linear", "models.py:28", (8, 16, 32), 0, ("grad_input",),
                       "too small", (("bf16", 0.004),), (("bf16", 1e-6),), 3.0, "bf16",
                       "bf16: its error is within the budget.")
    other = dataclasses.replace(site, reason="within budget")
    assert _plan_note(site).startswith("bf16: its error is within the budget. | errors")
    assert _plan_note(other).startswith("bf16: within budget | errors")


def test_boundary_casts_are_outlined_apart():
    model, inputs = models.cnn()
    view = fxamp.explain(model, *inputs, opt_level="O2").graph_view()
    to = next(n for n in view.graphs[0]["nodes"] if n["id"] == "to")
    assert to["label"] == "boundary cast to bf16"
    assert to["style"]["borderColor"] == BOUNDARY_BORDER


def test_save_and_load_round_trip(tmp_path, overflow_views):
    _, view = overflow_views
    path = view.save(str(tmp_path / "view.json"))
    assert GraphView.load(path) == view
    data = json.loads(open(path).read())
    # Model Explorer's own JSON loader takes a graph collection: label and graphs
    assert data["label"].startswith("fxamp O1 | dtype f16") and data["graphs"][0]["nodes"]


def test_load_refuses_other_json(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"fxamp_plan": 1}')
    with pytest.raises(ConfigError, match="not a saved fxamp view"):
        GraphView.load(str(path))
    path.write_text("graph")
    with pytest.raises(ConfigError, match="not JSON"):
        GraphView.load(str(path))


def test_explanation_save_needs_no_viewer(tmp_path, monkeypatch):
    monkeypatch.setattr(viewer_server.importlib.util, "find_spec", lambda name: None)
    model, inputs = models.mlp()
    report = fxamp.explain(model, *inputs)
    assert GraphView.load(report.save(str(tmp_path / "v.json"))).graphs
    with pytest.raises(ViewerMissing, match=r'pip install "fxamp\[viewer\]"'):
        report.view()


def test_bad_overlay_arguments_are_refused(mlp_view):
    model, inputs = models.mlp()
    report = fxamp.explain(model, *inputs)
    with pytest.raises(ConfigError, match="overflow= takes what fxamp.locate_overflow"):
        graph_view(report, overflow="matmul")
    with pytest.raises(ConfigError, match="plan= takes a fxamp.plan"):
        report.save("unused.json", plan={"fc1": "fp32"})


@pytest.mark.parametrize("port", [0, 70000, -5, "8080", True])
def test_show_refuses_a_bad_port_at_once(mlp_view, port):
    # port 0 used to start a server on a random port and poll port 0 until the timeout
    with pytest.raises(ConfigError, match=rf"port {port!r} is not one to serve on: pass one of "
                                          r"1-65535, or port=None for a free one"):
        mlp_view.view(port=port, wait=False, open_browser=False, timeout=5)


def test_save_refuses_a_missing_directory(tmp_path, mlp_view):
    with pytest.raises(ConfigError, match="there is no directory .*; create it first"):
        mlp_view.save(str(tmp_path / "missing" / "v.json"))
