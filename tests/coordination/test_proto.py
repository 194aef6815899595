"""The checked-in stubs match proto/torchft.proto, and the wire layout matches torchft's."""

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GEN = os.path.join(ROOT, "tools", "gen_proto.py")
STUBS = os.path.join(ROOT, "ft", "coordination", "_proto")


def _gen_module():
    spec = importlib.util.spec_from_file_location("gen_proto", GEN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_checked_in_stubs_match_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    rc = subprocess.run(
        [sys.executable, GEN, "--out", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert rc.returncode == 0, rc.stderr
    fresh = sorted(p.name for p in tmp_path.iterdir())
    assert fresh == sorted(n for n in os.listdir(STUBS) if n.endswith((".py", ".pyi")))
    for name in fresh:
        with open(os.path.join(STUBS, name)) as f:
            assert f.read() == (tmp_path / name).read_text(), (
                f"{name} is stale: run `python tools/gen_proto.py`"
            )
    # --check agrees, and regenerating is idempotent.
    assert subprocess.run([sys.executable, GEN, "--check"], timeout=60).returncode == 0
    assert _gen_module().write(_gen_module().generate(), tmp_path) is False


def test_generated_grpc_module_uses_relative_import():
    with open(os.path.join(STUBS, "torchft_pb2_grpc.py")) as f:
        text = f.read()
    assert "from . import torchft_pb2 as torchft__pb2" in text
    assert "\nimport torchft_pb2" not in text


# torchft's wire layout: message -> {field: (number, type name or label)}.
WIRE = {
    "QuorumMember": {
        "replica_id": 1,
        "address": 2,
        "store_address": 3,
        "step": 4,
        "world_size": 5,
        "shrink_only": 6,
        "data": 7,
        "commit_failures": 8,
    },
    "Quorum": {"quorum_id": 1, "participants": 2, "created": 3},
    "LighthouseQuorumRequest": {"requester": 1},
    "LighthouseQuorumResponse": {"quorum": 1},
    "LighthouseHeartbeatRequest": {"replica_id": 1},
    "ManagerQuorumRequest": {
        "group_rank": 1,
        "step": 2,
        "checkpoint_metadata": 3,
        "shrink_only": 4,
        "init_sync": 5,
        "commit_failures": 6,
    },
    "ManagerQuorumResponse": {
        "quorum_id": 1,
        "recover_src_manager_address": 2,
        "recover_src_replica_rank": 3,
        "recover_dst_replica_ranks": 4,
        "store_address": 5,
        "max_step": 6,
        "max_replica_rank": 7,
        "max_world_size": 8,
        "replica_rank": 9,
        "replica_world_size": 10,
        "heal": 11,
        "commit_failures": 12,
        "replica_ids": 13,
    },
    "CheckpointMetadataRequest": {"rank": 1},
    "CheckpointMetadataResponse": {"checkpoint_metadata": 1},
    "ShouldCommitRequest": {"should_commit": 1, "group_rank": 2, "step": 3},
    "ShouldCommitResponse": {"should_commit": 1},
    "KillRequest": {"msg": 1},
}

# torchft-nightly 2026.10.26's additions for the reconfigure API: message -> {field: (number,
# repeated)}. Its wheel ships no .proto; these numbers are what its compiled client and
# ManagerServer put on the wire (tests/coordination/test_proto_compat.py talks to them).
NIGHTLY_WIRE = {
    "QuorumMember": {"reconfigure_handles": (9, True)},
    "ManagerQuorumRequest": {"reconfigure_handle": (7, False)},
    "ManagerQuorumResponse": {"reconfigure_handles": (14, True)},
}


def test_wire_layout_matches_torchft():
    from google.protobuf.descriptor import FieldDescriptor as F

    from ft.coordination._proto import torchft_pb2 as pb

    assert pb.DESCRIPTOR.package == "torchft"
    for msg, fields in WIRE.items():
        d = pb.DESCRIPTOR.message_types_by_name[msg]
        got = {f.name: f.number for f in d.fields if f.name in fields}
        assert got == fields, msg
    f = pb.QuorumMember.DESCRIPTOR.fields_by_name
    assert f["step"].type == F.TYPE_INT64 and f["world_size"].type == F.TYPE_UINT64
    assert f["commit_failures"].type == F.TYPE_INT64 and f["data"].type == F.TYPE_STRING
    r = pb.ManagerQuorumResponse.DESCRIPTOR.fields_by_name
    assert r["recover_src_replica_rank"].has_presence and r["max_replica_rank"].has_presence
    # torchft keeps adding ManagerQuorumResponse fields after 13: ft's own are numbered from
    # 1000, where torchft's never reach.
    theirs = set(WIRE["ManagerQuorumResponse"]) | set(NIGHTLY_WIRE["ManagerQuorumResponse"])
    ours = {n: f.number for n, f in r.items() if n not in theirs}
    assert ours == {"heal_donors": 1001}
    assert r["heal_donors"].message_type.name == "HealDonor"
    for name in ("quorum_id", "max_step", "replica_rank", "replica_world_size", "max_world_size"):
        assert r[name].type == F.TYPE_INT64
    svc = {s.name: [m.name for m in s.methods] for s in pb.DESCRIPTOR.services_by_name.values()}
    assert svc["LighthouseService"][:2] == ["Quorum", "Heartbeat"]
    assert "SubscribeFailures" in svc["LighthouseService"]
    # torchft's four, then ft's extensions (served by ft only; clients fall back to the four).
    assert svc["ManagerService"][:4] == ["Quorum", "CheckpointMetadata", "ShouldCommit", "Kill"]
    assert svc["ManagerService"][4:] == ["QuorumStream", "ShouldCommitStream"]


def test_wire_layout_matches_torchft_nightly():
    from google.protobuf.descriptor import FieldDescriptor as F

    from ft.coordination._proto import torchft_pb2 as pb

    for msg, fields in NIGHTLY_WIRE.items():
        d = pb.DESCRIPTOR.message_types_by_name[msg].fields_by_name
        for name, (number, repeated) in fields.items():
            f = d[name]
            assert f.number == number and f.type == F.TYPE_STRING, (msg, name)
            assert f.is_repeated == repeated, (msg, name)
            assert number < 1000  # torchft's range, not ft's own
