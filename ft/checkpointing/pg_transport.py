"""PGTransport: sends a state dict over a process group with point-to-point send/recv.

Per destination, in order (all on ``device``, tag 0)::

    sender -> receiver  preamble  int64[5] = [MAGIC, step, header length, CRC32 of the header,
                                              CRC32 of these first four words]
    sender -> receiver  header    uint8[header length]  JSON (serialization.encode_header),
                                  incl. the checksum algorithm of each tensor: CRC-32C for CPU
                                  tensors, a position-weighted 64-bit sum computed on the
                                  device otherwise
    receiver -> sender  ack       int64[2] = [ACK_MAGIC, status]  (0: go on; else refused:
                                  wrong step, corrupt or invalid header)
    sender -> receiver  tensors   each non-empty tensor's bytes, as a flat uint8 view
    sender -> receiver  trailer   int64[n + 1] = the n tensors' checksums, then the CRC32 of
                                  those n words

Checksums travel in the trailer so that both sides compute them while later tensors are still
in flight, instead of adding a full pass over the bytes before and after the transfer.

The ack lets a receiver refuse a transfer cleanly, so that the sender fails at once with a
clear error instead of waiting out its timeout on sends nobody will receive.

Nothing is unpickled; every tensor is verified before the state dict is returned, and a
mismatch raises :class:`CheckpointCorruptError`.
"""

from __future__ import annotations

import json
import logging
import struct
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

import torch

from ft.checkpointing import serialization as ser
from ft.checkpointing import errors
from ft.checkpointing.transport import CheckpointTransport
from ft.utils.deadline import Deadline

T = TypeVar("T")

__all__ = ["PGTransport"]

logger = logging.getLogger(__name__)

MAGIC = 0x66744350  # "ftCP"
ACK_MAGIC = 0x6674414B  # "ftAK"
_REFUSALS = {1: "bad preamble", 2: "wrong step", 3: "header checksum mismatch", 4: "bad header"}
_MAX_HEADER = ser.MAX_HEADER_BYTES  # a receiver refuses a longer header before allocating it
_TAG = 0


_ALGOS = ("crc32c", "wsum")


def _algo(t: torch.Tensor) -> str:
    return "crc32c" if t.device.type == "cpu" else "wsum"


def _checksum(t: torch.Tensor, algo: str) -> int:
    """The checksum of a tensor's bytes as a signed 64-bit value (to fit an int64 tensor)."""
    if t.numel() == 0:
        return 0
    if algo == "crc32c":
        cpu = t if t.device.type == "cpu" else t.to("cpu")
        value = ser.crc32c(ser.memview(cpu))
    else:
        value = ser.torch_checksum(t)
    return value - (1 << 64) if value >= (1 << 63) else value


def _trailer_crc(values: List[int]) -> int:
    return ser.crc32(struct.pack(f"<{len(values)}q", *values))


def _tensor_paths(tree: Any) -> Dict[Tuple[str, ...], int]:
    """Maps the key path of every tensor node in an encoded tree to its tensor index."""
    out: Dict[Tuple[str, ...], int] = {}
    stack: List[Tuple[Any, Tuple[str, ...]]] = [(tree, ())]
    while stack:
        node, path = stack.pop()
        if type(node) is not list or not node:
            continue
        tag = node[0]
        if tag == "T" and len(node) == 2:
            out.setdefault(path, node[1])
        elif tag in ("l", "t") and len(node) == 2 and type(node[1]) is list:
            stack.extend((v, path + (str(i),)) for i, v in enumerate(node[1]))
        elif tag in ("d", "od") and len(node) >= 2 and type(node[1]) is list:
            for kv in node[1]:
                if type(kv) is list and len(kv) == 2:
                    stack.append((kv[1], path + (json.dumps(kv[0]),)))
    return out


class PGTransport(CheckpointTransport[T]):
    """Checkpoint transport over a process group (send/recv).

    ``send_checkpoint`` returns once every receiver acknowledged the state: delivery is
    confirmed (``confirms_delivery``; ``wait_delivered`` has nothing left to wait for).

    Args:
        pg: a process group with ``send``/``recv`` (torch ProcessGroup/backend or ft's).
        timeout: default bound for a transfer.
        device: device the tensors travel on and are received onto (CPU for Gloo, CUDA for
            NCCL).
        state_dict: optional callable returning a template state dict. Received tensors whose
            path, dtype and shape match a contiguous template tensor on ``device`` are received
            in place into it (no extra memory). If verification then fails, those template
            tensors hold unverified bytes: the caller must treat the heal as failed and must
            not use them (the Manager does).
    """

    confirms_delivery = True

    def __init__(
        self,
        pg: Any,
        timeout: timedelta,
        device: torch.device,
        state_dict: Optional[Callable[[], Any]] = None,
    ) -> None:
        self._pg = pg
        self._timeout = timeout
        self._device = torch.device(device)
        self._state_dict = state_dict

    def metadata(self) -> str:
        return "<n/a>"

    def disallow_checkpoint(self) -> None:
        pass

    def _wait(self, works: List[Tuple[Any, str]], deadline: Deadline) -> None:
        for work, what in works:
            remaining = deadline.remaining()
            if remaining <= 0:
                raise errors.CheckpointTransferError(f"{what}: timed out")
            try:
                ok = work.wait(timedelta(seconds=remaining))
            except Exception as e:  # noqa: BLE001 - backends raise RuntimeError/DistBackendError
                raise errors.CheckpointTransferError(f"{what}: {type(e).__name__}: {e}") from None
            if ok is False:
                raise errors.CheckpointTransferError(f"{what}: timed out")

    def send_checkpoint(
        self,
        dst_ranks: List[int],
        step: int,
        state_dict: T,
        timeout: Optional[timedelta] = None,
    ) -> None:
        """Sends ``state_dict`` to every rank in ``dst_ranks``; returns when all is sent.

        Raises TypeError (naming the key path) for values that cannot be sent safely, and
        CheckpointTransferError when a destination fails or the timeout passes.
        """
        deadline = Deadline.after(self._timeout if timeout is None else timeout)
        tree, specs, tensors = ser.flatten(state_dict)
        tensors = [t if t.device == self._device else t.to(self._device) for t in tensors]
        algos = [_algo(t) for t in tensors]
        header = ser.encode_header(tree, specs, step=step, checksums=algos)
        ser.check_header_size(header, len(specs))
        header_t = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(self._device)
        words = [MAGIC, step, len(header), ser.crc32(header)]
        words.append(ser.crc32(struct.pack("<4q", *words)))
        pre = torch.tensor(words, dtype=torch.int64, device=self._device)

        def post(op: Callable[[], Any], what: str) -> Any:
            try:
                return op()
            except Exception as e:  # noqa: BLE001
                raise errors.CheckpointTransferError(f"{what}: {type(e).__name__}: {e}") from None

        heads: List[Tuple[Any, str]] = []
        acks: List[Tuple[int, torch.Tensor, Any, str]] = []
        for dst in dst_ranks:
            what = f"sending checkpoint step {step} to rank {dst}"
            heads.append((post(lambda: self._pg.send([pre], dst, _TAG), what), what))
            heads.append((post(lambda: self._pg.send([header_t], dst, _TAG), what), what))
            ack = torch.zeros(2, dtype=torch.int64, device=self._device)
            acks.append((dst, ack, post(lambda: self._pg.recv([ack], dst, _TAG), what), what))
        refused = []
        for dst, ack, work, what in acks:
            self._wait([(work, what)], deadline)
            magic, status = (int(x) for x in ack.cpu().tolist())
            if magic != ACK_MAGIC or status != 0:
                reason = (
                    _REFUSALS.get(status, f"status {status}")
                    if magic == ACK_MAGIC
                    else ("garbled acknowledgement")
                )
                refused.append(f"rank {dst} refused the checkpoint ({reason})")
        self._wait(heads, deadline)
        accepted = [
            (dst, what)
            for dst, ack, _, what in acks
            if int(ack[0]) == ACK_MAGIC and int(ack[1]) == 0
        ]
        works: List[Tuple[Any, str]] = []
        sums: List[int] = []
        for t, algo in zip(tensors, algos):
            if t.numel():
                b = ser.byte_view(t)
                for dst, what in accepted:
                    works.append((post(lambda: self._pg.send([b], dst, _TAG), what), what))
            sums.append(_checksum(t, algo))  # overlaps with the sends in flight
        sums.append(_trailer_crc(sums))
        trailer = torch.tensor(sums, dtype=torch.int64, device=self._device)
        for dst, what in accepted:
            works.append((post(lambda: self._pg.send([trailer], dst, _TAG), what), what))
        self._wait(works, deadline)
        if refused:
            raise errors.CheckpointTransferError(
                f"sending checkpoint step {step}: " + "; ".join(refused)
            )
        logger.debug(
            "sent checkpoint step=%d bytes=%d to %s", step, sum(s.nbytes for s in specs), dst_ranks
        )

    def recv_checkpoint(
        self, src_rank: int, metadata: str, step: int, timeout: Optional[timedelta] = None
    ) -> T:
        """Receives the checkpoint for ``step`` from ``src_rank``; verifies every tensor.

        Raises:
            CheckpointCorruptError: a checksum did not match (nothing is returned).
            CheckpointNotAvailableError: the sender sent another step.
            CheckpointTransferError: the peer failed or vanished, or the timeout passed.
        """
        deadline = Deadline.after(self._timeout if timeout is None else timeout)
        where = f"receiving checkpoint step {step} from rank {src_rank}"

        def recv(t: torch.Tensor) -> Any:
            try:
                return self._pg.recv([t], src_rank, _TAG)
            except Exception as e:  # noqa: BLE001
                raise errors.CheckpointTransferError(f"{where}: {type(e).__name__}: {e}") from None

        def ack(status: int) -> None:
            a = torch.tensor([ACK_MAGIC, status], dtype=torch.int64, device=self._device)
            try:
                work = self._pg.send([a], src_rank, _TAG)
            except Exception as e:  # noqa: BLE001
                raise errors.CheckpointTransferError(f"{where}: {type(e).__name__}: {e}") from None
            self._wait([(work, where)], deadline)

        pre = torch.zeros(5, dtype=torch.int64, device=self._device)
        self._wait([(recv(pre), where)], deadline)
        words = [int(x) for x in pre.cpu().tolist()]
        magic, got_step, hlen, hcrc, pcrc = words
        if (
            magic != MAGIC
            or pcrc != ser.crc32(struct.pack("<4q", *words[:4]))
            or not 0 < hlen <= _MAX_HEADER
        ):
            ack(1)
            raise errors.CheckpointCorruptError(
                f"{where}: bad preamble (corrupt or not ft's protocol)"
            )
        header_t = torch.empty(hlen, dtype=torch.uint8, device=self._device)
        self._wait([(recv(header_t), where)], deadline)
        if got_step != step:
            ack(2)
            raise errors.CheckpointNotAvailableError(f"{where}: the sender sent step {got_step}")
        header = bytes(ser.memview(header_t.cpu()))
        if ser.crc32(header) != hcrc:
            ack(3)
            raise errors.CheckpointCorruptError(f"{where}: header checksum mismatch")
        try:
            doc, tree, specs = ser.decode_header(header)
            algos = doc.get("checksums")
            if (
                doc.get("step") != step
                or type(algos) is not list
                or len(algos) != len(specs)
                or not all(a in _ALGOS for a in algos)
            ):
                raise errors.CheckpointFormatError(f"{where}: bad header")
            targets = self._targets(tree, specs)
            tensors = [
                targets[i] if i in targets else ser.allocate(s, self._device)
                for i, s in enumerate(specs)
            ]
        except errors.CheckpointError:
            ack(4)
            raise
        ack(0)

        works = [(recv(ser.byte_view(t)), where) if t.numel() else None for t in tensors]
        trailer = torch.zeros(len(specs) + 1, dtype=torch.int64, device=self._device)
        trailer_work = recv(trailer)
        sums: List[int] = []
        for t, work, algo in zip(tensors, works, algos):
            if work is not None:
                self._wait([work], deadline)
            sums.append(_checksum(t, algo))  # overlaps with the tensors still in flight
        self._wait([(trailer_work, where)], deadline)
        expected = [int(x) for x in trailer.cpu().tolist()]
        if _trailer_crc(expected[:-1]) != expected[-1]:
            raise errors.CheckpointCorruptError(
                f"{where}: checksum trailer corrupt; checkpoint discarded"
            )
        for i, (got, want) in enumerate(zip(sums, expected)):
            if got != want:
                raise errors.CheckpointCorruptError(
                    f"{where}: checksum mismatch in tensor {i} ({specs[i].dtype}, "
                    f"{list(specs[i].shape)}); checkpoint discarded"
                )
        out = [ser.finalize(t, s) for t, s in zip(tensors, specs)]
        return ser.unflatten(tree, out)

    def _targets(self, tree: Any, specs: List[ser.TensorSpec]) -> Dict[int, torch.Tensor]:
        """Template tensors to receive into in place, by received tensor index."""
        if self._state_dict is None:
            return {}
        t_tree, t_specs, t_tensors = ser.flatten(self._state_dict())
        t_paths = _tensor_paths(t_tree)
        out: Dict[int, torch.Tensor] = {}
        used = set()
        for path, i in _tensor_paths(tree).items():
            j = t_paths.get(path)
            if j is None or j in used or type(i) is not int or not 0 <= i < len(specs):
                continue
            t, s = t_tensors[j], specs[i]
            if (
                t.device == self._device
                and t.dtype == s.dtype
                and tuple(t.shape) == s.shape
                and t.is_contiguous()
                and s.stride is None
                and not t_specs[j].copied
                and i not in out
            ):
                out[i] = t
                used.add(j)
        return out

    def shutdown(self, wait: bool = True) -> None:
        pass
