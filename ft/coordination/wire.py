"""Protobuf messages <-> ft's dataclasses: the one place where the wire format (proto/torchft.proto,
torchft's) meets the types the rest of ft uses (ft/coordination/quorum.py).

Every conversion is total on well-formed messages: optional proto fields become ``None``, and a
member's ``data`` crosses the wire as a JSON string.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import operator
from typing import Any, Callable, Dict

from ._proto import torchft_pb2 as pb
from .quorum import FailureNotification, GroupRequest, Quorum, QuorumMember, QuorumResult

try:  # the native decoder (csrc/grpc_server/quorum_wire.cpp), where it is built
    from ._grpc_server import decode_quorum_response as _native_decode
except ImportError:
    _native_decode = None

__all__ = [
    "member_to_pb",
    "member_from_pb",
    "group_request_to_pb",
    "group_request_from_pb",
    "quorum_to_pb",
    "quorum_from_pb",
    "quorum_from_response",
    "result_to_pb",
    "result_from_pb",
    "notification_from_pb",
]


def _data_to_wire(data: object) -> str:
    """QuorumMember.data → the proto's JSON string ("" for None)."""
    return "" if data is None else json.dumps(data)


def _data_from_wire(text: str) -> object:
    """The proto's JSON string → QuorumMember.data (None for ""; the lighthouse refuses
    requests whose data is not JSON, so a string that is not JSON stays as it is)."""
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def _field_reader(*names: str) -> Callable[[Any], Dict[str, Any]]:
    """Reads the fields ``names`` off a message or a dataclass into a dict: a proto message and
    the dataclass it carries use the same field names, so one list serves both directions.
    (``attrgetter`` reads them all in one C call: members are decoded by the hundred.)"""
    read = operator.attrgetter(*names)
    return lambda obj: dict(zip(names, read(obj)))


# The fields of QuorumMember that cross the wire as they are; ``data`` is JSON on the wire and
# ``reconfigure_handles`` a repeated field (a tuple in the dataclass).
_member_fields = _field_reader(
    "replica_id",
    "address",
    "store_address",
    "step",
    "world_size",
    "shrink_only",
    "commit_failures",
)
# The fields of QuorumResult that cross the wire as they are (the optional ranks, the lists and
# the heal donors are converted in result_to_pb / result_from_pb).
_result_fields = _field_reader(
    "quorum_id",
    "replica_rank",
    "replica_world_size",
    "recover_src_manager_address",
    "store_address",
    "max_step",
    "max_world_size",
    "heal",
    "commit_failures",
)
_group_request_fields = _field_reader(*(f.name for f in dataclasses.fields(GroupRequest)))


def member_to_pb(m: QuorumMember) -> pb.QuorumMember:
    return pb.QuorumMember(
        data=_data_to_wire(m.data), reconfigure_handles=m.reconfigure_handles, **_member_fields(m)
    )


# QuorumMember is a frozen dataclass without __post_init__: its __init__ only stores the fields,
# one object.__setattr__ each. Filling the instance's __dict__ at once builds the same object
# (equal, same hash) in about half the time, which counts where a client decodes a quorum of
# hundreds of members every step.
assert not hasattr(QuorumMember, "__post_init__") and not hasattr(QuorumMember, "__slots__")
_new_member = object.__new__


def member_from_pb(m: pb.QuorumMember) -> QuorumMember:
    # Spelled out rather than through _member_fields: a quarter faster per member, and this
    # runs for every member of every quorum a client decodes in Python.
    member = _new_member(QuorumMember)
    member.__dict__.update(
        replica_id=m.replica_id,
        address=m.address,
        store_address=m.store_address,
        step=m.step,
        world_size=m.world_size,
        shrink_only=m.shrink_only,
        data=_data_from_wire(m.data),
        commit_failures=m.commit_failures,
        reconfigure_handles=tuple(m.reconfigure_handles),
    )
    return member


def group_request_to_pb(r: GroupRequest) -> pb.ManagerQuorumRequest:
    return pb.ManagerQuorumRequest(**_group_request_fields(r))


def group_request_from_pb(r: pb.ManagerQuorumRequest) -> GroupRequest:
    return GroupRequest(**_group_request_fields(r))


def quorum_to_pb(q: Quorum) -> pb.Quorum:
    out = pb.Quorum(quorum_id=q.quorum_id, participants=[member_to_pb(m) for m in q.participants])
    out.created.FromDatetime(q.created)
    return out


def quorum_from_pb(q: pb.Quorum) -> Quorum:
    created = (
        q.created.ToDatetime(tzinfo=_dt.timezone.utc)
        if q.HasField("created")
        else _dt.datetime.now(_dt.timezone.utc)
    )
    return Quorum(
        quorum_id=q.quorum_id,
        participants=tuple([member_from_pb(m) for m in q.participants]),
        created=created,
    )


_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)


def quorum_from_response(data: bytes) -> Quorum:
    """The quorum of a serialized ``LighthouseQuorumResponse``: what a lighthouse client
    returns. Equal to ``quorum_from_pb`` of protobuf's parse; decoded natively where the
    native module is built (a client decodes every member of every quorum, every step),
    else, and for anything unusual, by protobuf (which raises DecodeError on bad bytes)."""
    got = _native_decode(data, QuorumMember, _data_from_wire) if _native_decode else None
    if got is None:
        return quorum_from_pb(pb.LighthouseQuorumResponse.FromString(data).quorum)
    quorum_id, members, created = got
    if created is None:
        when = _dt.datetime.now(_dt.timezone.utc)
    else:  # as protobuf's Timestamp.ToDatetime (microseconds, rounded toward zero)
        when = _EPOCH + _dt.timedelta(seconds=created[0], microseconds=created[1] // 1000)
    return Quorum(quorum_id=quorum_id, participants=members, created=when)


def result_from_pb(r: pb.ManagerQuorumResponse) -> QuorumResult:
    return QuorumResult(
        recover_src_replica_rank=(
            r.recover_src_replica_rank if r.HasField("recover_src_replica_rank") else None
        ),
        recover_dst_replica_ranks=list(r.recover_dst_replica_ranks),
        max_replica_rank=r.max_replica_rank if r.HasField("max_replica_rank") else None,
        replica_ids=list(r.replica_ids),
        heal_donors=[(d.replica_rank, d.manager_address) for d in r.heal_donors],
        reconfigure_handles=list(r.reconfigure_handles),
        **_result_fields(r),
    )


def result_to_pb(r: QuorumResult) -> pb.ManagerQuorumResponse:
    out = pb.ManagerQuorumResponse(
        recover_dst_replica_ranks=r.recover_dst_replica_ranks,
        replica_ids=r.replica_ids,
        reconfigure_handles=r.reconfigure_handles,
        heal_donors=[
            pb.HealDonor(replica_rank=rank, manager_address=addr) for rank, addr in r.heal_donors
        ],
        **_result_fields(r),
    )
    # Optional fields: set only when known (unset reads back as None).
    if r.recover_src_replica_rank is not None:
        out.recover_src_replica_rank = r.recover_src_replica_rank
    if r.max_replica_rank is not None:
        out.max_replica_rank = r.max_replica_rank
    return out


def notification_from_pb(m: pb.FailureNotification) -> FailureNotification:
    return FailureNotification(
        replica_id=m.replica_id,
        error_message=m.error_message,
        quorum_id=m.quorum_id,
        heartbeat_age_s=m.heartbeat_age_s,
        detected=m.detected.ToDatetime(tzinfo=_dt.timezone.utc),
    )
