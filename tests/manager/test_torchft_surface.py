"""torchft 0.2.0's public surface, frozen as data: every name exists in ft, and every callable
takes torchft's parameters.

Contract:
* For each torchft module the table lists its public names: module-level functions and
  classes whose names do not start with "_", module-level assignments, and the names that
  ``torchft/__init__.py`` and ``torchft/coordination.py`` re-export. A class is listed with its
  constructor and each public method (``"Class.method"``).
* A value is torchft's parameter names in order (``*args`` / ``**kwargs`` spelled so),
  ``"@property"``, or None (a plain name: only its existence is checked).
* Compatible means: ft's parameters start with torchft's, in torchft's order, and any that
  ft adds after them has a default (or is ``*args`` / ``**kwargs``); or ft's callable takes
  ``(*args, **kwargs)``. Callables whose signature Python cannot read (torch's C++ methods)
  are checked for existence only.
* The table was extracted from torchft 0.2.0's sources with ``ast`` (a class without an
  ``__init__`` takes the constructor of its nearest base defined in the same module; None when
  that base is outside it). It is data: the test needs no torchft.
* Two modules are left out on purpose (``SKIPPED_MODULES``) and two differences are documented
  (``KNOWN_DIFFERENCES``); a test checks that each documented difference is still real.
"""

from __future__ import annotations

import importlib
import inspect
import os
from typing import Dict, List, Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SKIPPED_MODULES: Dict[str, str] = {
    "ft.quantization": (
        "torchft's fused FP8 Triton kernels (CUDA only); ft.collectives quantizes with plain "
        "torch ops (int8 / fp8, blockwise) instead"
    ),
}

KNOWN_DIFFERENCES: Dict[str, str] = {
    "ft.process_group:ProcessGroupGloo": (
        "ft's CPU group is its own backend: (timeout, num_lanes, check_agreement); torchft's "
        "wraps torch's Gloo and also takes pg= (wrap a group with ProcessGroupWrapper instead)"
    ),
    "ft.process_group:ProcessGroupBaby.num_active_work": (
        "ft's Baby groups run in this process (no child to ask); ft's backend exposes no "
        "count of in-flight ops"
    ),
}

# torchft 0.2.0, extracted from its sources (see the module doc). "Class" is the constructor.
TORCHFT_0_2_0: Dict[str, Dict[str, Optional[str]]] = {
    "ft": {
        "DistributedSampler": None,
        "DistributedDataParallel": None,
        "Manager": None,
        "Optimizer": None,
        "setup_logger": None,
        "ProcessGroupBabyNCCL": None,
        "ProcessGroupBabyXCCL": None,
        "ProcessGroupGloo": None,
        "ProcessGroupNCCL": None,
        "ProcessGroupXCCL": None,
    },
    "ft.process_group": {
        "trigger_nccl_fr_trace_through_pipe": "rank",
        "create_store_client": "store_addr timeout",
        "ProcessGroup": "*args **kwargs",
        "ProcessGroup.allgather": "output_tensors input_tensor opts",
        "ProcessGroup.allgather_into_tensor_coalesced": "output_tensors input_tensors opts",
        "ProcessGroup.allreduce": "tensors opts",
        "ProcessGroup.allreduce_coalesced": "tensors opts",
        "ProcessGroup.alltoall_base": (
            "output_buffer input_buffer output_split_sizes input_split_sizes opts"
        ),
        "ProcessGroup.barrier": "opts",
        "ProcessGroup.broadcast": "tensor_list opts",
        "ProcessGroup.broadcast_one": "tensor root",
        "ProcessGroup.recv": "tensors src_rank tag",
        "ProcessGroup.reduce_scatter": "output_tensors input_tensors opts",
        "ProcessGroup.reduce_scatter_tensor_coalesced": "output_tensors input_tensors opts",
        "ProcessGroup.send": "tensors dst_rank tag",
        "ProcessGroup.configure": "store_addr replica_id rank world_size",
        "ProcessGroup.size": "",
        "ProcessGroup.getBackendName": "",
        "ProcessGroup.register": "name",
        "ProcessGroup.group_name": "@property",
        "ProcessGroup.unregister": "",
        "ProcessGroup.abort": "",
        "ProcessGroup.shutdown": "",
        "ProcessGroup.errored": "",
        "ProcessGroup.set_timeout": "timeout",
        "ProcessGroupWrapper": "timeout pg",
        "ProcessGroupWrapper.getBackendName": "",
        "ProcessGroupWrapper.configure": "store_addr replica_id rank world_size",
        "ProcessGroupWrapper.abort": "errored",
        "ProcessGroupWrapper.shutdown": "",
        "ProcessGroupWrapper.set_timeout": "timeout",
        "ProcessGroupWrapper.allgather": "output_tensors input_tensor opts",
        "ProcessGroupWrapper.allgather_into_tensor_coalesced": (
            "output_tensors input_tensors opts"
        ),
        "ProcessGroupWrapper.allreduce": "tensors opts",
        "ProcessGroupWrapper.allreduce_coalesced": "tensors opts",
        "ProcessGroupWrapper.alltoall_base": (
            "output_buffer input_buffer output_split_sizes input_split_sizes opts"
        ),
        "ProcessGroupWrapper.barrier": "opts",
        "ProcessGroupWrapper.broadcast": "tensor_list opts",
        "ProcessGroupWrapper.recv": "tensors src_rank tag",
        "ProcessGroupWrapper.reduce_scatter": "output_tensors input_tensors opts",
        "ProcessGroupWrapper.reduce_scatter_tensor_coalesced": (
            "output_tensors input_tensors opts"
        ),
        "ProcessGroupWrapper.send": "tensors dst_rank tag",
        "ProcessGroupWrapper.size": "",
        "ProcessGroupWrapper.parent": "@property",
        "ProcessGroupGloo": "timeout pg",
        "ProcessGroupGloo.getBackendName": "",
        "ProcessGroupGloo.reduce_scatter": "output_tensors input_tensors opts",
        "ProcessGroupGloo.reduce_scatter_tensor_coalesced": "output_tensors input_tensors opts",
        "ProcessGroupNCCL": "timeout",
        "ProcessGroupNCCL.abort": "errored",
        "ProcessGroupNCCL.errored": "",
        "ProcessGroupNCCL.getBackendName": "",
        "ProcessGroupXCCL": "timeout",
        "ProcessGroupXCCL.abort": "errored",
        "ProcessGroupXCCL.errored": "",
        "ProcessGroupXCCL.getBackendName": "",
        "ProcessGroupDummy": "rank world",
        "ProcessGroupDummy.configure": "store_addr replica_id rank world_size",
        "ProcessGroupDummy.allgather": "output_tensors input_tensor opts",
        "ProcessGroupDummy.allgather_into_tensor_coalesced": "output_tensors input_tensors opts",
        "ProcessGroupDummy.allreduce": "tensors opts",
        "ProcessGroupDummy.allreduce_coalesced": "tensors opts",
        "ProcessGroupDummy.alltoall_base": (
            "output_buffer input_buffer output_split_sizes input_split_sizes opts"
        ),
        "ProcessGroupDummy.barrier": "opts",
        "ProcessGroupDummy.broadcast": "tensor_list opts",
        "ProcessGroupDummy.recv": "tensors src_rank tag",
        "ProcessGroupDummy.reduce_scatter": "output_tensors input_tensors opts",
        "ProcessGroupDummy.reduce_scatter_tensor_coalesced": "output_tensors input_tensors opts",
        "ProcessGroupDummy.send": "tensors dst_rank tag",
        "ProcessGroupDummy.size": "",
        "ProcessGroupDummy.getBackendName": "",
        "ErrorSwallowingProcessGroupWrapper": "pg",
        "ErrorSwallowingProcessGroupWrapper.configure": "store_addr replica_id rank world_size",
        "ErrorSwallowingProcessGroupWrapper.report_error": "e",
        "ErrorSwallowingProcessGroupWrapper.error": "",
        "ErrorSwallowingProcessGroupWrapper.allreduce": "tensors opts",
        "FakeProcessGroupWrapper": "pg",
        "FakeProcessGroupWrapper.configure": "store_addr replica_id rank world_size",
        "FakeProcessGroupWrapper.report_future_error": "e",
        "FakeProcessGroupWrapper.allreduce": "tensors opts",
        "ManagedProcessGroup": "manager",
        "ManagedProcessGroup.allreduce": "tensors opts",
        "ManagedProcessGroup.size": "",
        "ManagedProcessGroup.getBackendName": "",
        "ProcessGroupBaby": "timeout",
        "ProcessGroupBaby.shutdown": "",
        "ProcessGroupBaby.configure": "store_addr replica_id rank world_size",
        "ProcessGroupBaby.allgather": "output_tensors input_tensor opts",
        "ProcessGroupBaby.allgather_into_tensor_coalesced": "output_tensors input_tensors opts",
        "ProcessGroupBaby.allreduce": "tensors opts",
        "ProcessGroupBaby.allreduce_coalesced": "tensors opts",
        "ProcessGroupBaby.alltoall_base": (
            "output_buffer input_buffer output_split_sizes input_split_sizes opts"
        ),
        "ProcessGroupBaby.barrier": "opts",
        "ProcessGroupBaby.broadcast": "tensor_list opts",
        "ProcessGroupBaby.recv": "tensors src_rank tag",
        "ProcessGroupBaby.reduce_scatter": "output_tensors input_tensors opts",
        "ProcessGroupBaby.reduce_scatter_tensor_coalesced": "output_tensors input_tensors opts",
        "ProcessGroupBaby.send": "tensors dst_rank tag",
        "ProcessGroupBaby.size": "",
        "ProcessGroupBaby.num_active_work": "",
        "ProcessGroupBaby.set_timeout": "timeout",
        "ProcessGroupBabyGloo": "timeout",
        "ProcessGroupBabyGloo.getBackendName": "",
        "ProcessGroupBabyGloo.reduce_scatter": "output_tensors input_tensors opts",
        "ProcessGroupBabyGloo.reduce_scatter_tensor_coalesced": (
            "output_tensors input_tensors opts"
        ),
        "ProcessGroupBabyNCCL": "timeout",
        "ProcessGroupBabyNCCL.getBackendName": "",
        "ProcessGroupBabyXCCL": "timeout",
        "ProcessGroupBabyXCCL.getBackendName": "",
    },
    "ft.manager": {
        "get_timeout": "timeout_sec_env default_timeout_sec",
        "WorldSizeMode": None,
        "ExceptionWithTraceback": "e",
        "Manager": (
            "pg load_state_dict state_dict min_replica_size use_async_quorum timeout "
            "quorum_timeout connect_timeout rank world_size world_size_mode "
            "store_addr store_port lighthouse_addr replica_id port hostname "
            "heartbeat_interval checkpoint_transport init_sync max_retries "
            "quorum_retries"
        ),
        "Manager.allow_state_dict_read": "",
        "Manager.disallow_state_dict_read": "",
        "Manager.register_state_dict_fn": "key load_state_dict state_dict",
        "Manager.set_state_dict_fns": "load_state_dict state_dict",
        "Manager.shutdown": "wait",
        "Manager.allreduce": "tensor should_quantize reduce_op",
        "Manager.report_error": "e",
        "Manager.errored": "",
        "Manager.wrap_future": "fut default timeout",
        "Manager.start_quorum": "allow_heal shrink_only timeout",
        "Manager.wait_quorum": "",
        "Manager.should_commit": "timeout",
        "Manager.load_state_dict": "state_dict",
        "Manager.state_dict": "",
        "Manager.current_step": "",
        "Manager.batches_committed": "",
        "Manager.participating_rank": "",
        "Manager.num_participants": "",
        "Manager.is_participating": "",
    },
    "ft.local_sgd": {
        "extract_local_tensor": "t",
        "LocalSGD": "manager model optimizer sync_every",
        "LocalSGD.sync": "",
        "DiLoCo": (
            "manager model_fragments inner_optimizer outer_optimizer sync_every "
            "backup_device pin_memory use_bucketization bucket_cap_mb should_quantize "
            "fragment_sync_delay fragment_update_alpha"
        ),
    },
    "ft.ddp": {
        "DistributedDataParallel": "manager module **kwargs",
        "PureDistributedDataParallel": "manager module",
        "PureDistributedDataParallel.forward": "*args",
    },
    "ft.optim": {
        "OptimizerWrapper": "manager optim",
        "OptimizerWrapper.add_param_group": "param_group",
        "OptimizerWrapper.load_state_dict": "state_dict",
        "OptimizerWrapper.state_dict": "",
        "OptimizerWrapper.zero_grad": "set_to_none",
        "OptimizerWrapper.step": "closure",
        "OptimizerWrapper.param_groups": "@property",
        "OptimizerWrapper.state": "@property",
    },
    "ft.data": {
        "DistributedSampler": (
            "dataset replica_rank num_replica_groups group_rank num_replicas **kwargs"
        ),
    },
    "ft.checkpointing": {
        "HTTPTransport": None,
        "CheckpointTransport": None,
    },
    "ft.checkpointing.http_transport": {
        "HTTPTransport": "timeout num_chunks",
        "HTTPTransport.address": "",
        "HTTPTransport.disallow_checkpoint": "",
        "HTTPTransport.allow_checkpoint": "step",
        "HTTPTransport.shutdown": "wait",
        "HTTPTransport.metadata": "",
        "HTTPTransport.send_checkpoint": "dst_ranks step state_dict timeout",
        "HTTPTransport.recv_checkpoint": "src_rank metadata step timeout",
    },
    "ft.checkpointing.pg_transport": {
        "PGTransport": "pg timeout device state_dict",
        "PGTransport.metadata": "",
        "PGTransport.disallow_checkpoint": "",
        "PGTransport.send_checkpoint": "dst_ranks step state_dict timeout",
        "PGTransport.recv_checkpoint": "src_rank metadata step timeout",
    },
    "ft.checkpointing.transport": {
        "CheckpointTransport": None,
        "CheckpointTransport.metadata": "",
        "CheckpointTransport.send_checkpoint": "dst_ranks step state_dict timeout",
        "CheckpointTransport.disallow_checkpoint": "",
        "CheckpointTransport.recv_checkpoint": "src_rank metadata step timeout",
        "CheckpointTransport.shutdown": "wait",
    },
    "ft.collectives": {
        "get_padded_sizes": "tensors world_size",
        "allocate_reduce_scatter_output": "tensors world_size",
        "reduce_scatter_quantized": "output inputs opts process_group sync_stream",
        "allreduce_quantized": "tensors opts process_group sync_stream",
    },
    "ft.futures": {
        "future_timeout": "fut timeout",
        "future_wait": "fut timeout",
        "stream_timeout": "callback timeout",
        "context_timeout": "callback timeout",
    },
    "ft.work": {},
    "ft.coordination": {
        "LighthouseClient": None,
        "LighthouseServer": None,
        "ManagerClient": None,
        "ManagerServer": None,
        "Quorum": None,
        "QuorumMember": None,
    },
    "ft.device_mesh": {
        "extend_device_mesh": "mesh pg name dim",
        "ManagedDeviceMesh": "mesh mesh_dim_names replicate_pg replicate_dim parent",
        "ManagedDeviceMesh.get_group": "mesh_dim",
        "ManagedDeviceMesh.size": "mesh_dim",
        "ManagedDeviceMesh.ndim": "@property",
        "ManagedDeviceMesh.shape": "@property",
        "ManagedDeviceMesh.get_rank": "",
        "ManagedDeviceMesh.get_local_rank": "mesh_dim",
        "ManagedDeviceMesh.get_coordinate": "",
        "ManagedDeviceMesh.get_all_groups": "",
        "ft_init_device_mesh": "device_type mesh_shape mesh_dim_names replicate_dim manager",
    },
    "ft.parameter_server": {
        "ParameterServer": "port store_port",
        "ParameterServer.address": "",
        "ParameterServer.new_process_group": "",
        "ParameterServer.new_session": "address",
        "ParameterServer.forward": "session_id pg",
    },
    "ft.quantization": {
        "fused_quantize_into_fp8": "inputs all_reduce_group_size",
        "fused_dequantize_from_fp8": "inputs output all_reduce_group_size",
        "fused_reduce_fp8": "inputs output all_reduce_group_size all_reduce_rank reduce_op",
    },
}


def _spelled(p: inspect.Parameter) -> str:
    if p.kind is p.VAR_POSITIONAL:
        return "*" + p.name
    if p.kind is p.VAR_KEYWORD:
        return "**" + p.name
    return p.name


def _incompatibility(expected: str, params: List[inspect.Parameter]) -> Optional[str]:
    """None when ``params`` (ft's, self excluded) accept torchft's ``expected`` names."""
    want = expected.split()
    got = [_spelled(p) for p in params]
    if got == ["*args", "**kwargs"]:
        return None
    if got[: len(want)] != want:
        return f"torchft takes ({', '.join(want)}), ft takes ({', '.join(got)})"
    for p in params[len(want) :]:
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            return f"ft adds {p.name!r} after torchft's parameters without a default"
    return None


def _params_of_method(cls: type, name: str) -> Optional[List[inspect.Parameter]]:
    raw = inspect.getattr_static(cls, name)
    try:
        params = list(inspect.signature(getattr(cls, name)).parameters.values())
    except (TypeError, ValueError):  # C++ (pybind) methods carry no readable signature
        return None
    if isinstance(raw, (staticmethod, classmethod)):
        return params  # a classmethod read from its class is bound already
    return params[1:]  # self


def _check(module_name: str, key: str, expected: Optional[str]) -> Optional[str]:
    """None when ft's ``module_name`` honours the entry ``key``; else what is wrong."""
    module = importlib.import_module(module_name)
    owner_name, _, method = key.partition(".")
    if not hasattr(module, owner_name):
        return "missing"
    owner = getattr(module, owner_name)
    if method:
        if not hasattr(owner, method):
            return "missing"
        if expected is None or expected == "@property":
            return None
        params = _params_of_method(owner, method)
    else:
        if expected is None:
            return None
        try:
            params = list(inspect.signature(owner).parameters.values())
        except (TypeError, ValueError):
            return None
    if params is None:
        return None
    return _incompatibility(expected, params)


@pytest.mark.parametrize("module_name", sorted(TORCHFT_0_2_0))
def test_every_torchft_name_exists_with_its_parameters(module_name: str) -> None:
    if module_name in SKIPPED_MODULES:
        pytest.skip(f"{module_name} is not ported: {SKIPPED_MODULES[module_name]}")
    problems = []
    for key, expected in TORCHFT_0_2_0[module_name].items():
        if f"{module_name}:{key}" in KNOWN_DIFFERENCES:
            continue
        problem = _check(module_name, key, expected)
        if problem is not None:
            problems.append(f"{module_name}.{key}: {problem}")
    assert not problems, "torchft 0.2.0 compatibility:\n" + "\n".join(problems)


@pytest.mark.parametrize("entry", sorted(KNOWN_DIFFERENCES))
def test_known_differences_are_still_real(entry: str) -> None:
    # A documented difference that ft no longer has must leave the list.
    module_name, key = entry.split(":")
    assert _check(module_name, key, TORCHFT_0_2_0[module_name][key]) is not None, (
        f"{entry} now matches torchft: remove it from KNOWN_DIFFERENCES"
    )


def test_the_table_covers_the_new_modules() -> None:
    # The modules this port added are in the table, with their names.
    assert set(TORCHFT_0_2_0["ft.futures"]) == {
        "future_timeout",
        "future_wait",
        "stream_timeout",
        "context_timeout",
    }
    assert "ParameterServer.forward" in TORCHFT_0_2_0["ft.parameter_server"]
    assert "ExceptionWithTraceback" in TORCHFT_0_2_0["ft.manager"]


def test_new_top_level_names_resolve_lazily() -> None:
    import ft
    from ft.otel import setup_logger
    from ft.process_group import ProcessGroupBabyNCCL, ProcessGroupBabyXCCL, ProcessGroupXCCL

    assert ft.setup_logger is setup_logger
    assert ft.ProcessGroupXCCL is ProcessGroupXCCL
    assert ft.ProcessGroupBabyNCCL is ProcessGroupBabyNCCL
    assert ft.ProcessGroupBabyXCCL is ProcessGroupBabyXCCL


def test_setup_logger_needs_no_torch() -> None:
    # ft.setup_logger is a control-plane name: resolving it must not import torch.
    import subprocess
    import sys

    code = "import sys, ft; ft.setup_logger('x'); assert 'torch' not in sys.modules, 'torch'"
    env = {k: v for k, v in os.environ.items() if k != "TORCHFT_USE_OTEL"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr


def test_coordination_classes_document_their_arguments() -> None:
    # torchft documents each coordination class with an "Args:" section, and its suite checks
    # it (coordination_test.py); help() on ft's classes must say as much.
    from ft.coordination import (
        LighthouseClient,
        LighthouseServer,
        ManagerClient,
        ManagerServer,
        Quorum,
        QuorumMember,
    )

    for cls in (
        ManagerClient,
        ManagerServer,
        LighthouseServer,
        LighthouseClient,
        Quorum,
        QuorumMember,
    ):
        assert "Args:" in (cls.__doc__ or ""), cls


def test_coordination_clients_show_and_check_their_arguments_yet_autospec_like_torchft() -> None:
    # torchft's clients are Rust classes built by their __new__: mock.patch(autospec=True), which
    # checks a class's calls against its __init__, accepts any call of them, and torchft's own
    # tests reach the instance mock with client_mock(). ft's are built by __new__ too: the same
    # holds, while help() and Python still name and require addr and connect_timeout.
    from unittest import mock

    from ft.coordination import LighthouseClient, ManagerClient

    for cls in (ManagerClient, LighthouseClient):
        params = inspect.signature(cls).parameters
        assert list(params)[:2] == ["addr", "connect_timeout"], cls
        assert all(
            params[p].default is inspect.Parameter.empty for p in ("addr", "connect_timeout")
        )
        with pytest.raises(TypeError, match="'addr'"):
            cls()  # type: ignore[call-arg]
        with pytest.raises(TypeError, match="'connect_timeout'"):
            cls("localhost:1")  # type: ignore[call-arg]

    with mock.patch("ft.manager.ManagerClient", autospec=True) as client_mock:
        import ft.manager

        instance = client_mock()
        assert ft.manager.ManagerClient("localhost:1", connect_timeout=1.0) is instance
        with pytest.raises(TypeError):
            instance._quorum(0)  # the methods' signatures are still checked
