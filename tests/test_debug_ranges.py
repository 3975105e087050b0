"""Range statistics: every number in the table against a reference computed in eager mode on
the same batch (activations and gradients), aggregation over batches, CSV export, explain()."""

import csv
import io

import pytest
import torch
import torch.nn.functional as F

import fxamp
from examples import models
from fxamp.debug import range_stats

LINEAR, MM = "aten.linear.default", "aten.mm.default"


def _reference(*tensors):
    """(max |x|, fraction > 65504, fraction in (0, 2**-24), fraction in (0, 2**-14)), float64."""
    a = torch.cat([t.detach().double().abs().flatten() for t in tensors])
    nonzero = a > 0
    return (a.max().item(), (a > 65504).double().mean().item(),
            (nonzero & (a < 2.0**-24)).double().mean().item(),
            (nonzero & (a < 2.0**-14)).double().mean().item())


def _stats(row):
    return (row.max_abs, row.overflow, row.underflow, row.subnormal)


def _planted_mlp():
    """fc1 unit 0 overflows fp16, unit 1 is 1e-9 (flushed to zero), unit 2 is 1e-6 (subnormal)."""
    model, (x,) = models.mlp()
    with torch.no_grad():
        model.fc1.weight[0].mul_(1e5)
        model.fc1.weight[1:3].zero_()
        model.fc1.bias[1:3] = torch.tensor([1e-9, 1e-6])
    return model, x


def _eager(model, x, loss_scale):
    h = model.fc1(x)
    r = torch.relu(h)
    out = model.fc2(r)
    for t in (h, r):
        t.retain_grad()
    (out.float().sum() * loss_scale).backward()
    return h, r, out


def _one(table, **match):
    rows = table.select(**match)
    assert len(rows) == 1, (match, rows)
    return rows[0]


def test_fp32_table_matches_eager_activations_and_gradients():
    model, x = _planted_mlp()
    table = range_stats(model, x, loss_scale=8.0, opt_level="O0")
    h, r, out = _eager(model, x, 8.0)
    fw = dict(phase="forward")
    checks = [
        (_one(table, op="aten.addmm.default", module="fc1", **fw), h),
        (_one(table, op="aten.relu.default", **fw), r),
        (_one(table, op="aten.addmm.default", module="fc2", **fw), out),
        (_one(table, op="aten.threshold_backward.default"), h.grad),
    ]
    fc2_mm = {row.numel: row for row in table.select(phase="backward", module="fc2", op=MM)}
    fc1_mm = {row.numel: row for row in table.select(phase="backward", module="fc1", op=MM)}
    checks += [(fc2_mm[r.numel()], r.grad), (fc2_mm[model.fc2.weight.numel()],
                                             model.fc2.weight.grad),
               (fc1_mm[model.fc1.weight.numel()], model.fc1.weight.grad)]
    for row, eager in checks:
        assert _stats(row) == pytest.approx(_reference(eager), rel=1e-6, abs=0), row
    planted = _one(table, op="aten.addmm.default", module="fc1", **fw)
    assert planted.overflow > 0 and planted.underflow > 0 and planted.subnormal > planted.underflow
    assert planted.risk == "overflow" and planted.dtype == "f32"


def test_bf16_activations_match_eager_autocast():
    model, (x,) = models.mlp()
    table = range_stats(model, x, backward=False)  # O1, bf16 on the CPU
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model.fc1(x)
        out = model.fc2(torch.relu(h))
    for module, eager in (("fc1", h), ("fc2", out)):
        row = _one(table, phase="forward", op="aten.addmm.default", module=module)
        assert row.dtype == "bf16" and eager.dtype == torch.bfloat16
        assert _stats(row) == pytest.approx(_reference(eager), rel=1e-2, abs=0)
    assert not table.select(phase="backward")


def test_statistics_aggregate_over_batches():
    model, x = _planted_mlp()
    batches = [x, 3 * x]
    table = range_stats(model, batches, opt_level="O0")
    h = [model.fc1(b) for b in batches]
    row = _one(table, phase="forward", op="aten.addmm.default", module="fc1")
    assert table.batches == 2 and row.numel == sum(t.numel() for t in h)
    assert _stats(row) == pytest.approx(_reference(*h), rel=1e-6, abs=0)


def test_loss_fn_and_targets_as_a_dataloader_yields_them():
    model, (x,) = models.mlp()
    y = torch.randint(0, 4, (8,))
    table = range_stats(model, [(x, y)], F.cross_entropy, opt_level="O0")
    out = model(x)
    F.cross_entropy(out, y).backward()
    grad_rows = table.select(phase="backward", module="fc2", op=MM)
    weight_row = next(r for r in grad_rows if r.numel == model.fc2.weight.numel())
    assert _stats(weight_row) == pytest.approx(_reference(model.fc2.weight.grad), rel=1e-6)


def test_csv_export(tmp_path):
    model, x = _planted_mlp()
    table = range_stats(model, x, opt_level="O0")
    path = tmp_path / "ranges.csv"
    text = table.to_csv(str(path))
    assert path.read_text() == text
    rows = list(csv.DictReader(io.StringIO(text)))
    assert len(rows) == len(table.rows)
    assert list(rows[0]) == ["phase", "graph", "node", "op", "source_op", "module", "dtype",
                             "numel", "max_abs", "overflow", "underflow", "subnormal",
                             "nonfinite", "source_node", "risk"]
    for parsed, row in zip(rows, table.rows):
        assert float(parsed["max_abs"]) == row.max_abs and parsed["risk"] == row.risk
    assert [r.node for r in table.at_risk()] == [r["node"] for r in rows if r["risk"]]


def test_table_text_names_ops_modules_and_limits():
    model, x = _planted_mlp()
    text = str(range_stats(model, x, opt_level="O0"))
    first, header = text.splitlines()[:2]
    assert first == "value ranges vs fp16: O0 | fp32 | 1 batch(es) | gradients at loss scale 1"
    assert header.split() == ["phase", "op", "of", "module", "dtype", "max|x|", ">65504",
                              "<2^-24", "<2^-14", "inf/nan", "risk"]
    assert any(line.split()[:4] == ["fw", "addmm", "linear", "fc1"] and
               line.endswith("overflow") for line in text.splitlines())


def test_explain_shows_ranges_on_request():
    model, (x,) = models.mlp()
    report = fxamp.explain(model, x, backward=True, ranges=True)
    assert "== value ranges ==" in str(report)
    assert report.ranges.select(phase="backward") and report.ranges.config == report.config
    plain = fxamp.explain(model, x)
    assert plain.ranges is None and "== value ranges ==" not in str(plain)
