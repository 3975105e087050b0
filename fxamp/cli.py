"""`python -m fxamp explain TARGET`: print what fxamp does to a model, from the shell.

TARGET is "package.module:factory", a zero-argument callable returning
`(model, example_inputs)` with `example_inputs` a tuple; the module is looked up in the
current directory first, then on PYTHONPATH. For example:

    python -m fxamp explain examples.models:mlp --opt-level O2 --backward

`--view` shows the graphs in Google's Model Explorer instead of printing them, `--save FILE`
writes that view to a file, and `python -m fxamp view FILE` shows a saved one (docs/explain.md,
"In a graph viewer").

Exit status: 0 after printing the report; 2 for bad input (a target that cannot be loaded, or
an option fxamp refuses, with fxamp's ConfigError message); 1 when fxamp refuses the model
(an FxampError such as BannedOpError, whose message names the node and the fix). Either error
is one line on stderr; anything else is a bug in the model or in fxamp and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any, Optional, Sequence

import torch

from fxamp.model.compiled_call import fxamp_error
from fxamp.config import OPT_LEVELS, AmpConfig
from fxamp.errors import ConfigError, FxampError
from fxamp.debug.locate import locate_overflow
from fxamp.explain import explain
from fxamp.policy import PRESETS
from fxamp.viewer import ViewerMissing, show
from fxamp.viewer.saved import check_writable, read_view
from fxamp.viewer.server import check_installed, check_port

__all__ = ["main", "build_parser", "load_target", "TargetError"]

_PROG = "python -m fxamp"


class TargetError(ValueError):
    """TARGET does not name a factory returning (model, example_inputs)."""


class _Parser(argparse.ArgumentParser):
    # argparse prints the whole usage before its error; one line is easier to read in CI logs.
    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _pair(text: str) -> tuple[str, str]:
    key, sep, value = text.rpartition("=")
    if not sep or not key or not value:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=POLICY")
    return key, value


def _add_explain(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "explain", help="print the graphs and per-op dtypes fxamp produces for a model",
        description="Run TARGET's model once under fxamp (eagerly, no Inductor) and print "
                    "fxamp.explain(...).")
    p.add_argument("target", metavar="TARGET",
                   help='"package.module:factory", a zero-argument callable returning '
                        "(model, example_inputs_tuple)")
    p.add_argument("--opt-level", default="O1", metavar="|".join(OPT_LEVELS),
                   help="Apex opt level, letter O (default: O1)")
    p.add_argument("--dtype", choices=("bf16", "fp16"),
                   help="low-precision dtype (default: fp16 on CUDA, bf16 elsewhere)")
    p.add_argument("--policy", choices=tuple(PRESETS),
                   help="op-table preset (default: the torch preset of the device)")
    p.add_argument("--keep-batchnorm-fp32", metavar="True|False",
                   help="O2/O3: keep BatchNorm in fp32 (refused with O1, as in Apex)")
    p.add_argument("--module-override", type=_pair, action="append", default=[],
                   metavar="PATTERN=POLICY",
                   help="module path glob or class name -> lower|fp32|promote|keep; repeatable")
    p.add_argument("--op-override", type=_pair, action="append", default=[],
                   metavar="OP=POLICY",
                   help="ATen op like aten.softmax or aten.softmax.int -> policy; repeatable")
    p.add_argument("--backward", action="store_true",
                   help="also run backward and print the backward graphs")
    p.add_argument("--ranges", action="store_true",
                   help="also measure every op's values against the fp16 limits "
                        "(fxamp.range_stats)")
    p.add_argument("--locate-overflow", action="store_true",
                   help="with --view or --save: also run fxamp.locate_overflow on the inputs "
                        "and mark the op that produced the first inf/NaN")
    p.add_argument("--view", action="store_true",
                   help='show the graphs in Model Explorer (pip install "fxamp[viewer]") on '
                        "127.0.0.1 until Ctrl+C, instead of printing the report")
    p.add_argument("--save", metavar="FILE",
                   help="write the graph view to FILE (JSON) for `python -m fxamp view FILE`")
    _add_server_options(p)


def _add_server_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, help="port of the viewer (default: a free one)")
    p.add_argument("--no-browser", action="store_true",
                   help="do not open the viewer's page in a web browser")


def _add_view(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "view", help="show a graph view saved with --save or Explanation.save in Model Explorer",
        description='Serve FILE with Model Explorer (pip install "fxamp[viewer]") on '
                    "127.0.0.1 until Ctrl+C.")
    p.add_argument("file", metavar="FILE", help="a view written by --save or .save(path)")
    _add_server_options(p)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=_PROG, description="fxamp: Apex-style mixed precision as FX passes.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                       parser_class=_Parser)
    _add_explain(subparsers)
    _add_view(subparsers)
    return parser


def _import(module_name: str) -> Any:
    # `python -m fxamp` puts the current directory on sys.path; the `fxamp` script does not.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and (module_name + ".").startswith(e.name + "."):
            raise TargetError(f"cannot import {module_name!r}: no module named {e.name!r} "
                              "(run from the directory that holds it, or set PYTHONPATH)") from e
        raise  # the module exists but one of its own imports failed


def load_target(spec: str) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """Import "package.module:factory", call it, and check it returned (model, inputs)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise TargetError(f"TARGET {spec!r} is not 'package.module:factory'")
    factory = getattr(_import(module_name), attr, None)
    if not callable(factory):
        raise TargetError(f"{module_name!r} has no callable {attr!r}")
    result = factory()
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], tuple)):
        raise TargetError(f"{spec}() returned {type(result).__name__}, not "
                          "(model, example_inputs_tuple)")
    return result


def _config(args: argparse.Namespace) -> AmpConfig:
    options = dict(dtype=args.dtype, policy=args.policy,
                   keep_batchnorm_fp32=args.keep_batchnorm_fp32,
                   module_overrides=dict(args.module_override),
                   op_overrides=dict(args.op_override))
    return AmpConfig.from_opt_level(args.opt_level, **{
        k: v for k, v in options.items() if v not in (None, {})})


def _show(view: Any, args: argparse.Namespace) -> str:
    viewer = show(view, port=args.port, open_browser=not args.no_browser, wait=False)
    try:  # Ctrl+C, whenever it comes, stops the server and exits 0
        sys.stdout.write(f"Model Explorer at {viewer.url}\n(Ctrl+C stops it)\n")
        sys.stdout.flush()
        viewer.wait()
    except KeyboardInterrupt:
        pass
    finally:
        viewer.stop()
    return ""


_FREE = "leave --port out"  # a free port, in the shell's words (the Python API's is port=None)


def _check_outputs(args: argparse.Namespace) -> None:
    # where the view goes, checked before the model runs: a typo costs no model setup
    if args.save:
        check_writable(args.save)
    if args.view:
        check_port(args.port, free=_FREE)  # the user's value first: it needs no install
        check_installed()


def _run_explain(args: argparse.Namespace) -> str:
    if args.locate_overflow and not (args.view or args.save):
        raise TargetError("--locate-overflow marks the op in the graph view: add --view or "
                          "--save FILE")
    _check_outputs(args)
    config = _config(args)  # before importing TARGET: a typo fails fast, not after model setup
    model, inputs = load_target(args.target)
    report = explain(model, *inputs, config=config, backward=args.backward,
                     ranges=args.ranges)
    if not (args.view or args.save):
        return str(report)
    overflow = locate_overflow(model, inputs, config=config) if args.locate_overflow else None
    view = report.graph_view(overflow=overflow)
    out = f"saved {view.save(args.save)}" if args.save else ""
    return _show(view, args) if args.view else out


def _run_view(args: argparse.Namespace) -> str:
    read_view(args.file)
    check_port(args.port, free=_FREE)  # the user's value first: it needs no install
    check_installed()
    return _show(args.file, args)


def _refusal(error: BaseException) -> Optional[FxampError]:
    # fxamp's own refusals (a banned op, batch_norm statistics it cannot cast), unwrapped from
    # Dynamo's BackendCompilerFailed. An FxampError wrapping another exception is an internal
    # failure: it keeps its traceback.
    error = fxamp_error(error)
    return error if isinstance(error, FxampError) and error.__cause__ is None else None


def _fail(parser: argparse.ArgumentParser, status: int, error: BaseException) -> None:
    parser.exit(status, f"{_PROG}: error: {' '.join(str(error).split())}\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of `python -m fxamp`; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        report = _run_explain(args) if args.command == "explain" else _run_view(args)
    except (TargetError, ConfigError, ViewerMissing) as e:
        _fail(parser, 2, e)
    except Exception as e:
        refusal = _refusal(e)
        if refusal is None:
            raise
        _fail(parser, 1, refusal)
    if report:
        sys.stdout.write(report + "\n")
    return 0
