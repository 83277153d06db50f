"""EvaluationCache: exact hits, versions, capacity, coalescing, statistics, failures."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch
from conftest import GatedPolicy, make_mlp
from tensordict import TensorDict
from tensordict.nn import InteractionType, TensorDictModule, set_interaction_type
from tensordict.nn.probabilistic import interaction_type

from torchrl_batchserve import (
    BadRequestError,
    BatchedPolicyServer,
    EvaluationCache,
    QueueFullError,
    ServerClosedError,
)


def obs(seed: int, *batch: int) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict(observation=torch.randn(*batch, 8, generator=g), batch_size=batch)


def test_hit_returns_exactly_what_the_forward_returns(policy, net):
    cache = EvaluationCache()
    with BatchedPolicyServer(policy, cache=cache) as server:
        remote = server.remote_policy()
        first = remote(obs(0))
        hit = remote(obs(0))
        stats = server.statistics()
    with torch.no_grad():
        expected = net(obs(0)["observation"])
    assert torch.equal(first["logits"], expected) and torch.equal(hit["logits"], expected)
    assert int(hit["policy_version"]) == 0
    assert hit["logits"].data_ptr() != first["logits"].data_ptr()  # callers never share storage
    assert (stats.cache_hits, stats.cache_misses, stats.requests) == (1, 1, 1)  # the hit never entered a batch


def test_a_result_is_its_callers_own_writing_into_it_changes_no_later_hit(policy, net):
    with BatchedPolicyServer(policy, cache=EvaluationCache()) as server:
        remote = server.remote_policy()
        results = [
            remote(obs(0)),  # computed and stored
            remote(obs(0)),  # a hit
            remote(TensorDict(observation=torch.stack([obs(0)["observation"]] * 2), batch_size=[2])),  # a hit
        ]
        for result in results:
            result["logits"].fill_(float("nan"))  # a caller may write into its result
        again = remote(obs(0))
        assert server.statistics().cache_hits == 3
    with torch.no_grad():
        assert torch.equal(again["logits"], net(obs(0)["observation"]))


def test_a_hit_in_inference_mode_is_a_normal_tensor_as_a_computed_result_is(policy):
    with BatchedPolicyServer(policy, cache=EvaluationCache()) as server:
        remote = server.remote_policy()
        with torch.inference_mode():
            first, hit, rows = (
                remote(obs(0)),
                remote(obs(0)),
                remote(TensorDict(observation=torch.stack([obs(0)["observation"]] * 2), batch_size=[2])),
            )
        assert server.statistics().cache_hits == 2
    for td in (first, hit, rows):
        assert not td["logits"].is_inference()
        td["logits"].add_(0)  # an in-place op outside inference mode, as a caller may do


def test_an_entry_is_never_served_across_a_weight_update(policy, net):
    with BatchedPolicyServer(policy, cache=EvaluationCache()) as server:
        remote = server.remote_policy()
        before = remote(obs(0))
        new = make_mlp(seed=1)
        version = server.update_weights(TensorDict.from_module(TensorDictModule(new, ["observation"], ["logits"])))
        after = remote(obs(0))  # staged, not applied yet: the old entry must not answer
        again = remote(obs(0))
        stats = server.statistics()
    with torch.no_grad():
        assert torch.equal(after["logits"], new(obs(0)["observation"]))
    assert int(before["policy_version"]) == 0 and int(after["policy_version"]) == version == 1
    assert int(again["policy_version"]) == 1 and torch.equal(again["logits"], after["logits"])
    assert (stats.cache_misses, stats.cache_hits) == (2, 1)


def test_capacity_bound_evicts_the_least_recently_used(policy):
    cache = EvaluationCache(capacity=3)
    with BatchedPolicyServer(policy, cache=cache) as server:
        remote = server.remote_policy()
        for seed in (0, 1, 2):
            remote(obs(seed))
        remote(obs(0))  # touch 0: 1 is now the oldest
        remote(obs(3))  # evicts 1
        assert len(cache) == 3
        misses = server.statistics().cache_misses
        remote(obs(0))
        remote(obs(2))
        assert server.statistics().cache_misses == misses  # 0 and 2 stayed
        remote(obs(1))
        assert server.statistics().cache_misses == misses + 1  # 1 was evicted
        assert len(cache) == 3


def test_identical_in_flight_rows_reach_the_policy_once():
    gated = GatedPolicy(make_mlp())
    k = 6
    with BatchedPolicyServer(gated, cache=EvaluationCache(), timeout=1e6) as server:
        remote = server.remote_policy()
        first = remote.submit(obs(100))
        assert gated.entered.wait(10)
        same = [remote.submit(obs(7)) for _ in range(k)]  # one leader queued, k-1 coalesced
        other = remote.submit(obs(8))
        gated.gate.set()
        outs = [f.result(10) for f in same]
        other.result(10), first.result(10)
        stats = server.statistics()
    assert gated.batches == [1, 2]  # the second batch: one row of obs(7), one of obs(8)
    assert all(torch.equal(o["logits"], outs[0]["logits"]) for o in outs)
    assert len({o["logits"].data_ptr() for o in outs}) == k
    assert (stats.cache_coalesced, stats.cache_misses, stats.cache_hits) == (k - 1, 3, 0)


def test_a_row_admitted_after_a_weight_update_never_joins_one_computed_before_it():
    gated = GatedPolicy(make_mlp())
    new = make_mlp(seed=1)
    with BatchedPolicyServer(gated, cache=EvaluationCache(), timeout=1e6) as server:
        remote = server.remote_policy()
        before = remote.submit(obs(7))
        assert gated.entered.wait(10)  # in the forward, with version 0
        assert server.update_weights(GatedPolicy(new)) == 1
        after = remote.submit(obs(7))  # the same row, admitted when version 1 is the newest
        gated.gate.set()
        first, second = before.result(10), after.result(10)
        stats = server.statistics()
    assert int(first["policy_version"]) == 0 and int(second["policy_version"]) == 1
    with torch.no_grad():
        assert torch.equal(second["logits"], new(obs(7)["observation"]))
    assert (stats.cache_coalesced, stats.cache_misses) == (0, 2)


def test_blocking_threads_on_one_row_all_get_it(net):
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    n, rounds = 16, 20
    with BatchedPolicyServer(policy, cache=EvaluationCache(), timeout=1e6) as server:
        remote = server.remote_policy()
        results: list[list[torch.Tensor]] = [[] for _ in range(n)]

        def actor(i: int) -> None:
            for r in range(rounds):
                results[i].append(remote(obs(r))["logits"])

        threads = [threading.Thread(target=actor, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stats = server.statistics()
    with torch.no_grad():
        expected = [net(obs(r)["observation"]) for r in range(rounds)]
    assert all(torch.equal(results[i][r], expected[r]) for i in range(n) for r in range(rounds))
    # every one of the n * rounds lookups is counted once; only distinct rows were computed
    assert stats.cache_hits + stats.cache_misses + stats.cache_coalesced == n * rounds
    assert stats.rows == stats.cache_misses and stats.cache_misses >= rounds


def test_multi_row_requests_hit_when_every_row_is_cached(policy, net):
    with BatchedPolicyServer(policy, cache=EvaluationCache()) as server:
        remote = server.remote_policy()
        rows = obs(0, 2, 3)
        first = remote(rows.clone())  # computed; its 6 rows stored
        single = remote(TensorDict(observation=rows["observation"][1, 2].clone()))
        again = remote(rows.clone())
        stats = server.statistics()
    with torch.no_grad():
        expected = net(rows["observation"])
    assert torch.equal(first["logits"], expected) and torch.equal(again["logits"], expected)
    assert again["logits"].shape == (2, 3, 3) and again["policy_version"].shape == (2, 3)
    assert torch.equal(single["logits"], expected[1, 2])
    assert (stats.cache_hits, stats.requests) == (2, 1)


class Tagged(torch.nn.Module):
    """Scores each row and names it in non-tensor data (a list of strings, one per row)."""

    def forward(self, x: torch.Tensor):
        scores = x.sum(-1)
        return scores, [f"row-{float(v):g}" for v in scores]


def test_multi_row_non_tensor_outputs_come_back_from_the_cache_in_the_requests_shape():
    policy = TensorDictModule(Tagged(), in_keys=["x"], out_keys=["score", "tag"])
    x = torch.arange(12.0).reshape(2, 3, 2)
    with BatchedPolicyServer(policy, cache=EvaluationCache()) as server:
        remote = server.remote_policy()
        first = remote(TensorDict(x=x.clone(), batch_size=[2, 3]))
        again = remote(TensorDict(x=x.clone(), batch_size=[2, 3]))
        assert server.statistics().cache_hits == 1
    expected = [[f"row-{float(v):g}" for v in row] for row in x.sum(-1)]
    assert first.get("tag").tolist() == expected and again.get("tag").tolist() == expected
    assert torch.equal(again["score"], x.sum(-1))


class ByContent(torch.nn.Module):
    """Reads a nested TensorDict and a string per row: the sum of the board times the tag's length."""

    def forward(self, board: TensorDict, tag) -> torch.Tensor:
        tags = tag.tolist() if hasattr(tag, "tolist") else list(tag)
        return board["a"].sum(-1) * torch.tensor([float(len(t)) for t in tags])


def board(value: float, tag: str) -> TensorDict:
    return TensorDict(board=TensorDict(a=torch.full((3,), value)), tag=tag)


def test_nested_and_non_tensor_inputs_are_keyed_by_their_content():
    policy = TensorDictModule(ByContent(), in_keys=["board", "tag"], out_keys=["y"])
    with BatchedPolicyServer(policy, cache=EvaluationCache()) as server:
        remote = server.remote_policy()
        singles = [remote(board(v, t))["y"].item() for v, t in [(1, "x"), (5, "x"), (1, "xy"), (1, "x")]]
        assert singles == [3.0, 15.0, 6.0, 3.0]  # a board or a tag of other content is another row
        assert server.statistics().cache_hits == 1
        two = torch.stack([board(2, "x"), board(4, "yyy")])
        assert remote(two)["y"].tolist() == [6.0, 36.0]  # computed: its rows are new
        assert remote(board(4, "yyy"))["y"].item() == 36.0  # its second row, cached as a row of its own
        swapped = torch.stack([board(4, "yyy"), board(2, "x")])
        assert remote(swapped)["y"].tolist() == [36.0, 6.0]
        assert server.statistics().cache_hits == 3


class PlusTurn(torch.nn.Module):
    def forward(self, observation: torch.Tensor, turn: torch.Tensor) -> torch.Tensor:
        return observation.sum(-1, keepdim=True) + turn.unsqueeze(-1)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bool])
def test_a_scalar_input_per_row_is_keyed(dtype):
    # A 0-dim row (a player to move, a step count) could not be viewed as bytes: every request failed.
    policy = TensorDictModule(PlusTurn(), in_keys=["observation", "turn"], out_keys=["y"])
    with BatchedPolicyServer(policy, cache=EvaluationCache()) as server:
        remote = server.remote_policy()
        x = torch.ones(2)
        one, zero = torch.ones((), dtype=dtype), torch.zeros((), dtype=dtype)
        assert remote(TensorDict(observation=x, turn=one))["y"].tolist() == [3]
        assert remote(TensorDict(observation=x, turn=zero))["y"].tolist() == [2]  # another row, not a hit
        rows = TensorDict(observation=x.expand(2, 2), turn=torch.stack([zero, one]), batch_size=[2])
        assert remote(rows)["y"].tolist() == [[2], [3]]  # each row found in the cache
        stats = server.statistics()
        assert (stats.cache_hits, stats.requests) == (1, 2)  # answered at submit


def test_a_conjugate_view_is_keyed_by_its_values():
    # Its memory holds the values before conjugation, and torch views no such tensor as bytes: every request
    # with one failed with torch's RuntimeError.
    policy = TensorDictModule(lambda z: z.imag.sum(-1, keepdim=True), in_keys=["z"], out_keys=["y"])
    with BatchedPolicyServer(policy, cache=EvaluationCache()) as server:
        remote = server.remote_policy()
        z = torch.tensor([1 + 2j, 3 - 1j])
        assert remote(TensorDict(z=z))["y"].tolist() == [1.0]
        assert remote(TensorDict(z=z.conj()))["y"].tolist() == [-1.0]  # not the entry of z
        assert remote(TensorDict(z=z.conj().resolve_conj()))["y"].tolist() == [-1.0]  # the entry of z.conj()
        assert (server.statistics().cache_hits, server.statistics().cache_misses) == (1, 2)


def test_an_input_the_cache_cannot_key_is_refused_naming_key_fn():
    policy = TensorDictModule(lambda x, fn: x, in_keys=["x", "fn"], out_keys=["y"])
    with BatchedPolicyServer(policy, cache=EvaluationCache()) as server:
        with pytest.raises(BadRequestError, match="a function input does not pickle .*give EvaluationCache a key_fn"):
            server.remote_policy()(TensorDict(x=torch.ones(2), fn=lambda: None))


def test_key_fn_names_the_row(policy):
    cache = EvaluationCache(key_fn=lambda td: int(td["board_id"]))
    with BatchedPolicyServer(policy, cache=cache) as server:
        remote = server.remote_policy()
        a = remote(obs(0).set("board_id", torch.tensor(5)))
        b = remote(obs(1).set("board_id", torch.tensor(5)))  # same key: the cache trusts it
        c = remote(obs(1).set("board_id", torch.tensor(6)))
    assert torch.equal(a["logits"], b["logits"]) and not torch.equal(b["logits"], c["logits"])


@pytest.mark.parametrize(
    "key_fn", [lambda td: td["board_id"], lambda td: (td["board_id"], "board"), lambda td: ("v1", (td["board_id"],))]
)
def test_a_tensor_key_from_key_fn_is_keyed_by_its_value_and_an_unhashable_one_is_refused(policy, key_fn):
    # td["board_id"] itself hashes by identity, and so does a tuple holding it: every row missed, silently.
    with BatchedPolicyServer(policy, cache=EvaluationCache(key_fn=key_fn)) as server:
        remote = server.remote_policy()
        a = remote(obs(0).set("board_id", torch.tensor(5)))
        b = remote(obs(1).set("board_id", torch.tensor(5)))
        c = remote(obs(1).set("board_id", torch.tensor(6)))
        assert server.statistics().cache_hits == 1
    assert torch.equal(a["logits"], b["logits"]) and not torch.equal(b["logits"], c["logits"])
    with BatchedPolicyServer(policy, cache=EvaluationCache(key_fn=lambda td: [1, 2])) as server:
        with pytest.raises(BadRequestError, match=r"key_fn must return a hashable key, got list: \[1, 2\]"):
            server.remote_policy()(obs(0))


@pytest.mark.parametrize("path", ["thread", "worker"])
def test_a_key_fn_reading_an_entry_that_does_not_travel_is_a_bad_request_on_every_path(policy, path):
    # From a worker process only the policy's entries travel: a key_fn reading another one raised a bare KeyError.
    with BatchedPolicyServer(policy, cache=EvaluationCache(key_fn=lambda td: int(td["hash"]))) as server:
        remote = server.remote_policy()
        remote = remote if path == "thread" else pickle.loads(pickle.dumps(remote))
        with pytest.raises(BadRequestError, match=r"key_fn failed on entries \['observation'\]: KeyError"):
            remote(obs(0))


def test_key_fn_gets_each_row_of_a_multi_row_request(policy, net):
    seen: list = []

    def board(td: TensorDict) -> int:
        assert td.batch_size == ()  # one row at a time
        seen.append(int(td["board_id"]))
        return int(td["board_id"])

    with BatchedPolicyServer(policy, cache=EvaluationCache(key_fn=board)) as server:
        remote = server.remote_policy()
        rows = obs(0, 2, 2).set("board_id", torch.tensor([[1, 2], [3, 4]]))
        first = remote(rows.clone())  # computed; each row stored under its board
        single = remote(obs(9).set("board_id", torch.tensor(3)))  # other numbers, board 3: the cache trusts the key
        again = remote(rows.clone())
        stats = server.statistics()
    with torch.no_grad():
        expected = net(rows["observation"])
    assert torch.equal(first["logits"], expected) and torch.equal(again["logits"], expected)
    assert torch.equal(single["logits"], expected[1, 0])
    assert seen == [1, 2, 3, 4, 3, 1, 2, 3, 4]
    assert (stats.cache_hits, stats.requests) == (2, 1)


def test_interaction_types_do_not_share_entries(policy):
    with BatchedPolicyServer(policy, cache=EvaluationCache()) as server:
        remote = server.remote_policy()
        with set_interaction_type(InteractionType.DETERMINISTIC):
            remote(obs(0))
        with set_interaction_type(InteractionType.MODE):
            remote(obs(0))
            remote(obs(0))
        stats = server.statistics()
    assert (stats.cache_hits, stats.cache_misses) == (1, 2)


class Sampling(torch.nn.Module):
    """Draws a fresh sample per row when the interaction type is RANDOM; deterministic otherwise."""

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        mean = observation[..., :3]
        if interaction_type() is InteractionType.RANDOM:
            return mean + torch.randn_like(mean)
        return mean


def test_a_sampling_request_is_never_answered_with_another_calls_sample():
    gated = GatedPolicy(Sampling(), block_first=1)
    with BatchedPolicyServer(gated, cache=EvaluationCache(), timeout=1e6) as server:
        remote = server.remote_policy()
        with set_interaction_type(InteractionType.RANDOM):
            held = remote.submit(obs(1))
            assert gated.entered.wait(10)
            same = [remote.submit(obs(0)) for _ in range(2)]  # identical rows queued together: not coalesced
            gated.gate.set()
            samples = [held.result(10)] + [f.result(10) for f in same] + [remote(obs(0))]  # nor answered later
        stats = server.statistics()
    assert not torch.equal(samples[1]["logits"], samples[2]["logits"])
    assert not torch.equal(samples[2]["logits"], samples[3]["logits"])
    assert (stats.cache_hits, stats.cache_misses, stats.cache_coalesced, stats.requests) == (0, 0, 0, 4)


def _probabilistic_sampler() -> torch.nn.Module:
    from tensordict.nn import NormalParamExtractor, ProbabilisticTensorDictModule, ProbabilisticTensorDictSequential

    net = TensorDictModule(
        torch.nn.Sequential(torch.nn.Linear(8, 6), NormalParamExtractor()),
        in_keys=["observation"],
        out_keys=["loc", "scale"],
    )
    draw = ProbabilisticTensorDictModule(
        in_keys=["loc", "scale"],
        out_keys=["logits"],
        distribution_class=torch.distributions.Normal,
        default_interaction_type=InteractionType.RANDOM,
    )
    return ProbabilisticTensorDictSequential(net, draw)


def _exploring() -> torch.nn.Module:
    from tensordict.nn import TensorDictSequential
    from torchrl.data import Categorical
    from torchrl.modules import EGreedyModule

    greedy = TensorDictModule(lambda x: x[..., :1].long().abs(), in_keys=["observation"], out_keys=["logits"])
    return TensorDictSequential(greedy, EGreedyModule(Categorical(10**6), eps_init=1.0, action_key="logits"))


@pytest.mark.parametrize("make", [_probabilistic_sampler, _exploring], ids=["default-random", "egreedy"])
def test_a_policy_that_samples_when_no_interaction_type_is_set_is_not_cached_then(make):
    with BatchedPolicyServer(make(), cache=EvaluationCache()) as server:
        remote = server.remote_policy()
        assert interaction_type() is None
        first, again = remote(obs(0)), remote(obs(0))
        unset = server.statistics()
        with set_interaction_type(InteractionType.DETERMINISTIC):  # told not to sample: cached
            remote(obs(0))
            remote(obs(0))
        told = server.statistics(since=unset)
    assert (unset.cache_hits, unset.cache_misses, unset.requests) == (0, 0, 2)
    if make is _probabilistic_sampler:
        assert not torch.equal(first["logits"], again["logits"])
    assert (told.cache_hits, told.cache_misses) == (1, 1)


class Uncopyable(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(8, 3)

    def __deepcopy__(self, memo):
        raise RuntimeError("no copies")


def sign_key(td: TensorDict) -> int:
    return int(td["observation"][0] > 0)


def test_a_pickled_cache_is_a_new_empty_one_of_the_same_settings(policy):
    import pickle

    key = sign_key
    cache = EvaluationCache(capacity=7, key_fn=key)
    with BatchedPolicyServer(policy, cache=cache) as server:
        server.remote_policy()(obs(0))
        copy = pickle.loads(pickle.dumps(cache))  # as serve_on_ray ships it to the server actor
    assert (copy.capacity, copy.key_fn, len(copy), len(cache)) == (7, key, 0, 1)
    with BatchedPolicyServer(policy, cache=copy) as server:  # its own server's, not the first one's
        server.remote_policy()(obs(0))
        assert server.statistics().cache_misses == 1


def test_a_cache_serves_one_server_only(policy):
    cache = EvaluationCache()
    with pytest.raises(TypeError, match="cannot be copied"):  # a server refused after its checks takes no cache
        BatchedPolicyServer(TensorDictModule(Uncopyable(), in_keys=["observation"], out_keys=["logits"]), cache=cache)
    with BatchedPolicyServer(policy, cache=cache) as server:
        server.remote_policy()(obs(0))
    with pytest.raises(ValueError, match="belongs to another server"):  # its entries are the first one's, at v0
        BatchedPolicyServer(
            TensorDictModule(make_mlp(seed=1), in_keys=["observation"], out_keys=["logits"]), cache=cache
        )


def test_followers_of_a_cancelled_leader_still_get_their_row(net):
    gated = GatedPolicy(net)
    with BatchedPolicyServer(gated, cache=EvaluationCache(), timeout=1e6) as server:
        remote = server.remote_policy()
        first = remote.submit(obs(100))
        assert gated.entered.wait(10)
        leader = remote.submit(obs(7))
        followers = [remote.submit(obs(7)) for _ in range(3)]
        assert leader.cancel()
        gated.gate.set()
        outs = [f.result(10) for f in followers]
        first.result(10)
    with torch.no_grad():
        expected = net(obs(7)["observation"])
    assert all(torch.equal(o["logits"], expected) for o in outs)
    assert gated.batches == [1, 1]


def test_followers_share_their_leaders_failure_and_close(net):
    class Boom(GatedPolicy):
        def forward(self, td):
            td = super().forward(td)
            if len(self.batches) == 2:
                raise ValueError("policy failed")
            return td

    gated = Boom(net)
    with BatchedPolicyServer(gated, cache=EvaluationCache(), timeout=1e6) as server:
        remote = server.remote_policy()
        first = remote.submit(obs(100))
        assert gated.entered.wait(10)
        same = [remote.submit(obs(7)) for _ in range(3)]
        gated.gate.set()
        first.result(10)
        for fut in same:
            with pytest.raises(ValueError, match="policy failed"):
                fut.result(10)

    gated = GatedPolicy(net)
    server = BatchedPolicyServer(gated, cache=EvaluationCache(), timeout=1e6)
    remote = server.remote_policy()
    first = remote.submit(obs(100))
    assert gated.entered.wait(10)
    same = [remote.submit(obs(7)) for _ in range(3)]
    server.close(wait=False, cancel_pending=True)
    for fut in same:
        with pytest.raises(ServerClosedError):
            fut.result(10)
    gated.gate.set()
    first.result(10)
    assert server.close(timeout=10)


def test_a_row_that_joined_a_request_the_queue_then_refused_fails_with_it(net):
    # A follower joins its leader between the cache's admission and the queue: the leader's refusal is its own.
    gated = GatedPolicy(net)
    with BatchedPolicyServer(gated, cache=EvaluationCache(), max_queue_size=1, timeout=1e6) as server:
        remote = server.remote_policy()
        first = remote.submit(obs(100))
        assert gated.entered.wait(10)
        queued = remote.submit(obs(101))  # the queue is full
        queue, admitted, go, refused = server._queue, threading.Event(), threading.Event(), []
        put = queue.put

        def paused_put(request, may_serve=None):
            if threading.current_thread().name == "leader":
                admitted.set()  # admitted by the cache as the row's leader, not queued yet
                assert go.wait(10)
            return put(request, may_serve)

        def lead() -> None:
            try:
                remote.submit(obs(7))
            except QueueFullError as err:
                refused.append(err)

        queue.put = paused_put
        leader = threading.Thread(target=lead, name="leader")
        leader.start()
        assert admitted.wait(10)
        follower = remote.submit(obs(7))  # joins the leader: the cache coalesces it
        go.set()
        leader.join(10)
        assert len(refused) == 1
        with pytest.raises(QueueFullError):
            follower.result(10)
        gated.gate.set()
        first.result(10), queued.result(10)
        assert server.statistics().cache_coalesced == 1


def test_cache_arguments_are_checked(policy):
    with pytest.raises(ValueError, match="capacity must be an int >= 1"):
        EvaluationCache(capacity=0)
    with pytest.raises(ValueError, match="key_fn must be callable"):
        EvaluationCache(key_fn="hash")
    with pytest.raises(TypeError, match="cache must be an EvaluationCache or None, got dict"):
        BatchedPolicyServer(policy, cache={})


def test_cache_builds_from_config(policy):
    from torchrl_batchserve.config import build_server

    cfg = {"cache": {"_target_": "torchrl_batchserve.EvaluationCache", "capacity": 10}}
    with build_server(cfg, policy) as server:
        remote = server.remote_policy()
        remote(obs(0))
        remote(obs(0))
        assert isinstance(server.cache, EvaluationCache) and server.cache.capacity == 10
        assert server.statistics().cache_hits == 1
