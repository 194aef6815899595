"""Protobuf messages <-> ft's dataclasses: the one place where the wire format (proto/torchft.proto,
torchft's) meets the types the rest of ft uses (ft/coordination/quorum.py).

Every conversion is total on well-formed messages: optional proto fields become ``None``, and a
member's ``data`` crosses the wire as a JSON string.
"""

from __future__ import annotations

import datetime as _dt
import json

from ._proto import torchft_pb2 as pb
from .quorum import FailureNotification, Quorum, QuorumMember, QuorumResult

try:  # the native decoder (csrc/grpc_server/quorum_wire.cpp), where it is built
    from ._grpc_server import decode_quorum_response as _native_decode
except ImportError:
    _native_decode = None

__all__ = [
    "member_to_pb",
    "member_from_pb",
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


def member_to_pb(m: QuorumMember) -> pb.QuorumMember:
    return pb.QuorumMember(
        replica_id=m.replica_id,
        address=m.address,
        store_address=m.store_address,
        step=m.step,
        world_size=m.world_size,
        shrink_only=m.shrink_only,
        data=_data_to_wire(m.data),
        commit_failures=m.commit_failures,
        reconfigure_handles=m.reconfigure_handles,
    )


# QuorumMember is a frozen dataclass without __post_init__: its __init__ only stores the fields,
# one object.__setattr__ each. Filling the instance's __dict__ at once builds the same object
# (equal, same hash) in about half the time, which counts where a client decodes a quorum of
# hundreds of members every step.
assert not hasattr(QuorumMember, "__post_init__") and not hasattr(QuorumMember, "__slots__")
_new_member = object.__new__


def member_from_pb(m: pb.QuorumMember) -> QuorumMember:
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
        quorum_id=r.quorum_id,
        replica_rank=r.replica_rank,
        replica_world_size=r.replica_world_size,
        recover_src_manager_address=r.recover_src_manager_address,
        recover_src_replica_rank=(
            r.recover_src_replica_rank if r.HasField("recover_src_replica_rank") else None
        ),
        recover_dst_replica_ranks=list(r.recover_dst_replica_ranks),
        store_address=r.store_address,
        max_step=r.max_step,
        max_replica_rank=r.max_replica_rank if r.HasField("max_replica_rank") else None,
        max_world_size=r.max_world_size,
        heal=r.heal,
        commit_failures=r.commit_failures,
        replica_ids=list(r.replica_ids),
        heal_donors=[(d.replica_rank, d.manager_address) for d in r.heal_donors],
        reconfigure_handles=list(r.reconfigure_handles),
    )


def result_to_pb(r: QuorumResult) -> pb.ManagerQuorumResponse:
    out = pb.ManagerQuorumResponse(
        quorum_id=r.quorum_id,
        replica_rank=r.replica_rank,
        replica_world_size=r.replica_world_size,
        recover_src_manager_address=r.recover_src_manager_address,
        recover_dst_replica_ranks=r.recover_dst_replica_ranks,
        store_address=r.store_address,
        max_step=r.max_step,
        max_world_size=r.max_world_size,
        heal=r.heal,
        commit_failures=r.commit_failures,
        replica_ids=r.replica_ids,
        reconfigure_handles=r.reconfigure_handles,
        heal_donors=[
            pb.HealDonor(replica_rank=rank, manager_address=addr) for rank, addr in r.heal_donors
        ],
    )
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
