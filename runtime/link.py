"""One side of a pipeline stage boundary on the torch.distributed data plane.

What crosses is a fixed-size int64 header tensor (runtime/link_header.py: format version,
codec, dtype, shape) followed by the codec's payload tensors, sent with point-to-point
isend/irecv. Only tensors cross: nothing is pickled.

gloo moves a message only once the receiver has posted its receive and told the sender so, a
round trip. A receiver that posted the header alone and the payloads once it had read the header
paid that round trip twice per message, the second on the critical path: a whole link round trip
per activation on a cross-region link, which neither the probe's latency nor the emulated wire
priced. So the receiver posts the header and the payloads together, sized as the last message at
that tuple position was (`_received_layout`), and the sender, who keeps the same record
(`_sent_layout`), sends a notice first when a message's payload sizes differ: a header that
announces the next message's layout, with zero payloads of the sizes the receiver posted. A
link's first message, and one after its shape or codec changed, pays the round trip once more;
every other message is received in one. A boundary may carry a tuple of tensors (a hidden state and
a mask, say): each element is one such message, its header saying which of how many it is.
Each element gets the link's codec, which leaves integer and boolean tensors exact; a complex
tensor crosses as its real view and is made complex again on arrival. Sends are asynchronous so the sender's compute goes
on while bytes are on the wire; the executor drains them at the end of a step.

A sealed link (data_plane.encrypt, runtime/sealing.py) sends each message as two tensors instead:
the envelope, then header and payloads sealed together with AES-GCM. Nothing of the message —
not even its shape — crosses in clear, and the receiver checks the announced length against the
link's bound before allocating, then authenticates, then reads the header from the plaintext.
The sealing and the sends run on the link's own thread (runtime/serial_worker.py, in order), so
the stage computes its next micro-batch while the cipher works (it releases the GIL); opening
stays on the receiving thread, which needs the plaintext before it can go on. The receiver posts
the envelope and the sealed bytes together at the plaintext length of the last message at that
tuple position (`_received_sealed`; the first at a position is read envelope first), and a notice,
sealed like any message and of the length the receiver posted, announces a new one.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hetlaunch.runtime import host_clock
from hetlaunch.runtime.codecs import Codec
from hetlaunch.runtime.emulation import WireEmulation
from hetlaunch.runtime.link_header import (HARD_MAX_MESSAGE_BYTES, HEADER_LEN, MAX_TUPLE, Header, Message,
                                           check_message_size, decode_header, encode_header, numel, payload_layout)
from hetlaunch.runtime.sealed_exchange import bytes_tensor, recv_sealed, tensor_bytes
from hetlaunch.runtime.sealing import ENVELOPE_BYTES, TAG_BYTES, Opener, Sealer, SealingError
from hetlaunch.runtime.serial_worker import SerialWorker

@dataclass
class LinkStats:
    raw_bytes: int = 0
    wire_bytes: int = 0
    messages: int = 0
    # Layout notices sent (module docstring), each a round trip more; not in wire_bytes, which
    # counts what the messages themselves took (a notice comes once per change of layout).
    notices: int = 0


@dataclass(frozen=True)
class _Encoded:
    """One element of a message, encoded and checked, not yet sent."""

    tensor: torch.Tensor  # the real view, for a complex tensor
    payloads: list[torch.Tensor]
    header: torch.Tensor
    position: int
    count: int
    complex_: bool


@dataclass
class _Arrived:
    """A message received: what it carries, when an emulated wire delivers it (None: no emulation),
    and per element (sent at, received at, wire bytes) for the link's least transit."""

    message: Message
    due: float | None
    parts: list[tuple[float, float, int]]


class Link:
    """Sends to and receives from one neighbouring rank.

    `send_codec` encodes what this side sends (activations towards the next stage,
    gradients towards the previous one); received tensors are decoded with whatever
    codec their header names. `wire_device` is where the backend wants tensors
    (CPU for gloo, the GPU for NCCL); `device` is where the stage computes.
    """

    def __init__(self, peer_rank: int, send_codec: Codec, device: torch.device, wire_device: torch.device,
                 group: dist.ProcessGroup | None = None, emulation: WireEmulation | None = None,
                 max_message_bytes: int = 0, sealing: tuple[Sealer, Opener] | None = None, tag: int = 0):
        self.peer_rank = peer_rank
        # Messages between two ranks match by tag, in order. A device that holds several stages
        # (runtime/device_schedules.py) may have two boundaries with one peer, e.g. a V's first
        # and last; each boundary's own tag keeps their messages apart.
        self.tag = tag
        self.sealing = sealing  # (what we send, what we receive) when data_plane.encrypt covers the link
        self.send_codec = send_codec
        self.device = device
        self.wire_device = wire_device
        self.group = group
        self.emulation = emulation  # holds what we receive for its emulated time on the wire
        self.stats = LinkStats()
        self.max_message_bytes = max_message_bytes or HARD_MAX_MESSAGE_BYTES
        self._pending: list[tuple[dist.Work, list[torch.Tensor]]] = []
        self._sealing_sends: list[Future] = []  # sealed messages not yet handed to c10d
        self._sealer_thread = SerialWorker(f"seal-to-rank-{peer_rank}") if sealing is not None else None
        # The least transit (seconds, wire bytes) of a message received since the last reset: a
        # message the receiver waited for arrives when the link delivers it, so the least one is
        # the link's own time, without the receiver's lateness or the queue behind earlier messages.
        self.least_transit: tuple[float, int] | None = None
        # Messages received ahead (`expect`), in order, on a thread of the link's own (created when
        # first asked): gloo's irecv never reports itself complete before wait(), so no poll could.
        self._coming: deque[Future] = deque()
        self._receiver: SerialWorker | None = None
        # Payload sizes (bytes) of the last message sent / received at each tuple position (module
        # docstring): the receiver posts these with the header; both sides update them in step.
        self._sent_layout: dict[int, tuple[int, ...]] = {}
        self._received_layout: dict[int, tuple[int, ...]] = {}
        # A sealed link's: the plaintext length of the last message at each position (none yet: the
        # receiver reads the envelope first, as for any sealed message, and learns it).
        self._sent_sealed: dict[int, int] = {}
        self._received_sealed: dict[int, int] = {}

    def retarget(self, send_codec: Codec, max_message_bytes: int) -> None:
        """A live move changed the layer at this boundary: its codec and size bound follow it.
        Messages in flight were drained at the step boundary; the peer decodes by header."""
        self.send_codec = send_codec
        self.max_message_bytes = max_message_bytes or HARD_MAX_MESSAGE_BYTES

    def send(self, message: Message) -> None:
        """Start sending a tensor or a tuple of tensors; returns without waiting for the bytes to leave.
        A tuple is sent whole or not at all: every element is encoded (and so checked) before the
        first leaves, as a refused second element left the receiver holding half a message."""
        if isinstance(message, torch.Tensor):
            self._send_one(self._encoded(message, 0, 0))
            return
        if not 1 <= len(message) <= MAX_TUPLE or not all(isinstance(t, torch.Tensor) for t in message):
            raise TypeError(f"a stage boundary carries a tensor or a tuple of 1 to {MAX_TUPLE} tensors, "
                            f"got {type(message).__name__} of {len(message)}")
        for encoded in [self._encoded(tensor, position, len(message)) for position, tensor in enumerate(message)]:
            self._send_one(encoded)

    def _encoded(self, tensor: torch.Tensor, position: int, count: int) -> _Encoded:
        """The element at tuple `position` as it will cross: raises what cannot (dtype, dims)."""
        tensor = tensor.detach()
        complex_ = tensor.is_complex()
        if complex_:
            tensor = torch.view_as_real(tensor.resolve_conj())
        header = encode_header(self.send_codec, tuple(tensor.shape), tensor.dtype, host_clock.now(), position, count,
                               complex_)
        return _Encoded(tensor, self.send_codec.encode(tensor), header, position, count, complex_)

    def _send_one(self, encoded: _Encoded) -> None:
        tensor, payloads, header, position = encoded.tensor, encoded.payloads, encoded.header, encoded.position
        self.stats.messages += 1
        self.stats.raw_bytes += tensor.numel() * tensor.element_size()
        if self.sealing is not None:
            plain = tensor_bytes([header, *payloads])  # copied now: the caller may reuse its tensors
            posted = self._sent_sealed.get(position)
            if posted is not None and posted != len(plain):  # the receiver posted another length
                self._sealing_sends.append(self._sealer_thread.submit(
                    self._seal_and_send, tensor_bytes([self._notice(encoded)]) + bytes(posted - HEADER_LEN * 8)))
                self.stats.notices += 1
            self._sent_sealed[position] = len(plain)
            self._sealing_sends.append(self._sealer_thread.submit(self._seal_and_send, plain))
            # What crosses: the envelope and the sealed header + payloads + tag.
            self.stats.wire_bytes += ENVELOPE_BYTES + len(plain) + TAG_BYTES
            self._sealing_sends = [f for f in self._sealing_sends if not f.done() or f.exception() is not None]
            return
        # As bytes, as the receiver posts them: NCCL matches a send to a receive by dtype and count.
        to_wire = [p.to(self.wire_device).contiguous().reshape(-1).view(torch.uint8) for p in payloads]
        layout = tuple(p.numel() for p in to_wire)
        posted = self._sent_layout.get(position, ())
        if layout != posted:  # the receiver posted other sizes: tell it this message's first
            self._isend([self._notice(encoded).to(self.wire_device)]
                        + [torch.zeros(size, dtype=torch.uint8, device=self.wire_device) for size in posted])
            self._sent_layout[position] = layout
            self.stats.notices += 1
        self._isend([header.to(self.wire_device)] + to_wire)
        self.stats.wire_bytes += sum(layout)
        self._pending = [(w, ts) for w, ts in self._pending if not w.is_completed()]

    def _notice(self, encoded: _Encoded) -> torch.Tensor:
        """The header that announces `encoded`'s layout (module docstring)."""
        return encode_header(self.send_codec, tuple(encoded.tensor.shape), encoded.tensor.dtype, 0.0, encoded.position,
                             encoded.count, encoded.complex_, notice=True)

    def _isend(self, to_wire: list[torch.Tensor]) -> None:
        for t in to_wire:
            work = dist.isend(t, dst=self.peer_rank, group=self.group, tag=self.tag)
            self._pending.append((work, to_wire))  # the tensors must outlive the send

    def _seal_and_send(self, plain: bytes) -> None:
        """On the link's thread: seal the next message and start sending it (in submission order)."""
        envelope, sealed = self.sealing[0].seal(plain)
        self._isend([bytes_tensor(envelope, self.wire_device), bytes_tensor(sealed, self.wire_device)])

    def expect(self, count: int = 1) -> None:
        """Receive the next `count` messages ahead, in order, on the link's own thread, so their bytes
        move while the stage computes: gloo moves a message only once its receive is posted, and a
        message here is a header and then payloads sized by it, two receives in turn. `recv` takes
        them in order. The executor expects exactly what its step receives, so nothing is left
        waiting on the wire after a step (a receive no message answers would hold the thread)."""
        if count <= 0:
            return
        if self._receiver is None:
            self._receiver = SerialWorker(f"recv-from-rank-{self.peer_rank}")
        for _ in range(count):
            self._coming.append(self._receiver.submit(self._receive))

    def stop_receiving(self) -> bool:
        """Cancel the receives posted ahead that have not begun; whether one is running still."""
        for future in self._coming:
            future.cancel()
        running = any(future.running() for future in self._coming)
        self._coming.clear()
        return running

    def recv(self) -> Message:
        """The peer's next tensor (or tuple) on the compute device: received ahead (`expect`), or
        now; on an emulated wire, not before it is due."""
        if self._coming:
            coming = self._coming[0]
            try:
                arrived = coming.result()
            finally:
                # Still listed while it runs: a wait cut short (an exception raised in this thread,
                # Ctrl-C) must leave stop_receiving seeing it, or the group is torn down under it.
                if coming.done() and self._coming and self._coming[0] is coming:
                    self._coming.popleft()
        else:
            arrived = self._receive()
        wait = arrived.due - host_clock.now() if arrived.due is not None else 0.0
        if wait > 0:  # one reading of the clock: time passes between two (a loaded run once slept "-0.0001 s")
            time.sleep(wait)
        for sent_at, received_at, wire_bytes in arrived.parts:
            transit = max(received_at, arrived.due or 0.0) - sent_at
            if self.least_transit is None or transit < self.least_transit[0]:
                self.least_transit = (transit, wire_bytes)
        return arrived.message

    def ready(self) -> bool:
        """Whether `recv` would return without waiting: the next message is here and, on an emulated
        wire, due. Receives it ahead if nobody asked yet."""
        if not self._coming:
            self.expect(1)
        head = self._coming[0]
        if not head.done():
            return False
        if head.exception() is not None:
            return True  # recv raises it
        due = head.result().due
        return due is None or host_clock.now() >= due

    def _receive(self) -> _Arrived:
        """One whole message: each element's header and payloads, decoded; the emulated wire's
        arrival counted once per element, in order."""
        head, first, part, used = self._recv_one(0, 0)
        parts, due = [part], self._due(head, part)
        if head.count == 0:
            return _Arrived(first, due, parts)
        if head.position != 0:
            raise ValueError(f"link message starts at tuple position {head.position}, not 0")
        items = [first]
        for expected in range(1, head.count):
            more, tensor, part, size = self._recv_one(expected, used)
            used += size
            if (more.position, more.count) != (expected, head.count):
                raise ValueError(f"link tuple out of order: got {more.position} of {more.count}, "
                                 f"expected {expected} of {head.count}")
            items.append(tensor)
            parts.append(part)
            due = self._due(more, part) if due is None else max(due, self._due(more, part))
        return _Arrived(tuple(items), due, parts)

    def _due(self, head: Header, part: tuple[float, float, int]) -> float | None:
        # Sent no later than it was received: a send time the peer put in the future would hold
        # this receiver asleep for as long as it liked.
        return None if self.emulation is None else self.emulation.arrival(min(head.sent_at, part[1]), part[2])

    def _recv_one(self, position: int, used: int) -> tuple[Header, torch.Tensor, tuple[float, float, int], int]:
        """The element at tuple `position` of the message being received, and its size in bytes;
        `used`: the bytes its message's earlier elements took (check_message_size)."""
        receive = self._recv_sealed if self.sealing is not None else self._recv_plain
        head, payloads, size = receive(position, used)
        received_at = host_clock.now()
        wire_bytes = head.codec.wire_bytes(head.shape, head.dtype)
        tensor = head.codec.decode([p.to(self.device) for p in payloads], head.shape, head.dtype)
        tensor = torch.view_as_complex(tensor.contiguous()) if head.complex_ else tensor
        return head, tensor, (head.sent_at, received_at, wire_bytes), size

    def _recv_plain(self, position: int, used: int) -> tuple[Header, list[torch.Tensor], int]:
        """Header and payloads posted together, sized as the last message at this position; after a
        notice (checked against the link's bound before anything is allocated), as it announced."""
        head, raw = self._recv_frame(position)
        if head.notice:
            check_message_size(head, self.max_message_bytes, self.peer_rank, used)
            self._received_layout[position] = payload_layout(head)
            head, raw = self._recv_frame(position)
            if head.notice:
                raise ValueError(f"rank {self.peer_rank} sent two layout notices in a row")
        size = check_message_size(head, self.max_message_bytes, self.peer_rank, used)
        specs = head.codec.payload_specs(head.shape, head.dtype)
        layout = [dtype.itemsize * numel(shape) for shape, dtype in specs]
        if layout != [r.numel() for r in raw]:
            raise ValueError(f"rank {self.peer_rank} sent a message of payload sizes {layout} "
                             f"without announcing them (expected {[r.numel() for r in raw]})")
        return head, [r.view(dtype).reshape(shape) for r, (shape, dtype) in zip(raw, specs)], size

    def _recv_frame(self, position: int) -> tuple[Header, list[torch.Tensor]]:
        # Zeroed, not empty: gloo delivers a shorter message into a posted buffer without saying how
        # much came, so a peer that sends less than its header announces would otherwise hand this
        # process's stale memory to the model (and back to the peer in gradients). A clear link
        # cannot tell; a sealed one can (its envelope's length is authenticated).
        header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=self.wire_device)
        raw = [torch.zeros(size, dtype=torch.uint8, device=self.wire_device)
               for size in self._received_layout.get(position, ())]
        works = [dist.irecv(t, src=self.peer_rank, group=self.group, tag=self.tag) for t in (header, *raw)]
        for work in works:
            work.wait()
        head = decode_header(header.cpu())
        if head.position != position:
            raise ValueError(f"link message at tuple position {head.position}, expected {position}")
        return head, raw

    def _recv_sealed(self, position: int, used: int) -> tuple[Header, list[torch.Tensor], int]:
        """Envelope, then the sealed message (its length checked first), or both at once at the
        length agreed for this position; the header and payloads are read from the authenticated
        plaintext only. A notice, sealed like any message, announces the next length."""
        left = self.max_message_bytes - used
        bound = left + left // 8 + HEADER_LEN * 8 + 2**16  # codec scales
        plain = recv_sealed(self.sealing[1], self.peer_rank, self.group, self.wire_device, bound, self.tag,
                            self._received_sealed.get(position))
        head = _sealed_header(plain)
        size = check_message_size(head, self.max_message_bytes, self.peer_rank, used)
        if head.notice:
            self._received_sealed[position] = HEADER_LEN * 8 + sum(payload_layout(head))
            plain = recv_sealed(self.sealing[1], self.peer_rank, self.group, self.wire_device, bound, self.tag,
                                self._received_sealed[position])
            head = _sealed_header(plain)
            size = check_message_size(head, self.max_message_bytes, self.peer_rank, used)
            if head.notice:
                raise SealingError(f"refused a second layout notice in a row on {self.sealing[1].channel}",
                                   self.sealing[1].channel)
        self._received_sealed[position] = len(plain)
        payloads, offset = [], HEADER_LEN * 8
        for shape, dtype in head.codec.payload_specs(head.shape, head.dtype):
            count = dtype.itemsize * numel(shape)
            if offset + count > len(plain):
                raise SealingError(f"refused a message shorter than its header says on {self.sealing[1].channel}",
                                   self.sealing[1].channel)
            raw = bytes_tensor(plain[offset:offset + count], self.wire_device)
            payloads.append(raw.view(dtype).reshape(shape))
            offset += count
        if offset != len(plain):
            raise SealingError(f"refused a message longer than its header says on {self.sealing[1].channel}",
                               self.sealing[1].channel)
        return head, payloads, size

    def drain(self) -> float:
        """Wait for every send still in flight (sealed ones handed to c10d first); return the seconds
        spent waiting. A sealed send's failure is raised here."""
        start = time.perf_counter()
        for future in self._sealing_sends:
            future.result()
        self._sealing_sends.clear()
        for work, _ in list(self._pending):
            work.wait()
        self._pending.clear()
        return time.perf_counter() - start


def _sealed_header(plain: bytes) -> Header:
    if len(plain) < HEADER_LEN * 8:
        raise SealingError(f"a sealed link message of {len(plain)} bytes is shorter than a header")
    return decode_header(torch.frombuffer(bytearray(plain[:HEADER_LEN * 8]), dtype=torch.int64))
