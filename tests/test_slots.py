"""Shared-memory slots: what fits them, and writes that copy every kind of tensor faithfully."""

from __future__ import annotations

import os

import pytest
import torch

from torchrl_batchserve.transport.slots import Headers, Slot


@pytest.fixture
def slot():
    made, fd = Slot.create([("x", torch.float32, (3,)), ("z", torch.complex64, ()), ("n", torch.int64, ())], 4)
    made = Slot.attach(made.fields, made.capacity, made.size, fd)  # the peer's mapping, as a worker has it
    return made


def values(rows: int, batch_shape: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rows)
    return [
        torch.randn((*batch_shape, 3), generator=g),
        torch.randn(batch_shape, dtype=torch.complex64, generator=g),
        torch.randint(0, 100, batch_shape, generator=g),
    ]


@pytest.mark.parametrize("batch_shape", [(), (4,), (2, 2)])
def test_fits_takes_the_slots_shapes_and_dtypes_only(slot, batch_shape):
    rows = 1
    for d in batch_shape:
        rows *= d
    good = values(rows, batch_shape)
    assert slot.fits(good, rows, batch_shape)
    x, z, n = good
    assert not slot.fits([x, z], rows, batch_shape)  # a value missing
    assert not slot.fits([x.double(), z, n], rows, batch_shape)  # another dtype
    assert not slot.fits([x[..., :2], z, n], rows, batch_shape)  # another feature shape
    assert not slot.fits([x.unsqueeze(0), z, n], rows, batch_shape)  # another batch shape
    assert not slot.fits([x.to_sparse(), z, n], rows, batch_shape)  # not strided
    assert not slot.fits([x.tolist(), z, n], rows, batch_shape)  # not a tensor
    assert not slot.fits(values(8, (8,)), 8, (8,))  # more rows than the slot holds


def test_write_copies_every_kind_of_tensor_as_its_values(slot):
    base = values(4, (4,))
    x, z, n = base
    kinds = {
        "plain": base,
        "strided": [torch.randn(3, 4).t(), z.clone(), n.flip(0)],  # not contiguous: a torch copy
        "offset": [torch.randn(6, 3)[2:], torch.randn(5, dtype=torch.complex64)[1:], torch.arange(9)[5:]],
        "lazy conj and neg": [torch._neg_view(x), z.conj(), torch._neg_view(n)],  # the bits must be applied
        "subclass": [torch.nn.Parameter(x, requires_grad=False), z, n],
    }
    for kind, given in kinds.items():
        assert slot.fits(given, 4, (4,)), kind
        slot.write(given, 4, (4,))
        for got, want in zip(slot.read(4, (4,)), given):
            assert torch.equal(got, want.resolve_conj().resolve_neg()), kind


def test_a_value_that_requires_grad_leaves_no_autograd_history_on_the_slot(slot):
    x, z, n = values(4, (4,))
    weight = torch.ones(3, requires_grad=True)
    traced = x * weight  # part of a caller's graph
    for given in ([traced, z, n], [x, z, n]):
        slot.write(given, 4, (4,))
        assert not any(t.requires_grad or t.grad_fn is not None for t in slot.tensors.values())
        assert not any(v.requires_grad for v in slot.views(4, (4,)))
    assert torch.equal(slot.read(4, (4,))[0], x)


def test_write_and_read_a_part_of_the_rows(slot):
    given = values(2, (2,))
    slot.write(values(4, (4,)), 4, (4,))
    slot.write(given, 2, (2,))
    for got, want in zip(slot.read(2, (2,)), given):
        assert torch.equal(got, want)
    single = values(1, ())
    slot.write(single, 1, ())
    for got, want in zip(slot.read(1, ()), single):
        assert got.shape == want.shape and torch.equal(got, want)


def test_a_value_of_other_rows_is_refused_not_copied_past_its_end(slot):
    x, z, n = values(2, (2,))
    with pytest.raises(RuntimeError):  # torch's copy_ names the shapes; no bytes are read beyond the value
        slot.write([x, z, n], 4, (4,))


def test_a_client_first_called_in_inference_mode_serves_its_calls_outside_it():
    # Its lanes' shared memory was mapped while a caller in torch.inference_mode read the hub's offer: inference
    # tensors, which every later call outside inference mode failed to write into.
    import pickle

    from tensordict import TensorDict
    from tensordict.nn import TensorDictModule

    from torchrl_batchserve import BatchedPolicyServer

    net = torch.nn.Linear(4, 2)
    x = torch.randn(4)
    with BatchedPolicyServer(TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])) as server:
        client = pickle.loads(pickle.dumps(server.remote_policy()))  # a worker's client, in this process
        with torch.inference_mode():
            for _ in range(3):  # the first travels pickled and earns a lane; the others use it
                client(TensorDict(observation=x.clone()))
        out = client(TensorDict(observation=x.clone()))["logits"]
        assert server._endpoint.lazy_hub.hub.arrived["lane"] == 3
    assert not out.is_inference()
    out.add_(0)  # an in-place op, as a caller may do
    with torch.no_grad():
        torch.testing.assert_close(out, net(x))


def memory_files() -> int:
    """This process's open descriptors of shared memory files (memfds)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += "memfd:" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (listdir's own descriptor)
            pass
    return count


def test_mapped_slots_and_headers_hold_no_descriptor_and_share_their_memory():
    # Python's mmap kept a duplicate of each one's descriptor open as long as it lived: two per lane on each
    # side, so a server of many busy workers ran out of descriptors (ulimit -n, often 1024).
    before = memory_files()
    pairs = []
    for _ in range(8):
        slot, fd = Slot.create([("x", torch.float32, (3,))], 4)
        headers, headers_fd = Headers.create()
        pairs.append(
            (slot, Slot.attach(slot.fields, slot.capacity, slot.size, fd), headers, Headers.attach(headers_fd))
        )
    assert memory_files() == before  # attach closed each descriptor, and no mapping keeps one
    slot, peer, headers, peer_headers = pairs[-1]
    slot.write([torch.arange(12.0).view(4, 3)], 4, (4,))
    assert torch.equal(peer.read(4, (4,))[0], torch.arange(12.0).view(4, 3))  # one memory, two mappings
    headers.write(5, 42, 3, (3,), None)
    assert peer_headers.read(5) == (42, 3, (3,), None)
