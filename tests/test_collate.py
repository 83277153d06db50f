"""Collates for real data: padding, packing, nested and non-tensor entries, cost bounds.

Every request's result is compared to the policy applied to that request
alone; batches are made deterministic by holding the serve loop in a gated
first forward while the rest queue up.
"""

from __future__ import annotations

import copy
import pickle
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf
from tensordict import TensorDict, TensorDictBase, tensorclass
from tensordict.nn import TensorDictModule, TensorDictModuleBase
from torch import nn

from torchrl_batchserve import (
    BadRequestError,
    BatchedPolicyServer,
    EvaluationCache,
    FunctionCollate,
    LengthCost,
    PackCollate,
    PadCollate,
    PolicyError,
    StackCollate,
)

# -- policies ----------------------------------------------------------------------------


class MaskedEncoder(nn.Module):
    """A one-layer transformer that honours the mask: per-token logits and a pooled value."""

    def __init__(self, features: int = 4, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(features, width)
        self.layer = nn.TransformerEncoderLayer(width, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(width, 3)
        self.value = nn.Linear(width, 1)
        self.eval()

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.layer(self.embed(tokens), src_key_padding_mask=~mask)
        h = h * mask.unsqueeze(-1)
        pooled = h.sum(-2) / mask.sum(-1, keepdim=True)
        return self.head(h), self.value(pooled)


def alone(net: MaskedEncoder, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy on one request, unpadded (a leading row dim added and removed)."""
    rows = tokens.reshape(-1, *tokens.shape[-2:])
    with torch.no_grad():
        logits, value = net(rows, torch.ones(rows.shape[:2], dtype=torch.bool))
    return logits.reshape(*tokens.shape[:-1], 3), value.reshape(*tokens.shape[:-2], 1)


class Gated(TensorDictModuleBase):
    """Wraps a policy; its first forward waits for the test's gate; records every batch."""

    def __init__(self, policy: TensorDictModuleBase) -> None:
        super().__init__()
        self.policy = policy
        self.in_keys, self.out_keys = list(policy.in_keys), list(policy.out_keys)
        self.gate, self.entered = threading.Event(), threading.Event()
        self.batches: list[TensorDictBase] = []

    def __deepcopy__(self, memo):  # the served copy shares the gate and the record
        clone = type(self)(copy.deepcopy(self.policy, memo))
        clone.gate, clone.entered, clone.batches = self.gate, self.entered, self.batches
        return clone

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        self.batches.append(td.copy())
        if len(self.batches) == 1:
            self.entered.set()
            assert self.gate.wait(30), "the test never opened the gate"
        return self.policy(td)


def serve_held(server: BatchedPolicyServer, gated: Gated, first: TensorDictBase, rest: list[TensorDictBase]) -> list:
    """Submit ``first``, hold the loop in its forward, queue ``rest``, release; return all results."""
    remote = server.remote_policy()
    futures = [remote.submit(first)]
    assert gated.entered.wait(10)
    futures += [remote.submit(td) for td in rest]
    gated.gate.set()
    return [f.result(10) for f in futures]


def lengths(n: int, high: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, high + 1, (n,), generator=g).tolist()


# -- padding -------------------------------------------------------------------------------


@pytest.mark.parametrize("buckets", [None, [4, 8, 16]])
def test_padded_results_equal_each_request_alone(buckets):
    net = MaskedEncoder()
    policy = TensorDictModule(net, in_keys=["tokens", "mask"], out_keys=["logits", "value"])
    gated = Gated(policy)
    # a huge pad value: any padding that leaked into a real position would show
    collate = PadCollate(["tokens"], trim_keys=["logits"], buckets=buckets, pad_values={"tokens": 1e4})
    tds = [TensorDict(tokens=torch.randn(n, 4)) for n in lengths(24, 16, seed=1)]
    tds.append(TensorDict(tokens=torch.randn(3, 5, 4), batch_size=[3]))  # three rows of length 5
    with BatchedPolicyServer(gated, collate=collate, max_batch_size=8, timeout=1e6) as server:
        outs = serve_held(server, gated, tds[0], tds[1:])
    for td in outs:
        logits, value = alone(net, td["tokens"])
        assert td["logits"].shape == logits.shape  # trimmed back to this request's length
        torch.testing.assert_close(td["logits"], logits, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(td["value"], value, atol=1e-5, rtol=1e-4)
    assert "mask" not in outs[0].keys()  # the collate's entry stays in the batch
    seen = {batch["tokens"].shape[1] for batch in gated.batches}
    longest = [max(int(m.sum(1).max()) for m in [batch["mask"]]) for batch in gated.batches]
    if buckets is None:
        assert [batch["tokens"].shape[1] for batch in gated.batches] == longest  # pad to the batch max
    else:
        assert seen <= set(buckets)
        for batch, n in zip(gated.batches, longest):
            assert batch["tokens"].shape[1] == min(b for b in buckets if b >= n)
    assert len(gated.batches) > 2  # batches really mixed lengths


def test_variable_length_requests_from_a_worker_are_padded_with_everyone_elses():
    net = MaskedEncoder()
    policy = TensorDictModule(net, in_keys=["tokens", "mask"], out_keys=["logits", "value"])
    collate = PadCollate(["tokens"], trim_keys=["logits"], pad_values={"tokens": 1e4})
    tds = [TensorDict(tokens=torch.randn(n, 4)) for n in lengths(16, 12, seed=2)]
    with BatchedPolicyServer(policy, collate=collate, max_batch_size=8) as server:
        client = pickle.loads(pickle.dumps(server.remote_policy()))  # the worker-process path, in this process
        local = server.remote_policy()
        with ThreadPoolExecutor(4) as pool:  # the worker's requests, one at a time, batch with local ones
            mixed = pool.map(local, tds[::2])
            outs = [client(td) for td in tds[1::2]] + list(mixed)
        [worker] = server._endpoint.lazy_hub.hub._clients.values()
        lanes, varying = len(worker.lanes), worker.varying
    for td in outs:
        logits, value = alone(net, td["tokens"])
        assert td["logits"].shape == logits.shape
        torch.testing.assert_close(td["logits"], logits, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(td["value"], value, atol=1e-5, rtol=1e-4)
    assert varying and lanes == 1  # the hub saw the lengths vary: the first length's lane, no slot per length


def test_mask_marks_exactly_the_real_elements():
    def record(tokens, mask):
        return tokens.sum(-1)

    policy = TensorDictModule(record, in_keys=["tokens", "mask"], out_keys=["s"])
    gated = Gated(policy)
    tds = [TensorDict(tokens=torch.ones(n, 2)) for n in (2, 5, 1)]
    with BatchedPolicyServer(gated, collate=PadCollate(["tokens"], pad_values={"tokens": -1}), timeout=1e6) as server:
        serve_held(server, gated, tds[0], tds[1:])
    tokens, mask = gated.batches[1]["tokens"], gated.batches[1]["mask"]  # the batch of the two queued requests
    assert mask.tolist() == [[True] * 5, [True, False, False, False, False]]
    assert bool((tokens[~mask] == -1).all()) and bool((tokens[mask] == 1).all())


def test_pad_rejects_unequal_lengths_and_lengths_beyond_the_last_bucket():
    policy = TensorDictModule(lambda a, b, mask: a.sum(-1) + b.sum(-1), in_keys=["a", "b", "mask"], out_keys=["s"])
    with BatchedPolicyServer(policy, collate=PadCollate(["a", "b"], buckets=[8])) as server:
        remote = server.remote_policy()
        with pytest.raises(BadRequestError, match=r"keys \['a', 'b'\].*share one length.*'a': 3, 'b': 4"):
            remote(TensorDict(a=torch.ones(3), b=torch.ones(4)))
        with pytest.raises(BadRequestError, match="key 'a': length 9 along dim 0 exceeds the largest bucket 8"):
            remote(TensorDict(a=torch.ones(9), b=torch.ones(9)))
        with pytest.raises(BadRequestError, match="key 'a': a variable-length entry must be a tensor, got TensorDict"):
            remote(TensorDict(a=TensorDict(x=torch.ones(3, 2), batch_size=[3]), b=torch.ones(3)))  # pad_sequence fails
        assert remote(TensorDict(a=torch.ones(8), b=torch.ones(8)))["s"] == 16
        stats = server.statistics()
    assert stats.rejected_requests == 3 and stats.requests == 1


@pytest.mark.parametrize(
    ("dtype", "pad", "fits"),
    [
        (torch.uint8, -1, False),  # torch fails every batch: "cannot be converted ... without overflow"
        (torch.long, 0.5, False),  # torch rounds it to 0
        (torch.bool, 2, False),  # torch makes it True
        (torch.long, float("nan"), False),
        (torch.float16, 1e6, False),
        (torch.long, -1, True),
        (torch.bool, True, True),
        (torch.float16, float("-inf"), True),
    ],
)
def test_a_pad_value_the_padded_entrys_dtype_cannot_hold_refuses_the_request_naming_both(dtype, pad, fits):
    policy = TensorDictModule(lambda a, mask: a.float().where(mask, 0).sum(-1), in_keys=["a", "mask"], out_keys=["s"])
    gated = Gated(policy)
    with BatchedPolicyServer(gated, collate=PadCollate(["a"], pad_values={"a": pad}), timeout=1e6) as server:
        if not fits:
            for n in (1, 2):
                with pytest.raises(BadRequestError, match=rf"key 'a': its pad value {pad!r} is no {dtype} value"):
                    server.remote_policy().submit(TensorDict(a=torch.ones(n, dtype=dtype)))
            return
        tds = [TensorDict(a=torch.ones(n, dtype=dtype)) for n in (2, 1, 2)]
        outs = serve_held(server, gated, tds[0], tds[1:])
    assert [out["s"].item() for out in outs] == [2.0, 1.0, 2.0]
    assert gated.batches[1]["a"][0, 1] == torch.tensor(pad, dtype=dtype)  # the second batch padded the 1 with pad


def test_pad_along_an_inner_dim_and_nested_keys():
    # ("obs", "frames") varies along its feature dim 1: (channels, time)
    policy = TensorDictModule(
        lambda frames, mask: (frames.sum(-1), frames * 3),
        in_keys=[("obs", "frames"), ("obs", "mask")],
        out_keys=[("out", "total"), ("out", "tripled")],
    )
    collate = PadCollate([("obs", "frames")], dim=1, mask_key=("obs", "mask"), trim_keys=[("out", "tripled")])
    with BatchedPolicyServer(policy, collate=collate, timeout=0.05) as server:
        remote = server.remote_policy()
        futures = [remote.submit(TensorDict({"obs": {"frames": torch.rand(2, n)}})) for n in (3, 7)]
        outs = [f.result(10) for f in futures]
    for td in outs:
        frames = td["obs", "frames"]
        torch.testing.assert_close(td["out", "total"], frames.sum(-1))
        torch.testing.assert_close(td["out", "tripled"], frames * 3)


def test_stack_collate_refuses_a_pin_memory_that_no_batch_could_use():
    with pytest.raises(ValueError, match=r"pin_memory must be a bool \(got 'yes'\)"):
        StackCollate(pin_memory="yes")
    if torch.accelerator.is_available():
        assert StackCollate(pin_memory=True).pin_memory
    else:  # accepted before, and every batch failed in torch
        with pytest.raises(ValueError, match="pin_memory=True: this torch build or machine has no CUDA"):
            StackCollate(pin_memory=True)


def test_function_collate_refuses_what_it_could_not_call():
    with pytest.raises(TypeError, match=r"fn must be callable as fn\(list of TensorDicts\) -> TensorDict, got str"):
        FunctionCollate("lazy_stack")  # accepted before, and every batch failed on it


def test_pad_constructor_errors_name_the_argument():
    with pytest.raises(ValueError, match="keys must name at least one entry"):
        PadCollate([])
    with pytest.raises(ValueError, match="dim must be an int >= 0"):
        PadCollate(["x"], dim=-1)
    with pytest.raises(ValueError, match="buckets must be a non-empty list of ints >= 1"):
        PadCollate(["x"], buckets=[0, 4])
    with pytest.raises(ValueError, match=r"pad_values names \['y'\]"):
        PadCollate(["x"], pad_values={"y": 1})
    # each accepted before, and then every batch failed in torch (a pad value), or one entry overwrote another
    with pytest.raises(ValueError, match=r"pad_values\['x'\] must be a number \(an int, float or bool\), got 'a'"):
        PadCollate(["x"], pad_values={"x": "a"})
    assert PadCollate(["x"], pad_values={"x": np.int64(3)}).pad_values == {"x": 3}
    with pytest.raises(ValueError, match="mask_key='x' is also one of keys: one would overwrite the other"):
        PadCollate(["x"], mask_key="x")
    with pytest.raises(ValueError, match="offsets_key='x' is also one of keys"):
        PackCollate(["x"], offsets_key="x")
    with pytest.raises(ValueError, match="segment_ids_key='n' is also offsets_key"):
        PackCollate(["x"], offsets_key="n", segment_ids_key="n")
    # what is no key is named as such, not left to a TypeError from deep inside tensordict (or dropped)
    with pytest.raises(TypeError, match=r"keys: expected a key \(a str or a tuple of str\), got \('x', 1\)"):
        PadCollate([("x", 1)])
    with pytest.raises(TypeError, match="mask_key: expected a key .*, got 3"):
        PadCollate(["x"], mask_key=3)
    with pytest.raises(TypeError, match=r"trim_keys: expected a list of keys .*, got 5"):
        PadCollate(["x"], trim_keys=5)
    with pytest.raises(TypeError, match=r"element_keys: expected a list of keys .*, got 2"):
        PackCollate(["x"], element_keys=2)
    with pytest.raises(TypeError, match="LengthCost key: expected a key .*, got 5"):
        LengthCost(5)
    # a class passes the protocol's isinstance check (its methods, unbound) and failed at the first batch
    with pytest.raises(TypeError, match=r"got the class PadCollate: pass an instance, e.g. PadCollate\(...\)"):
        BatchedPolicyServer(TensorDictModule(lambda obs: obs, in_keys=["obs"], out_keys=["out"]), collate=PadCollate)
    policy = TensorDictModule(lambda obs: obs, in_keys=["obs"], out_keys=["out"])
    with pytest.raises(ValueError, match=r"varies \['tokens'\]; the policy reads \['obs'\]"):
        BatchedPolicyServer(policy, collate=PadCollate(["tokens"], mask_key=None))
    # an output to cut that the policy does not write would never be cut: callers would get padding
    with pytest.raises(ValueError, match=r"cuts \['logit'\]; the policy writes \['out'\]"):
        BatchedPolicyServer(policy, collate=PadCollate(["obs"], mask_key=None, trim_keys=["logit"]))
    with pytest.raises(ValueError, match=r"cuts \['score'\]; the policy writes \['out'\]"):
        BatchedPolicyServer(
            policy, collate=PackCollate(["obs"], offsets_key=None, segment_ids_key=None, element_keys=["score"])
        )
    # a packed batch has no rows to pad: static_batch_size was ignored, and the policy saw every shape
    with pytest.raises(ValueError, match=r"static_batch_size=8 pads a batch's rows, and PackCollate"):
        pack = PackCollate(["obs"], offsets_key=None, segment_ids_key=None)
        BatchedPolicyServer(policy, collate=pack, max_batch_size=8, static_batch_size=8)


# -- packing -------------------------------------------------------------------------------


class SetPolicy(nn.Module):
    """Deep sets over packed elements: a per-set embedding and a per-element score."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.phi, self.rho = nn.Linear(3, 8), nn.Linear(8, 2)

    def forward(self, items, segment_ids, offsets):
        h = torch.tanh(self.phi(items))
        sets = torch.zeros(len(offsets) - 1, h.shape[-1]).index_add_(0, segment_ids, h)
        return self.rho(sets), (h * sets[segment_ids]).sum(-1)


def test_packed_results_equal_each_request_alone():
    net = SetPolicy()
    policy = TensorDictModule(net, in_keys=["items", "segment_ids", "offsets"], out_keys=["embedding", "score"])
    gated = Gated(policy)
    tds = [TensorDict(items=torch.randn(n, 3)) for n in lengths(20, 12, seed=2)]
    tds.append(TensorDict(items=torch.randn(2, 4, 3), batch_size=[2]))
    with BatchedPolicyServer(
        gated, collate=PackCollate(["items"], element_keys=["score"]), max_batch_size=6, timeout=1e6
    ) as server:
        outs = serve_held(server, gated, tds[0], tds[1:])
    for td in outs:
        items = td["items"].reshape(-1, *td["items"].shape[-2:])
        n = items.shape[1]
        rows = torch.arange(len(items))
        with torch.no_grad():
            embedding, score = net(items.flatten(0, 1), rows.repeat_interleave(n), torch.arange(len(items) + 1) * n)
        torch.testing.assert_close(td["embedding"], embedding.reshape(*td.batch_size, 2))
        torch.testing.assert_close(td["score"], score.reshape(*td.batch_size, n))
    batch = gated.batches[1]
    assert batch.batch_size == torch.Size([])
    sizes = batch["offsets"].diff()
    assert torch.equal(batch["segment_ids"], torch.arange(len(sizes)).repeat_interleave(sizes))
    assert batch["items"].shape[0] == int(batch["offsets"][-1])


class MiscountingSetPolicy(nn.Module):
    """Returns ``extra_sets`` more per-set rows, or ``extra_elements`` more per-element scores, than it was given."""

    def __init__(self, extra_sets: int, extra_elements: int) -> None:
        super().__init__()
        self.extra_sets, self.extra_elements = extra_sets, extra_elements

    def forward(self, items, segment_ids, offsets):
        return torch.zeros(len(offsets) - 1 + self.extra_sets, 2), torch.zeros(len(items) + self.extra_elements)


@pytest.mark.parametrize(
    "extra, message",
    [
        ((1, 0), r"'embedding' has shape \(3, 2\); its leading dim must be the batch's 2 rows"),
        ((0, 1), r"'score' has shape \(9,\); expected 8 elements first"),
    ],
    ids=["sets", "elements"],
)
def test_a_packed_policy_miscounting_its_sets_or_elements_fails_its_batch_with_policy_error(extra, message):
    net = MiscountingSetPolicy(*extra)
    policy = TensorDictModule(net, in_keys=["items", "segment_ids", "offsets"], out_keys=["embedding", "score"])
    with BatchedPolicyServer(policy, collate=PackCollate(["items"], element_keys=["score"])) as server:
        with pytest.raises(PolicyError, match=message):
            server.remote_policy()(TensorDict(items=torch.randn(2, 4, 3), batch_size=[2]))
        assert server.statistics().failed_batches == 1


# -- nested and non-tensor entries ----------------------------------------------------------


class BoardPolicy(nn.Module):
    """Reads a nested TensorDict and a FEN string; writes a nested TensorDict and a string."""

    def forward(self, board: TensorDictBase, fen, weight: torch.Tensor):
        fens = fen.tolist() if hasattr(fen, "tolist") else list(fen)
        moves = [f"{f}:{int(p.sum())}" for f, p in zip(fens, board["pieces"])]
        nxt = TensorDict(pieces=board["pieces"] + 1, turn=1 - board["turn"], batch_size=board.batch_size)
        return (board["pieces"].float() * weight).sum(-1), moves, nxt


@pytest.mark.parametrize("collate", [None, PadCollate(["weight"], mask_key=None)], ids=["stack", "pad"])
def test_nested_and_non_tensor_entries_round_trip(collate):
    policy = TensorDictModule(
        BoardPolicy(), in_keys=["board", "fen", "weight"], out_keys=[("out", "score"), "move", "next"]
    )

    def request(i: int, *batch: int) -> TensorDict:
        if not batch:
            fen: object = f"fen-{i}"
        elif len(batch) == 1:
            fen = [f"fen-{i}-{a}" for a in range(batch[0])]
        else:
            fen = [[f"fen-{i}-{a}-{b}" for b in range(batch[1])] for a in range(batch[0])]
        board = TensorDict(pieces=torch.randint(0, 5, (*batch, 4)), turn=torch.zeros(batch, dtype=torch.long))
        board.batch_size = batch
        return TensorDict(board=board, fen=fen, weight=torch.rand(*batch, 4), batch_size=batch)

    tds = [request(0), request(1, 3), request(2), request(3, 2, 2)]
    gated = Gated(policy)
    with BatchedPolicyServer(gated, collate=collate, timeout=1e6) as server:
        outs = serve_held(server, gated, tds[0], tds[1:])
    for td in outs:
        pieces = td["board", "pieces"]
        torch.testing.assert_close(td["out", "score"], (pieces.float() * td["weight"]).sum(-1))
        assert torch.equal(td["next", "pieces"], pieces + 1) and td["next"].batch_size == td.batch_size
        fens = td["fen"] if not td.batch_dims else td.get("fen").tolist()
        expected = (
            f"{fens}:{int(pieces.sum())}"
            if not td.batch_dims
            else _nested_map(lambda f, p: f"{f}:{int(p.sum())}", fens, pieces)
        )
        got = td["move"] if not td.batch_dims else td.get("move").tolist()
        assert got == expected


class WithEmpty(nn.Module):
    def forward(self, weight: torch.Tensor, items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return weight.sum(-1), items + 1


@pytest.mark.parametrize(
    "collate",
    [
        None,
        PadCollate(["items"], mask_key=None, trim_keys=["plus"]),
        PackCollate(["items"], offsets_key=None, segment_ids_key=None, element_keys=["plus"]),
    ],
    ids=["stack", "pad", "pack"],
)
@pytest.mark.parametrize("cache", [False, True], ids=["", "cache"])
def test_entries_of_no_elements_round_trip_in_requests_of_any_batch_shape(collate, cache):
    # A (2, 3, 0, 4) entry: flattening its batch dims with reshape(-1, 0, 4) is ambiguous for torch.
    policy = TensorDictModule(WithEmpty(), in_keys=["weight", "items"], out_keys=["total", "plus"])

    def request(*batch: int) -> TensorDict:
        return TensorDict(weight=torch.rand(*batch, 4), items=torch.ones(*batch, 0, 4), batch_size=batch)

    tds = [request(), request(2, 3), request(3), request(2, 3)]
    gated = Gated(policy)
    kwargs = {"cache": EvaluationCache(16)} if cache else {}
    with BatchedPolicyServer(gated, collate=collate, timeout=1e6, **kwargs) as server:
        outs = serve_held(server, gated, tds[0], tds[1:])
    assert len(gated.batches) == 2  # the three held requests ran as one batch
    for td, out in zip(tds, outs):
        torch.testing.assert_close(out["total"], td["weight"].sum(-1))
        assert out["plus"].shape == (*td.batch_size, 0, 4)


@tensorclass
class Gaussian:
    """A tensorclass, as TorchRL's VLA actions and LLM histories are."""

    loc: torch.Tensor
    scale: torch.Tensor


def test_tensorclass_entries_keep_their_class_both_ways_on_every_path():
    # They were taken for non-tensor data: batched as a stack of dicts, handed back as one (or as a TensorDict).
    net = nn.Linear(4, 2)

    def posterior(prior: Gaussian) -> Gaussian:
        return Gaussian(loc=net(prior.loc), scale=net(prior.scale).exp(), batch_size=prior.batch_size)

    policy = TensorDictModule(posterior, in_keys=["prior"], out_keys=["posterior"])

    def request(*batch: int) -> TensorDict:
        prior = Gaussian(loc=torch.randn(*batch, 4), scale=torch.randn(*batch, 4), batch_size=list(batch))
        return TensorDict(prior=prior, batch_size=list(batch))

    gated = Gated(policy)
    with BatchedPolicyServer(gated, timeout=1e6) as server:
        outs = serve_held(server, gated, request(), [request(3), request(), request(2, 2)])
    assert len(gated.batches) == 2 and isinstance(gated.batches[1].get("prior"), Gaussian)
    with BatchedPolicyServer(policy, cache=EvaluationCache(64)) as server:
        worker = pickle.loads(pickle.dumps(server.remote_policy()))  # the hub's path
        outs += [worker(request()), worker(request(3))]
        outs.append(worker(outs[-1].select("prior").clone()))  # answered by the cache
        assert server.statistics().cache_hits == 1
        with pytest.raises(BadRequestError, match="key 'prior': expected a tensorclass Gaussian, got TensorDict"):
            worker(TensorDict(prior=request()["prior"].to_tensordict()))  # its leaves, in another class
    with torch.no_grad():
        for td in outs:
            assert isinstance(td.get("posterior"), Gaussian) and td["posterior"].batch_size == td.batch_size
            torch.testing.assert_close(td["posterior"].loc, net(td["prior"].loc))
            torch.testing.assert_close(td["posterior"].scale, net(td["prior"].scale).exp())


class Chunking(TensorDictModuleBase):
    """Writes its out_key inside a tensorclass, as TorchRL's VLA policies write ``("vla_action", "chunk")``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 4)
        self.in_keys, self.out_keys = ["x"], [("action", "loc")]

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        loc = self.net(td["x"])
        return td.set("action", Gaussian(loc=loc, scale=loc.exp(), batch_size=td.batch_size))


def test_an_out_key_inside_a_tensorclass_reaches_its_caller_in_that_tensorclass_on_every_path():
    # Delivered as its leaf, it came back in a plain TensorDict: td["action"].loc was TensorDict's, not the output.
    gated = Gated(Chunking())
    held = [TensorDict(x=torch.randn(3, 4), batch_size=[3]), TensorDict(x=torch.randn(4))]
    with BatchedPolicyServer(gated, timeout=1e6) as server:
        outs = serve_held(server, gated, TensorDict(x=torch.randn(4)), held)
    with BatchedPolicyServer(gated.policy, cache=EvaluationCache(64)) as server:
        worker = pickle.loads(pickle.dumps(server.remote_policy()))  # the hub's path
        outs += [worker(TensorDict(x=torch.randn(4))), worker(TensorDict(x=torch.randn(2, 4), batch_size=[2]))]
        outs.append(server.remote_policy()(outs[-1].select("x").clone()))  # answered by the cache
        assert server.statistics().cache_hits == 1
    with torch.no_grad():
        for td in outs:
            expected = gated.policy(td.select("x").clone())["action"]
            assert isinstance(td.get("action"), Gaussian) and td["action"].batch_size == td.batch_size
            torch.testing.assert_close((td["action"].loc, td["action"].scale), (expected.loc, expected.scale))


def _nested_map(fn, items, tensor):
    if isinstance(items, str):
        return fn(items, tensor)
    return [_nested_map(fn, item, t) for item, t in zip(items, tensor)]


class Tagging(TensorDictModuleBase):
    """Doubles the observation and tags the whole batch with one string (a ``NonTensorData``)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_keys, self.out_keys = ["x"], ["y", "tag"]

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        return td.set("y", td["x"] * 2).set("tag", "batch-tag")


def test_non_tensor_data_set_once_for_the_batch_reaches_every_caller_on_every_path():
    gated = Gated(Tagging())
    tds = [TensorDict(x=torch.ones(2)), TensorDict(x=torch.rand(3, 2), batch_size=[3]), TensorDict(x=torch.rand(2))]
    with BatchedPolicyServer(gated, timeout=1e6) as server:
        outs = serve_held(server, gated, tds[0], tds[1:])  # one batch of single and multi-row requests
    assert len(gated.batches) == 2 and gated.batches[1].batch_size == (4,)
    with BatchedPolicyServer(Tagging()) as server:  # the worker-process path: the tag comes pickled
        client = pickle.loads(pickle.dumps(server.remote_policy()))
        outs += [client(TensorDict(x=torch.rand(2))), client(TensorDict(x=torch.rand(4, 2), batch_size=[4]))]
    for td in outs:
        torch.testing.assert_close(td["y"], td["x"] * 2)
        tags = td["tag"] if not td.batch_dims else td.get("tag").tolist()
        assert tags == ("batch-tag" if not td.batch_dims else ["batch-tag"] * td.batch_size[0])


def test_nested_tensordict_with_other_leaves_is_a_bad_request():
    policy = TensorDictModule(lambda board: board["a"].sum(-1), in_keys=["board"], out_keys=["s"])
    with BatchedPolicyServer(policy) as server:
        remote = server.remote_policy()
        remote(TensorDict(board=TensorDict(a=torch.ones(3))))
        with pytest.raises(BadRequestError, match=r"key 'board': expected a TensorDict with leaves \{a: torch.float32"):
            remote(TensorDict(board=TensorDict(a=torch.ones(3), b=torch.ones(1))))
        with pytest.raises(BadRequestError, match="key 'board': expected a nested TensorDict, got a tensor"):
            remote(TensorDict(board=torch.ones(3)))


def test_non_tensor_where_a_tensor_was_fixed_is_a_bad_request():
    policy = TensorDictModule(lambda x: x * 2, in_keys=["x"], out_keys=["y"])
    with BatchedPolicyServer(policy) as server:
        remote = server.remote_policy()
        remote(TensorDict(x=torch.ones(2)))
        with pytest.raises(BadRequestError, match="key 'x': expected a tensor, got NonTensorData"):
            remote(TensorDict(x="two"))


# -- a TorchRL-style collate_fn ------------------------------------------------------------


@pytest.mark.parametrize("fn", ["lazy_stack", "torch.stack"])
def test_a_collate_fn_gets_one_tensordict_per_row_so_requests_of_several_rows_batch_too(fn):
    # It got each request's TensorDict whole: a request of batch [3] stacked to (1, 3) and failed as a
    # PolicyError ("expected a leading dim of the batch's 3 rows").
    from tensordict import lazy_stack

    net = nn.Linear(4, 2)
    gated = Gated(TensorDictModule(net, in_keys=["observation"], out_keys=["logits"]))
    collate_fn = lazy_stack if fn == "lazy_stack" else torch.stack
    shapes = [[], [3], [], [2, 3], [1]]
    tds = [TensorDict(observation=torch.randn(*shape, 4), batch_size=shape) for shape in shapes]
    with BatchedPolicyServer(gated, collate=collate_fn, max_batch_size=64, timeout=1e6) as server:
        outs = serve_held(server, gated, tds[0], tds[1:])
    assert [b.batch_size[0] for b in gated.batches] == [1, 3 + 1 + 6 + 1]  # the held row, then the rest in one
    with torch.no_grad():
        for out, shape in zip(outs, shapes):
            assert out.batch_size == torch.Size(shape)
            torch.testing.assert_close(out["logits"], net(out["observation"]))


def test_what_a_policy_writes_into_a_collate_fns_batch_never_reaches_the_callers_tensordicts():
    # The function got the callers' own TensorDicts: a lazy_stack of them made every write of the forward a write
    # into the callers' TensorDicts, from the serve thread, mid-forward; entries that are no out_key stayed there.
    from tensordict import lazy_stack

    class Scratch(TensorDictModuleBase):
        in_keys, out_keys = ["observation"], ["logits"]

        def forward(self, td):
            td.set("scratch", td["observation"] * 2)
            td.set("logits", td["scratch"][..., :2] + 1)
            return td

    with BatchedPolicyServer(Scratch(), collate=lazy_stack) as server:
        remote = server.remote_policy()
        tds = [TensorDict(observation=torch.randn(4)), TensorDict(observation=torch.randn(2, 4), batch_size=[2])]
        outs = [remote(td) for td in tds]
    for td, out in zip(tds, outs):
        assert out is td and sorted(out.keys()) == ["logits", "observation", "policy_version"]
        torch.testing.assert_close(out["logits"], out["observation"][..., :2] * 2 + 1)


@pytest.mark.parametrize("returned", [None, "tuple"])
def test_a_collate_fn_that_returns_no_tensordict_fails_its_batch_with_a_policy_error_naming_it(returned):
    # (an AttributeError from deep in the serve loop: "'tuple' object has no attribute 'values'")
    def rows_as_is(rows):
        return None if returned is None else tuple(rows)

    policy = TensorDictModule(lambda x: x, in_keys=["x"], out_keys=["y"])
    with BatchedPolicyServer(policy, collate=rows_as_is) as server:
        got = "NoneType" if returned is None else "tuple"
        with pytest.raises(
            PolicyError, match=rf"FunctionCollate\('rows_as_is'\) returned {got}; expected a TensorDict"
        ):
            server.remote_policy()(TensorDict(x=torch.ones(1)))
        assert server.statistics().failed_batches == 1


# -- cost-bounded batches -------------------------------------------------------------------


def test_cost_bound_caps_every_batch_and_refuses_requests_too_costly_alone():
    policy = TensorDictModule(lambda tokens, mask: tokens.sum((-1, -2)), in_keys=["tokens", "mask"], out_keys=["s"])
    gated = Gated(policy)
    tds = [TensorDict(tokens=torch.ones(n, 2)) for n in lengths(30, 20, seed=3)]
    with BatchedPolicyServer(
        gated,
        collate=PadCollate(["tokens"]),
        cost_fn=LengthCost("tokens"),
        max_batch_cost=40,
        max_batch_size=64,
        timeout=1e6,
    ) as server:
        with pytest.raises(BadRequestError, match="costs 41 .*max_batch_cost=40"):
            server.submit(TensorDict(tokens=torch.ones(41, 2)))
        outs = serve_held(server, gated, tds[0], tds[1:])
        stats = server.statistics()
    assert [float(td["s"]) for td in outs] == [2.0 * td["tokens"].shape[0] for td in outs]
    costs = [int(batch["mask"].sum()) for batch in gated.batches]
    assert max(costs) <= 40 and sum(costs) == sum(td["tokens"].shape[0] for td in tds)
    assert stats.fired["full"] >= 1 and len(gated.batches) >= sum(costs) // 40


def test_cost_fn_and_max_batch_cost_go_together():
    policy = TensorDictModule(lambda x: x, in_keys=["x"], out_keys=["y"])
    with pytest.raises(ValueError, match="cost_fn and max_batch_cost go together"):
        BatchedPolicyServer(policy, max_batch_cost=10)
    with pytest.raises(ValueError, match="max_batch_cost must be an int >= 1"):
        BatchedPolicyServer(policy, cost_fn=LengthCost("x"), max_batch_cost=0)


@pytest.mark.parametrize("garbage", ["many", torch.tensor(2.5), -1, True, 2.0])
def test_a_cost_fn_returning_garbage_is_a_bad_request(garbage):
    # (a one-element float tensor was truncated to an int cost)
    policy = TensorDictModule(lambda x: x, in_keys=["x"], out_keys=["y"])
    with BatchedPolicyServer(policy, cost_fn=lambda td: garbage, max_batch_cost=10) as server:
        with pytest.raises(
            BadRequestError, match=re.escape(f"cost_fn must return an int >= 0 for each request, got {garbage!r}")
        ):
            server.remote_policy()(TensorDict(x=torch.ones(1)))


@pytest.mark.parametrize("cost", [3, np.int64(3), torch.tensor(3), torch.tensor([3])])
def test_a_cost_fn_may_return_any_integer(cost):
    policy = TensorDictModule(lambda x: x, in_keys=["x"], out_keys=["y"])
    with BatchedPolicyServer(policy, cost_fn=lambda td: cost, max_batch_cost=10) as server:
        assert server.remote_policy()(TensorDict(x=torch.ones(1)))["y"].tolist() == [1.0]


@pytest.mark.parametrize("path", ["thread", "worker"])
def test_a_cost_fn_that_raises_is_a_bad_request_naming_the_entries(path):
    # it was a bare AttributeError/IndexError: LengthCost of a key the request lacks, or of a dim it lacks
    policy = TensorDictModule(lambda x: x, in_keys=["x"], out_keys=["y"])
    cases = [
        (LengthCost("tokens"), r"LengthCost\('tokens', dim=0\): key 'tokens': expected a dim 0 .*, got nothing"),
        (LengthCost("x", dim=1), r"key 'x': expected a dim 1 after the batch dims, got shape \(3,\)"),
        (lambda td: int(td["hash"]), r"cost_fn failed on entries \['x'\]: KeyError"),
    ]
    for cost_fn, error in cases:
        with BatchedPolicyServer(policy, cost_fn=cost_fn, max_batch_cost=10) as server:
            remote = server.remote_policy()
            remote = remote if path == "thread" else pickle.loads(pickle.dumps(remote))
            with pytest.raises(BadRequestError, match=error):
                remote(TensorDict(x=torch.ones(3)))


# -- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "node, cls",
    [
        ({"_target_": "torchrl_batchserve.StackCollate", "pin_memory": False}, StackCollate),
        (
            {
                "_target_": "torchrl_batchserve.PadCollate",
                "keys": ["tokens", ["obs", "frames"]],
                "trim_keys": ["logits"],
                "buckets": [16, 32],
                "pad_values": {"tokens": -1},
            },
            PadCollate,
        ),
        ({"_target_": "torchrl_batchserve.PackCollate", "keys": ["items"], "element_keys": ["score"]}, PackCollate),
        ({"_target_": "torchrl_batchserve.LengthCost", "key": "tokens"}, LengthCost),
    ],
)
def test_collates_build_from_yaml(node, cls):
    built = instantiate(OmegaConf.create(node), _convert_="all")
    assert type(built) is cls
    if cls is PadCollate:
        assert built.keys == ("tokens", ("obs", "frames")) and built.buckets == [16, 32]
        assert built.provided_keys == frozenset({"mask"}) and built.pad_values == {"tokens": -1}
