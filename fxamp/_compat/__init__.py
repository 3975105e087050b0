"""Every private torch API fxamp uses, in one package, gated by torch version where they differ.

fxamp supports torch 2.11 to 2.14 (pyproject.toml). Whatever it needs from torch that is not
public API is reached through here, so that a torch release that moves one is fixed here and
nowhere else (tests/test_compat.py enforces it). One module per torch area; this one re-exports
their names (`from fxamp import _compat; _compat.x`). Each entry says which torch versions it
was checked on ("2.11.0, 2.13.0, 2.14.1": the CI legs, .ci/run).
"""

from __future__ import annotations

import torch

from fxamp._compat.distributed import (active_ddp_module, ddp_bucket_dtypes, fsdp_module_class,
                                       functional_all_reduce, unsharded_class)
from fxamp._compat.dynamo import (BackendCompilerFailed, Unsupported, UserError, aot_autograd,
                                  aot_eager, compile_cache_counters, compile_fresh,
                                  compile_symbolic,
                                  compile_time_metrics, dynamo_counters, dynamo_traces_rnns,
                                  isolated_recompiles)
from fxamp._compat.inductor import (compile_fx, cpp_dtypes, cpu_code_options,
                                    fuse_unrelated_options, inductor_config_keys, list_mode_options, make_boxed_func,
                                    recompute_pointwise_options,
                                    run_and_get_code, without_donated_buffers)
from fxamp._compat.kernels import (foreach_add_, foreach_copy_, scaled_mm, scaled_mm_refusal,
                                   unscale_and_check_)
from fxamp._compat.modules import (COMPILED_CALL_ATTR, ENTER_AUTOCAST, EXIT_AUTOCAST,
                                   NORM_MODULE_TYPES, call_impl, own_tensors, set_compiled_call)
from fxamp._compat.optim import SCHEDULER_SAW_STEP_ATTR, mark_stepped_for_schedulers
from fxamp._compat.tracing import (EXAMPLE_VALUE, FWD_NN_MODULE_STACK, GET_DATA_ATTR,
                                   PARTITIONER_TAG, SEQ_NR, SET_GRAD_ENABLED, FakeTensor,
                                   FakeTensorMode, HigherOrderOperator, OpOverload,
                                   TorchDispatchMode, detect_fake_mode, emit_call,
                                   from_node_names, make_fx, make_fx_tracer, python_dispatcher,
                                   pytree, record_node, rename_node, retrace_subgraph,
                                   same_layout,
                                   size_hint, size_rule_holds, split_returned_input, storage_key,
                                   traced_record)

__all__ = [
    "TORCH_VERSION", "active_ddp_module", "aot_autograd", "aot_eager", "BackendCompilerFailed",
    "call_impl", "compile_cache_counters", "compile_fresh", "compile_symbolic", "compile_fx",
    "cpp_dtypes", "cpu_code_options", "compile_time_metrics", "COMPILED_CALL_ATTR",
    "ddp_bucket_dtypes", "detect_fake_mode",
    "dynamo_counters", "dynamo_traces_rnns", "isolated_recompiles", "emit_call",
    "ENTER_AUTOCAST", "EXAMPLE_VALUE",
    "EXIT_AUTOCAST", "FakeTensor", "FakeTensorMode", "foreach_add_", "foreach_copy_",
    "from_node_names", "fsdp_module_class", "fuse_unrelated_options", "functional_all_reduce",
    "FWD_NN_MODULE_STACK",
    "GET_DATA_ATTR", "HigherOrderOperator", "inductor_config_keys", "list_mode_options",
    "make_boxed_func", "make_fx", "make_fx_tracer", "mark_stepped_for_schedulers",
    "NORM_MODULE_TYPES", "OpOverload", "own_tensors", "PARTITIONER_TAG", "python_dispatcher",
    "pytree",
    "recompute_pointwise_options", "record_node", "rename_node", "retrace_subgraph",
    "run_and_get_code", "same_layout", "scaled_mm", "scaled_mm_refusal",
    "SCHEDULER_SAW_STEP_ATTR", "SEQ_NR", "set_compiled_call", "SET_GRAD_ENABLED", "size_hint",
    "size_rule_holds", "split_returned_input", "storage_key",
    "TorchDispatchMode", "traced_record", "unscale_and_check_", "unsharded_class",
    "Unsupported", "UserError", "without_donated_buffers"
]

TORCH_VERSION: tuple[int, int] = tuple(int(p) for p in torch.__version__.split(".")[:2])
