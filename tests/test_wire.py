"""The hub's framing: whole messages in order, descriptors with their message, EOF."""

from __future__ import annotations

import os
import pickle
import socket
import threading

import pytest
import torch
from tensordict import TensorDict

from torchrl_batchserve.transport.wire import Wire, dumps, frame


@pytest.fixture
def wires():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ends = Wire(a), Wire(b)
    yield ends
    for end in ends:
        end.close()


def test_messages_split_across_reads_or_sharing_one_arrive_whole_and_in_order(wires):
    left, right = wires
    big = ("req", 3, (3,), None, bytes(range(256)) * 1000)  # larger than one read
    data = frame(("a", 1)) + frame(big) + frame(("b", 2))
    cut = len(frame(("a", 1))) + 7  # the second message's header arrives, its body does not
    left.sock.sendall(data[:cut])
    assert right.read() == [("a", 1)]  # a partial message is kept, not returned
    sender = threading.Thread(target=left.sock.sendall, args=(data[cut:],))  # more than the socket buffers
    sender.start()
    assert [right.recv(), right.recv()] == [big, ("b", 2)]
    sender.join()


def test_a_descriptor_arrives_with_the_message_that_announces_it(wires):
    left, right = wires
    fd = os.memfd_create("wire-test")
    try:
        os.write(fd, b"slot bytes")
        left.send(("first",))
        left.send(("slot", "in"), fds=[fd])
    finally:
        os.close(fd)  # the receiver holds its own copy
    assert right.recv() == ("first",)
    assert right.recv() == ("slot", "in")
    received = right.take_fd()
    try:
        assert os.pread(received, 10, 0) == b"slot bytes"
    finally:
        os.close(received)
    with pytest.raises(EOFError, match="did not come"):
        right.take_fd()


def test_a_closed_peer_ends_a_waiting_recv_with_eof(wires):
    left, right = wires
    left.close()
    with pytest.raises(EOFError):
        right.recv()


def test_a_frame_that_does_not_unpickle_raises_and_the_frames_after_it_still_arrive(wires):
    left, right = wires
    bad = b"\x00\x00\x00\x03abc"  # a whole frame whose payload is not a pickle
    left.sock.sendall(bad + frame(("after",)))
    with pytest.raises(pickle.UnpicklingError):
        right.read()
    left.send(("later",))
    assert right.recv() == ("later",)


def test_tensors_of_every_dtype_and_layout_travel_even_those_whose_pickling_torch_cannot_undo():
    # uint16 (depth images), uint32, uint64, float8 (quantized policies): pickle.loads(pickle.dumps(t)) fails for them.
    dtypes = [getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)]
    values = {}
    for dtype in set(dtypes) - {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}:
        try:
            values[str(dtype)] = torch.arange(6, dtype=torch.uint8).repeat_interleave(dtype.itemsize).view(dtype)
        except RuntimeError:
            continue  # a dtype with no size in bytes (sub-byte, sparse-only)
    assert {"torch.uint16", "torch.uint32", "torch.uint64", "torch.float8_e4m3fn"} <= set(values)
    sent = TensorDict(values, batch_size=[6])
    grad = torch.ones(2, requires_grad=True)
    alone = {
        "float8": values["torch.float8_e5m2"],
        "strided": values["torch.uint16"][::2],
        "expanded": torch.arange(3.0).expand(4, 3),
        "conjugated": torch.tensor([1 + 2j]).conj(),
        "scalar": torch.tensor(7),
        "empty": torch.zeros(0, 3),
        "grad": grad,
    }
    got = pickle.loads(dumps(("req", sent, alone)))
    assert got[0] == "req"
    for key, value in [*sent.items(), *alone.items()]:
        received = (got[1] if key in sent.keys() else got[2])[key]
        assert received.dtype == value.dtype and received.shape == value.shape, key
        flat = [t.resolve_conj().contiguous().reshape(-1).view(torch.uint8) for t in (received, value)]
        assert torch.equal(*flat), key
    assert got[2]["grad"].requires_grad  # pickled as torch pickles it
    received = got[2]["expanded"]
    received.add_(1)  # its own memory, writable
    assert torch.equal(alone["expanded"][0], torch.arange(3.0))


def test_tensors_read_in_inference_mode_are_normal_tensors():
    # A client's reader may be a caller in torch.inference_mode, reading the replies of its other callers too:
    # an inference tensor would refuse their in-place ops outside it.
    with torch.inference_mode():
        td = pickle.loads(dumps(TensorDict(x=torch.arange(3.0), empty=torch.zeros(0))))
    assert not td["x"].is_inference() and not td["empty"].is_inference()
    td["x"].add_(1)
    assert td["x"].tolist() == [1.0, 2.0, 3.0]
