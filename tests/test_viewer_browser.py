"""The graph view in a real browser: Model Explorer serves fxamp's graphs on 127.0.0.1, a
headless Chromium opens them, and the page must show the nodes, their dtype colours and the
overflow overlay. One Chromium for the module; every server is stopped and its port freed.

Needs Debian's `chromium` and `pip install "fxamp[viewer]"` (CI installs both: .ci/run);
skipped, saying which is missing, without them, except where FXAMP_REQUIRE_BROWSER is set
(CI's leg that installs them: there a missing one fails the module). FXAMP_SCREENSHOTS=DIR
keeps the screenshots (docs/img/ holds the ones docs/explain.md shows).
"""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fxamp
from browser import Browser, chromium
from examples.debug_overflow import planted_model
from fxamp.viewer.graph import DTYPE_COLOURS
from fxamp.viewer.overlays import OVERFLOW, RED, WHITE, YELLOW
from fxamp.viewer.server import port_is_free

ROOT = Path(__file__).resolve().parents[1]

_MISSING = [why for missing, why in [
    (chromium() is None, "no Chromium: apt-get install chromium"),
    (importlib.util.find_spec("model_explorer") is None,
     'no Model Explorer: pip install "fxamp[viewer]"')] if missing]
if _MISSING and os.environ.get("FXAMP_REQUIRE_BROWSER"):  # CI's leg with the viewer: never skip
    raise RuntimeError(f"FXAMP_REQUIRE_BROWSER is set but {'; '.join(_MISSING)}")
pytestmark = [pytest.mark.skipif(bool(_MISSING), reason="; ".join(_MISSING))]

# The node data tables of Model Explorer's side panel: [header, rows of (text, background)].
_TABLES = """[...document.querySelectorAll('node-data-provider-summary-panel table.results')]
  .map(t => [[...t.querySelectorAll('thead th')].map(th => th.innerText.trim()),
             [...t.querySelectorAll('tbody tr')].map(r => [...r.children].map(
                 td => [td.innerText.trim(), getComputedStyle(td).backgroundColor]))])"""
_EXPAND_ALL = "document.querySelector('.mat-icon-container.expand-all').click()"
# The node data providers' list: the overlay whose eye is open colours the graph.
_SHOWN = "document.querySelector('.index-row.selected .run-name').innerText.trim()"
_EYE = """[...document.querySelectorAll('.index-row')].find(
  row => row.querySelector('.run-name').innerText.trim() == NAME)
  .querySelector('.icon-container.visibility').click()"""


def _rgb(hex_colour: str) -> str:
    r, g, b = (int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))
    return f"rgb({r}, {g}, {b})"


def _node_data(page, regex: str = "") -> dict[str, list[dict[str, tuple[str, str]]]]:
    """{node label: [{overlay name: (value, background)} per node of that label]} of the
    side panel's node data table (its first 50 rows), filtered by `regex` as a user would."""
    page.evaluate(f"""(() => {{
        const box = [...document.querySelectorAll('node-data-provider-summary-panel input')].pop();
        box.value = {json.dumps(regex)}; box.dispatchEvent(new Event('input', {{bubbles: true}}));
    }})()""")
    time.sleep(0.5)
    header, rows = page.evaluate(_TABLES)[-1]
    names = [re.sub(r"^\d+\s*|\s*visibility(_off)?$", "", h).strip() for h in header[2:]]
    table: dict = {}
    for cells in rows:
        table.setdefault(cells[1][0], []).append(dict(zip(names, map(tuple, cells[2:]))))
    return table


@pytest.fixture(scope="module")
def browser():
    b = Browser(chromium())
    yield b
    b.close()


def _open(browser, view):
    viewer = view.view(wait=False, open_browser=False)
    try:
        page = browser.open(viewer.url)
        page.wait_for("document.body && document.body.innerText.includes('op node count')")
        page.wait_for(_TABLES.replace("\n", " ") + ".length > 0")
    except BaseException:
        viewer.stop()
        raise
    return viewer, page


def _screenshot(page, name: str) -> bytes:
    page.evaluate(_EXPAND_ALL)
    time.sleep(2)  # the layers unfold with an animation
    keep = os.environ.get("FXAMP_SCREENSHOTS")
    return page.screenshot(os.path.join(keep, name) if keep else None)


def _tiny_gpt2():
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2,
                                     n_positions=8, use_cache=False)
    return transformers.GPT2LMHeadModel(config), torch.randint(0, 64, (2, 8))


@pytest.fixture(scope="module")
def transformer(browser):
    # the docs' headline call: explain(..., ranges=True).view()
    model, ids = _tiny_gpt2()
    view = fxamp.explain(model, ids, opt_level="O1", ranges=True).graph_view()
    viewer, page = _open(browser, view)
    yield view, viewer, page
    viewer.stop()
    assert port_is_free(viewer.port)


def _ops(table: dict) -> dict[str, list]:
    # {op: rows} of a node data table keyed by label ("addmm (transformer.h.0.attn.c_attn)")
    ops: dict = {}
    for label, rows in table.items():
        ops.setdefault(label.split(" ")[0], []).extend(rows)
    return ops


def test_transformer_nodes_and_layers_are_on_the_page(transformer):
    view, _, page = transformer
    text = page.text()
    nodes = view.graphs[0]["nodes"]
    assert re.search(rf"op node count\s+{len(nodes)}\b", text)
    assert "fxamp O1 | dtype bf16" in text
    table = _node_data(page)
    assert len(table) > 10 and set(table) <= {n["label"] for n in nodes}
    assert set(_node_data(page, "^layer_norm ")) == {
        f"layer_norm (transformer.{m})" for m in ("h.0.ln_1", "h.0.ln_2", "h.1.ln_1",
                                                  "h.1.ln_2", "ln_f")}
    assert "transformer" in text and "lm_head" in text  # GPT2LMHeadModel's top layers


def test_a_layer_s_ops_are_found_by_its_module_path(transformer):
    _, _, page = transformer
    # every GEMM a label of its own; casts ("why: lower input of addmm") are not found
    assert list(_node_data(page, r"^addmm \(transformer\.h\.1\.attn\.c_attn\)$")) == [
        "addmm (transformer.h.1.attn.c_attn)"]
    gemms = _node_data(page, "^addmm ")
    assert len(gemms) == 8 and all(len(rows) == 1 for rows in gemms.values())


def test_transformer_opens_on_its_dtype_colours(transformer):
    view, _, page = transformer
    assert view.overlays[-1]["name"] == "runs in"  # the last overlay colours the graph
    ops = _ops(_node_data(page, "^(addmm|layer_norm|softmax) "))
    gemms = [row["runs in"] for row in ops["addmm"]]  # GPT-2's Conv1D layers
    assert len(gemms) == 8 and set(gemms) == {("bf16", _rgb(DTYPE_COLOURS["bf16"]))}
    norms = [row["runs in"] for row in ops["layer_norm"]]  # fp32 in the CPU table
    assert len(norms) == 5 and set(norms) == {("f32", _rgb(DTYPE_COLOURS["f32"]))}
    assert page.evaluate(_SHOWN) == "runs in"  # its eye is the open one
    shot = _screenshot(page, "explain_viewer_transformer.png")
    counts = page.count_colours(shot, [DTYPE_COLOURS["bf16"], DTYPE_COLOURS["f32"]])
    assert all(n > 500 for n in counts.values()), counts  # filled nodes on the graph


def test_the_eye_icon_switches_the_graph_to_an_overlay_in_no_dtype_s_hue(transformer):
    _, _, page = transformer
    page.evaluate(_EYE.replace("NAME", json.dumps("fp16 headroom")))
    try:
        page.wait_for(f"{_SHOWN} == 'fp16 headroom'", timeout=10)
        rows = [r for rs in _node_data(page, "^(addmm|layer_norm) ").values() for r in rs]
        assert len(rows) == 13
        assert {r["fp16 headroom"][1] for r in rows} <= {_rgb(c) for c in (RED, YELLOW, WHITE)}
    finally:
        page.evaluate(_EYE.replace("NAME", json.dumps("runs in")))


@pytest.fixture(scope="module")
def overflow(browser):
    model, (x, target) = planted_model()
    located = fxamp.locate_overflow(model, (x, target), F.mse_loss, dtype=torch.float16)
    view = fxamp.explain(model, x, dtype=torch.float16, ranges=True).graph_view(
        overflow=located)
    viewer, page = _open(browser, view)
    yield located, viewer, page
    viewer.stop()
    assert port_is_free(viewer.port)


def test_overflow_overlay_is_on_the_page(overflow):
    located, _, page = overflow
    text = page.text()
    assert OVERFLOW in text and "fp16 headroom" in text  # the node data providers
    table = _node_data(page, r"^matmul \(attn\)$")
    culprit = table["matmul (attn)"][0]
    assert culprit[OVERFLOW] == ("here", _rgb(RED))
    assert culprit["fp16 headroom"] == ("0", _rgb(RED))
    assert located.site.source_node == "matmul"
    shot = _screenshot(page, "explain_viewer_overflow.png")
    assert page.count_colours(shot, [RED])[RED] > 20  # the culprit, red on the graph


def test_the_port_is_freed_when_a_test_fails_while_serving(overflow):
    _, viewer, _ = overflow
    view = fxamp.viewer.GraphView.load(viewer.log_path.replace("server.log", "view.json"))
    with pytest.raises(AssertionError, match="planted"):
        with view.view(wait=False, open_browser=False) as failing:
            port = failing.port
            assert not port_is_free(port)
            assert False, "planted"
    assert port_is_free(port) and not failing.running


def test_cli_view_serves_until_ctrl_c_and_frees_the_port(overflow, tmp_path):
    _, viewer, _ = overflow
    saved = viewer.log_path.replace("server.log", "view.json")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen([sys.executable, "-m", "fxamp", "view", saved, "--no-browser"],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        port = int(re.match(r"Model Explorer at http://127\.0\.0\.1:(\d+)/", line)[1])
        assert not port_is_free(port)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0
        assert port_is_free(port)
    finally:
        process.kill()
