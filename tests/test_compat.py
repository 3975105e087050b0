"""fxamp/_compat/ holds every private torch API the package uses, and what it relies on holds
on the installed torch (the CI legs run this on 2.11.0, 2.13.0 and 2.14.1)."""

import io
import pathlib
import re
import tokenize
import warnings

import pytest
import torch

from fxamp import _compat

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "fxamp"
COMPAT = PACKAGE / "_compat"

# Private names reached on objects rather than through `torch.` (and the node metadata keys
# AOTAutograd writes): only fxamp/_compat/ may spell them.
PRIVATE_ATTRIBUTES = frozenset({
    "_compiled_call_impl", "_call_impl", "_parameters", "_buffers", "_rename",
    "_get_active_ddp_module", "_get_zeros_like_grad_buckets", "_enter_autocast",
    "_exit_autocast", "_BatchNorm", "_InstanceNorm", "_opt_called"})
PRIVATE_META_KEYS = frozenset({"seq_nr", "from_node", "fwd_nn_module_stack", "partitioner_tag",
                               "example_value"})


def _dotted_names(tokens):
    """(line, 'a.b.c') for every dotted name in the code (strings and comments excluded)."""
    names, current, line, last = [], [], 0, None
    for tok in tokens:
        if tok.type == tokenize.NAME and (not current or last == "."):
            current.append(tok.string)
            line = line or tok.start[0]
        elif tok.type == tokenize.OP and tok.string == "." and current and last != ".":
            pass
        else:
            if current:
                names.append((line, ".".join(current)))
            current, line = ([tok.string], tok.start[0]) if tok.type == tokenize.NAME else ([], 0)
        last = tok.string
    return names + ([(line, ".".join(current))] if current else [])


def _private_uses(path, root=PACKAGE.parent):
    """'file:line: what' for each private torch name used in `path` outside fxamp/_compat/."""
    source = path.read_text()
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    found = []
    for line, name in _dotted_names(tokens):
        parts = name.split(".")
        if parts[0] == "torch" and parts[1:2] != ["ops"] and any(
                p.startswith("_") for p in parts[1:]):
            found.append((line, name))  # torch._dynamo..., torch.utils._pytree, torch._foreach_
        found += [(line, p) for p in parts[1:] if p in PRIVATE_ATTRIBUTES]
    for tok in tokens:
        if tok.type == tokenize.STRING and tok.string.strip("\"'") in PRIVATE_META_KEYS:
            found.append((tok.start[0], tok.string))
    for match in re.finditer(r"^\s*from\s+(torch[\w.]*)\s+import\s+\(?([^)\n]*)", source, re.M):
        if any(name.strip().startswith("_") for name in match[2].split(",")):
            found.append((source.count("\n", 0, match.start()) + 1, match[0].strip()))
    rel = path.relative_to(root)
    return [f"{rel}:{line}: {what}" for line, what in sorted(set(found))]


def test_private_torch_apis_are_used_only_through_compat():
    assert sorted(COMPAT.glob("*.py")), "fxamp/_compat/ not found"
    uses = [use for path in sorted(PACKAGE.rglob("*.py")) if COMPAT not in path.parents
            for use in _private_uses(path)]
    assert not uses, "private torch APIs outside fxamp/_compat/:\n" + "\n".join(uses)


def test_the_private_api_check_finds_what_it_should(tmp_path):
    sample = tmp_path / "fxamp" / "sample.py"
    sample.parent.mkdir()
    sample.write_text(
        "import torch\nfrom torch._guards import detect_fake_mode\n"
        "from torch.utils import _pytree as pytree\n"
        "x = torch._dynamo.utils.counters  # torch._dynamo in a comment is fine\n"
        "y = torch.ops.aten._to_copy.default\nmodel._compiled_call_impl = None\n"
        "s = node.meta.get('seq_nr')\nd = 'torch._inductor in a string is fine'\n")
    uses = _private_uses(sample, tmp_path)
    assert [u.split(":")[1] for u in uses] == ["2", "3", "4", "6", "7"], uses


def _by_constant(x, n):
    return x + n


def test_a_fresh_copy_of_a_function_has_a_dynamo_cache_of_its_own():
    # What Note [One compiled step per kind] relies on: Dynamo's recompile limit counts
    # the entries of one code object; twelve fresh copies take one graph each.
    x = torch.ones(2)
    shared = torch.compile(_by_constant, backend="eager", fullgraph=True, dynamic=False)
    with pytest.raises(Exception, match="(?i)recompil|fullgraph"):
        for n in range(12):
            shared(x, n)
    fresh = [_compat.compile_fresh(_by_constant, backend="eager", fullgraph=True,
                                   dynamic=False) for _ in range(12)]
    assert [f(x, n)[0].item() for n, f in enumerate(fresh)] == [1.0 + n for n in range(12)]


def _blocks_and_clamp(xs, n, low):
    out = xs[0].new_zeros(n)
    for x in xs:
        out = out + x.view(-1, 4).sum(1)[:1].sum()
    return out.clamp_min(low)


def test_compile_symbolic_keeps_sizes_and_ints_symbolic_and_floats_constant():
    # What Note [One compiled step per kind] relies on: sizes equal in the first call are not
    # tied together (no duck shaping), ints and other sizes reuse the graph, a float is a
    # constant (a float symbol reaching clamp_min would restart the trace: aot_autograd's
    # "total" counts both traces).
    compiled = _compat.compile_symbolic(_blocks_and_clamp, backend="aot_eager")

    def new_graphs(sizes, n, low):
        before = (_compat.dynamo_counters["stats"]["unique_graphs"],
                  _compat.dynamo_counters["aot_autograd"]["total"])
        out = compiled([torch.ones(s) for s in sizes], n, low)
        assert torch.equal(out, _blocks_and_clamp([torch.ones(s) for s in sizes], n, low))
        return (_compat.dynamo_counters["stats"]["unique_graphs"] - before[0],
                _compat.dynamo_counters["aot_autograd"]["total"] - before[1])

    assert new_graphs([8, 8], 3, 0.5) == (1, 1)
    assert new_graphs([8, 12], 3, 0.5) == (0, 0)  # other sizes, equal before
    assert new_graphs([16, 20], 5, 0.5) == (0, 0)  # another int
    assert new_graphs([16, 20], 5, 0.25) == (1, 1)  # another float: a constant


def test_same_layout_compares_symbolic_sizes_without_guards():
    from torch.fx.experimental.symbolic_shapes import (DimDynamic, ShapeEnv,
                                                       StatelessSymbolicContext)

    shape_env = ShapeEnv()
    mode = _compat.FakeTensorMode(shape_env=shape_env)
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 2)
    a = mode.from_tensor(torch.ones(4, 6), symbolic_context=dynamic)
    b = mode.from_tensor(torch.ones(4, 6), symbolic_context=dynamic)  # sizes of their own
    with mode:
        assert _compat.same_layout(a, a.clone())
        assert not _compat.same_layout(a, b)  # not known equal: different
        assert not _compat.same_layout(a, a.t())
        assert not _compat.same_layout(a, a.to(torch.bfloat16))
    assert not shape_env.guards


def test_compile_fresh_keeps_keyword_defaults_and_names():
    def fn(x, *, k=2):
        """doc"""
        return x * k

    compiled = _compat.compile_fresh(fn, backend="eager")
    assert compiled(torch.ones(1)).item() == 2.0
    assert compiled.__wrapped__.__qualname__ == fn.__qualname__
    assert compiled.__wrapped__.__code__ is not fn.__code__


def _scheduled_sgd():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def test_marking_an_optimizer_stepped_is_what_its_schedulers_read():
    # convert.py's step hook: a replaced optimizer's schedulers hear of the fused one's steps.
    opt, sched = _scheduled_sgd()
    with pytest.warns(UserWarning, match=r"before `optimizer.step\(\)`"):
        sched.step()
    opt, sched = _scheduled_sgd()
    _compat.mark_stepped_for_schedulers(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched.step()
