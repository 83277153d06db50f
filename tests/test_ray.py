"""torchrl_batchserve.ray on a local three-node Ray cluster: one node serving, two with actors.

Ray listens on loopback only here: the tests run inside a private network
namespace (``tools/loopback-only``, which ``make test`` uses) and skip,
saying so, outside one. One cluster serves the whole module.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule, TensorDictModuleBase

ray = pytest.importorskip("ray")
from ray import cloudpickle  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from torchrl_batchserve import EvaluationCache, LengthCost, PackCollate, PadCollate  # noqa: E402
from torchrl_batchserve.errors import ServerBrokenError, ServerClosedError, WeightSyncError  # noqa: E402
from torchrl_batchserve.ray import RayServer, push_weights, serve_on_ray  # noqa: E402
from torchrl_batchserve.transport.client import _died  # noqa: E402

pytestmark = [
    pytest.mark.skipif(
        [name for _, name in socket.if_nameindex()] != ["lo"],
        reason="Ray tests run in a loopback-only network namespace: tools/loopback-only python -m pytest (make test)",
    ),
    pytest.mark.timeout(300),
    pytest.mark.ray_cluster,
]

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import the tests folder

SERVER = {"server": 0.01}  # the head node
NODE_A = {"node_a": 1}
NODE_B = {"node_b": 1}


def factory(seed: int = 0) -> TensorDictModule:
    torch.manual_seed(seed)
    return TensorDictModule(torch.nn.Linear(4, 3), in_keys=["obs"], out_keys=["act"])


def reference(weights: TensorDict | None, x: torch.Tensor) -> torch.Tensor:
    net = factory()
    if weights is not None:
        weights.to_module(net)
    with torch.no_grad():
        return net(TensorDict(obs=x))["act"]


def assert_serves(actor, version: int, weights: TensorDict | None, calls: int = 3) -> None:
    """``actor``'s next ``calls`` calls are served at ``version``, each the forward of ``weights``."""
    for x, act, got in ray.get(actor.calls.remote(calls)):
        assert got == version
        torch.testing.assert_close(act, reference(weights, x))


def observation(actor: int, i: int) -> torch.Tensor:
    return torch.arange(4, dtype=torch.float32) * (actor + 1) + i


class SlowLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.2)
        return self.linear(x)


class PendulumNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)

    def forward(self, th: torch.Tensor, thdot: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.stack([th, thdot], -1))


class MaskedMean(torch.nn.Module):
    """``factory``'s linear layer on the mean of a sequence's real elements."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, obs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear((obs * mask.unsqueeze(-1)).sum(-2) / mask.sum(-1, keepdim=True)), mask.float()


class PackedMean(torch.nn.Module):
    """``factory``'s linear layer on the mean of each set of packed elements; a 1 per element."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, obs, segment_ids, offsets) -> tuple[torch.Tensor, torch.Tensor]:
        sums = torch.zeros(len(offsets) - 1, 4).index_add_(0, segment_ids, obs)
        return self.linear(sums / offsets.diff().unsqueeze(-1)), torch.ones(len(obs))


def packed_factory() -> TensorDictModule:
    return TensorDictModule(PackedMean(), in_keys=["obs", "segment_ids", "offsets"], out_keys=["act", "real"])


def padded_factory() -> TensorDictModule:
    return TensorDictModule(MaskedMean(), in_keys=["obs", "mask"], out_keys=["act", "real"])


class Shifted(torch.nn.Module):
    """``factory``'s linear layer on the input plus a non-persistent buffer (a state_dict leaves it out)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 3)
        self.register_buffer("shift", torch.ones(4), persistent=False)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.linear(obs + self.shift)


def shifted_factory() -> TensorDictModule:
    return TensorDictModule(Shifted(), in_keys=["obs"], out_keys=["act"])


def slow_factory() -> TensorDictModule:
    return TensorDictModule(SlowLinear(), in_keys=["obs"], out_keys=["act"])


class Quantized(torch.nn.Module):
    """A linear layer with a float8 scale (a quantized policy's), its output also as uint16 codes."""

    def __init__(self, scale: float = 0.5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 3)
        self.register_buffer("scale", torch.full((3,), scale, dtype=torch.float8_e4m3fn))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        act = self.linear(obs) * self.scale.float()
        return act, (act.abs() * 1000).to(torch.int32).to(torch.uint16)


def quantized_factory() -> TensorDictModule:
    return TensorDictModule(Quantized(), in_keys=["obs"], out_keys=["act", "code"])


class Chunking(TensorDictModuleBase):
    """A VLA policy's outputs: its out_key ``("vla_action", "chunk")`` in a ``VLAAction``, whose mask it also sets."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 3)
        self.in_keys, self.out_keys = ["obs"], [("vla_action", "chunk")]

    def forward(self, td: TensorDict) -> TensorDict:
        from torchrl.data.vla import VLAAction  # a tensorclass every Ray worker can import

        chunk = self.linear(td["obs"])
        return td.set("vla_action", VLAAction(chunk=chunk, mask=chunk > 0, batch_size=td.batch_size))


@ray.remote(num_cpus=0)
def action_on_a_node(remote, x: torch.Tensor) -> tuple[str, torch.Tensor, torch.Tensor | None]:
    action = remote(TensorDict(obs=x)).get("vla_action")
    return type(action).__name__, action.chunk, action.mask


@ray.remote(num_cpus=0)
def served_on_a_node(remote, x: torch.Tensor) -> tuple[list, list, int]:
    """One call of ``remote`` in a task; its outputs as lists."""
    out = remote(TensorDict(obs=x))
    return out["act"].tolist(), out["code"].tolist(), int(out["policy_version"])


@ray.remote(num_cpus=0)
class Actor:
    """An actor on a node of its own: calls the policy and reports what it got."""

    def __init__(self, remote, index: int) -> None:
        self.remote = remote
        self.index = index

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def calls(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        out = []
        for i in range(n):
            x = observation(self.index, i)
            td = self.remote(TensorDict(obs=x))
            out.append((x, td["act"], int(td["policy_version"])))
        return out

    def concurrent(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        xs = [observation(self.index, i) for i in range(n)]
        futures = [self.remote.submit(TensorDict(obs=x)) for x in xs]
        return [(x, f.result(timeout=60)["act"]) for x, f in zip(xs, futures)]

    def acalls(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        import asyncio

        async def main():
            xs = [observation(self.index, i) for i in range(n)]
            tds = await asyncio.gather(*(self.remote.acall(TensorDict(obs=x)) for x in xs))
            return [(x, td["act"]) for x, td in zip(xs, tds)]

        return asyncio.run(main())

    def sequences(self, n: int, lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``n`` requests in flight at once, of copies of one observation; lengths cycle, every third has 2 rows."""
        xs = [observation(self.index, i) for i in range(n)]
        tds = [
            TensorDict(obs=x.expand(2, lengths[i % len(lengths)], 4).clone(), batch_size=[2])
            if i % 3 == 2
            else TensorDict(obs=x.expand(lengths[i % len(lengths)], 4).clone())
            for i, x in enumerate(xs)
        ]
        futures = [self.remote.submit(td) for td in tds]
        outs = [f.result(timeout=60) for f in futures]  # "real": the mask, cut back to the request's length
        assert all(td["real"].shape == td["obs"].shape[:-1] and bool(td["real"].all()) for td in outs)
        return [(x, td["act"]) for x, td in zip(xs, outs)]

    def outcomes(self, values: list[float]) -> list[tuple[str, str]]:
        """A call with an observation of each value: ``("ok", "")`` or the error's class and message."""
        out = []
        for value in values:
            try:
                self.remote(TensorDict(obs=torch.full((4,), value)))
                out.append(("ok", ""))
            except Exception as err:  # the class is what the test checks
                out.append((type(err).__name__, str(err)))
        return out

    def until_error(self, seconds: float) -> tuple[str, float, str]:
        """Call until a call fails; the error's class, when it came, and its message."""
        deadline = time.time() + seconds
        while time.time() < deadline:
            try:
                self.remote(TensorDict(obs=torch.ones(4)))
            except Exception as err:  # the class is what the test checks
                return type(err).__name__, time.time(), str(err)
        return "none", time.time(), ""

    def collect(self, frames: int) -> tuple[int, list[int]]:
        from torchrl.collectors import Collector
        from torchrl.envs import PendulumEnv

        collector = Collector(
            PendulumEnv,
            self.remote,
            frames_per_batch=frames,
            total_frames=frames,
            auto_register_policy_transforms=False,
        )
        try:
            batch = next(iter(collector))
        finally:
            collector.shutdown()
        return batch.numel(), batch["policy_version"].unique().tolist()


@contextlib.contextmanager
def served(policy_factory=factory, **kwargs):
    """A server on the head node (``serve_on_ray``), closed after the block."""
    handle = serve_on_ray(policy_factory, num_cpus=0, resources=SERVER, **kwargs)
    try:
        yield handle
    finally:
        handle.close()


def spread(remote, n: int) -> list:
    """``n`` actors calling ``remote``, alternately on the two actor nodes."""
    return [Actor.options(resources=(NODE_A, NODE_B)[i % 2]).remote(remote, i) for i in range(n)]


def _hub_folders() -> set[str]:
    return {f for d in {tempfile.gettempdir(), "/tmp"} for f in glob.glob(os.path.join(d, "torchrl_batchserve-*"))}


@pytest.fixture(scope="module")
def cluster():
    before = _hub_folders()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"server": 1}})
    cluster.add_node(num_cpus=1, resources={"node_a": 100})
    cluster.add_node(num_cpus=1, resources={"node_b": 100})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    # The server actors and gateways that the tests kill, or that Ray ends, exit as killed and leave their
    # hub's folder (a socket file nobody listens to tells their workers they died): remove those.
    for folder in _hub_folders() - before:
        if _died(os.path.join(folder, "hub.sock")):  # (as a worker tells)
            shutil.rmtree(folder, ignore_errors=True)


def _listening() -> list[str]:
    """The local addresses of every listening TCP socket of this network namespace."""
    found = []
    for path, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(path) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A":  # LISTEN
                    found.append(local.split(":")[0].rjust(width, "0"))
    return found


def _loopback(hex_address: str) -> bool:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return raw[::-1][0] == 127  # /proc writes IPv4 in host (little-endian) order
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))  # four host-order words
    return words == bytes(15) + b"\x01" or (words[:12] == bytes(10) + b"\xff\xff" and words[12] == 127)


def test_ray_listens_on_loopback_only(cluster):
    addresses = _listening()
    assert addresses, "the cluster listens somewhere"
    assert all(_loopback(a) for a in addresses), [a for a in addresses if not _loopback(a)]


def test_actors_on_two_nodes_and_the_driver_get_exact_results(cluster):
    with served(max_batch_size=16, timeout=0.002) as handle:
        remote = handle.remote_policy()
        actors = spread(remote, 4)
        nodes = ray.get([a.node.remote() for a in actors])
        assert len(set(nodes)) == 2 and ray.get_runtime_context().get_node_id() not in nodes
        results = ray.get([a.calls.remote(25) for a in actors])
        results.append([(x, act, 0) for x, act in ray.get(actors[1].concurrent.remote(8))])  # submit, 8 in flight
        results.append([(x, act, 0) for x, act in ray.get(actors[2].acalls.remote(8))])  # 8 asyncio tasks
        here = [(x, remote(TensorDict(obs=x))["act"], 0) for x in (observation(9, i) for i in range(5))]
        for x, act, version in [row for rows in results for row in rows] + here:
            assert version == 0
            torch.testing.assert_close(act, reference(None, x))
        assert handle.statistics().rows == 4 * 25 + 8 + 8 + 5
        assert handle.close()  # the serve loops stopped (the block's own close is then a no-op)


def test_a_server_actor_serves_with_the_evaluation_cache_it_was_given(cluster):
    # The cache travels among the server keywords as a new empty one of the same settings.
    with served(cache=EvaluationCache(100)) as handle:
        remote = handle.remote_policy()
        x = observation(0, 0)
        first, again = remote(TensorDict(obs=x)), remote(TensorDict(obs=x))
        torch.testing.assert_close(again["act"], reference(None, x))
        assert torch.equal(first["act"], again["act"]) and handle.statistics().cache_hits == 1


def test_each_gateway_batch_reaches_the_server_as_one_request(cluster):
    # No request pays a Ray call or a trip of its own: what reaches the server from the other
    # nodes is exactly their gateways' batches, rows for rows.
    with served(max_batch_size=16, timeout=0.01) as handle:
        remote = handle.remote_policy()
        actors = spread(remote, 6)
        ray.get([a.calls.remote(20) for a in actors])
        stats, gateways = handle.statistics(), handle.gateway_statistics()
        assert len(gateways) == 2
        assert sum(g.batches for g in gateways.values()) == stats.requests
        assert sum(g.rows for g in gateways.values()) == stats.rows == 6 * 20
        assert all(g.requests == 3 * 20 for g in gateways.values())


def test_gateways_of_a_padded_server_with_a_cost_bound_serve_its_variable_length_requests(cluster):
    # A gateway asked its node's actors for the mask the server's collate writes (refused: missing), its
    # batches could cost more than max_batch_cost (refused too), and it stacked its requests: a length other
    # than the first one's was refused.
    kwargs = {"collate": PadCollate(["obs"], trim_keys=["real"]), "cost_fn": LengthCost("obs"), "max_batch_cost": 20}
    with served(padded_factory, max_batch_size=16, timeout=0.01, **kwargs) as handle:
        actors = spread(handle.remote_policy(), 2)
        rows = [row for rows in ray.get([a.sequences.remote(12, [3, 1, 5, 2]) for a in actors]) for row in rows]
        for x, act in rows:
            torch.testing.assert_close(act, reference(None, x).expand_as(act))
        assert handle.statistics().rows == 2 * (12 + 4)  # every third request has two rows


def test_an_out_key_inside_a_tensorclass_reaches_every_node_in_that_tensorclass_whole(cluster):
    # The gateways asked for the out_key alone: on the other nodes the tensorclass came without its other fields.
    with served(Chunking) as handle:
        remote = handle.remote_policy()
        where = [SERVER, NODE_A, NODE_B, NODE_A]  # the server's node (its hub), then the gateways' (one started)
        got = ray.get(
            [action_on_a_node.options(resources=r).remote(remote, observation(i, 0)) for i, r in enumerate(where)]
        )
    with torch.no_grad():
        for i, (kind, chunk, mask) in enumerate(got):
            expected = Chunking()(TensorDict(obs=observation(i, 0)))["vla_action"]
            assert kind == "VLAAction" and mask is not None
            torch.testing.assert_close((chunk, mask), (expected.chunk, expected.mask))


def test_gateways_of_a_packing_server_serve_its_variable_length_requests(cluster):
    with served(
        packed_factory, max_batch_size=16, timeout=0.01, collate=PackCollate(["obs"], element_keys=["real"])
    ) as handle:
        actors = spread(handle.remote_policy(), 2)
        rows = [row for rows in ray.get([a.sequences.remote(9, [2, 4, 1]) for a in actors]) for row in rows]
        for x, act in rows:
            torch.testing.assert_close(act, reference(None, x).expand_as(act))


def test_versions_are_exact_across_pushes_and_a_bad_push_changes_nothing(cluster):
    with served(max_batch_size=16, timeout=0.002) as handle:
        remote = handle.remote_policy()
        actors = spread(remote, 2)
        ray.get([a.calls.remote(1) for a in actors])
        pushed = {0: None}
        running = [a.calls.remote(60) for a in actors]
        for version in range(1, 6):
            weights = TensorDict.from_module(factory(seed=version)).data.clone()
            assert handle.update_weights(weights) == version
            pushed[version] = weights
            time.sleep(0.05)
        bad = TensorDict(weight=torch.zeros(3, 5), bias=torch.zeros(3))
        with pytest.raises(WeightSyncError, match="weight"):
            handle.update_weights(bad)
        for rows in ray.get(running):
            versions = [v for _, _, v in rows]
            assert versions == sorted(versions)
            for x, act, version in rows:
                torch.testing.assert_close(act, reference(pushed[version], x))
        after = ray.get(actors[0].calls.remote(3))
        assert all(v == 5 for _, _, v in after)
        for x, act, _ in after:
            torch.testing.assert_close(act, reference(pushed[5], x))
        # A handle pickled elsewhere (a trainer on another node) pushes to the same server.
        copy = cloudpickle.loads(cloudpickle.dumps(handle))
        assert isinstance(copy, RayServer) and copy.update_weights(pushed[5]) == 6
        # A version given, as BatchedPolicyServer.update_weights takes it (e.g. the training step)
        assert handle.update_weights(pushed[3], version=10) == 10
        assert ray.get(actors[0].calls.remote(1))[0][2] == 10
        for version, message in ((10, "version must increase: staged 10, got 10"), ("11", "must be an int")):
            with pytest.raises(WeightSyncError, match=message):
                handle.update_weights(pushed[3], version=version)
        assert handle.statistics().policy_version == 10 and handle.update_weights(pushed[5]) == 11


def test_a_handle_its_copy_and_its_scheme_push_a_state_dict_that_leaves_out_a_non_persistent_buffer(cluster):
    # The handle checks a push against the served layout before it sends it: it refused the state_dict.
    with served(shifted_factory, max_batch_size=16, timeout=0.002) as handle:
        trained = Shifted()
        with torch.no_grad():
            trained.linear.weight.mul_(-2)
            trained.shift.fill_(5)  # not in its state_dict: the server keeps its own
        assert handle.update_weights(trained.state_dict()) == 1
        x = observation(0, 1)
        out = handle.remote_policy()(TensorDict(obs=x))
        with torch.no_grad():
            torch.testing.assert_close(out["act"], trained.linear(x + 1))
        assert cloudpickle.loads(cloudpickle.dumps(handle)).update_weights(trained.state_dict()) == 2
        scheme = handle.weight_sync_scheme()  # what a collector's update_policy_weights_ calls
        scheme.init_on_sender(model_id="policy", context=None)
        scheme.connect()
        assert scheme.send(trained.state_dict()) == 3
        with pytest.raises(WeightSyncError, match="no trainer module in this process"):
            scheme.send()  # update_policy_weights_() with no weights: a bare TypeError before


def test_float8_weights_reach_a_ray_server_and_uint16_outputs_come_back_through_a_gateway(cluster):
    # torch's own pickling, which Ray's object store uses, cannot restore float8 or uint16 tensors
    with served(quantized_factory, max_batch_size=8) as handle:
        trained = Quantized(scale=2.0)
        assert handle.update_weights(trained) == 1
        x = observation(0, 1)
        act, code, version = ray.get(served_on_a_node.options(resources=NODE_A).remote(handle.remote_policy(), x))
        # a float64 copy of the float32 weights is cast to them as it is staged; the float8 scale must match
        doubled = TensorDict.from_module(trained).apply(lambda t: t.double() if t.dtype == torch.float32 else t)
        assert handle.update_weights(doubled) == 2
        again = ray.get(served_on_a_node.options(resources=NODE_A).remote(handle.remote_policy(), x))
    with torch.no_grad():
        want_act, want_code = trained(x)
    assert version == 1 and code == want_code.tolist()
    torch.testing.assert_close(torch.tensor(act), want_act)
    assert again == (act, code, 2)


def recurrent_factory() -> TensorDictModule:
    from tensordict.nn import TensorDictSequential
    from torchrl.modules import LSTMModule

    torch.manual_seed(0)
    lstm = LSTMModule(input_size=4, hidden_size=8, in_key="obs", out_key="embed")
    return TensorDictSequential(lstm, TensorDictModule(torch.nn.Linear(8, 3), in_keys=["embed"], out_keys=["act"]))


def test_a_ray_served_recurrent_policy_gives_collectors_the_primer_of_its_state(cluster):
    # what a collector with auto_register_policy_transforms=True adds to its env
    with served(recurrent_factory) as handle:
        for copy in (handle, cloudpickle.loads(cloudpickle.dumps(handle))):
            primer = copy.remote_policy().make_tensordict_primer()
            assert set(primer.primers.keys()) == {"recurrent_state_h", "recurrent_state_c"}
            assert primer.primers["recurrent_state_h"].shape == (1, 8)


RAY_RECIPE = """
defaults:
  - env: mock_for_ray_tests
  - collector: sync
  - server@server: batchserve_ray
  - _self_
server:
  name: ray_recipe
  num_cpus: 0
  resources: {server: 0.01}
  max_batch_size: 8
  policy:
    _target_: tensordict.nn.TensorDictModule
    module: {_target_: torch.nn.Linear, in_features: 7, out_features: 7}
    in_keys: [observation]
    out_keys: [action]
collector:
  create_env_fn: ${env}
  backend: ray
  num_collectors: 2
  sync: true
  backend_options:
    remote_configs: [{num_cpus: 0, resources: {node_a: 1}}, {num_cpus: 0, resources: {node_b: 1}}]
  frames_per_batch: 16
  total_frames: 32
  policy: ${server}
remote:
  _target_: torchrl_batchserve.config.remote_policy
  server: ${server}
"""


def test_a_ray_server_node_is_the_policy_of_torchrls_collector_node_on_the_ray_backend(cluster, tmp_path):
    from dataclasses import make_dataclass

    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.utils import instantiate
    from torchrl.trainers.algorithms.configs.common import ConfigBase

    import torchrl_batchserve.config  # noqa: F401  (registers the nodes)

    env = [("_target_", str, "torchrl.testing.mocking_classes.ContinuousActionVecMockEnv"), ("_partial_", bool, True)]
    ConfigStore.instance().store(
        group="env", name="mock_for_ray_tests", node=make_dataclass("MockEnv", env, bases=(ConfigBase,))
    )
    (tmp_path / "recipe.yaml").write_text(RAY_RECIPE)
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        cfg = compose(config_name="recipe")
    handle = instantiate(cfg.server)
    try:
        assert isinstance(handle, RayServer) and instantiate(cfg.server) is handle  # one server per name
        trainer = TensorDictModule(torch.nn.Linear(7, 7), in_keys=["observation"], out_keys=["action"])
        assert handle.update_weights(trainer) == 1  # known weights: the actor built its own
        # TorchRL's RayCollector, its policy the handle (its backend_options taken as plain dicts)
        collector = instantiate(cfg.collector, _convert_="all")
        try:
            batch = next(iter(collector)).reshape(-1)
        finally:
            collector.shutdown()
        assert batch.numel() == 16 and batch["policy_version"].eq(1).all()
        with torch.no_grad():
            torch.testing.assert_close(batch["action"], trainer(batch.exclude("action"))["action"])
        remote = instantiate(cfg.remote)
        assert int(remote(TensorDict(observation=torch.ones(7)))["policy_version"]) == 1
    finally:
        handle.close()
    assert instantiate(cfg.server) is not handle  # a closed one is started anew
    instantiate(cfg.server).close()


def test_one_push_reaches_several_servers_as_one_version_or_none(cluster):
    servers = [serve_on_ray(factory, num_cpus=0, resources=SERVER, max_batch_size=8) for _ in range(2)]
    try:
        assert servers[0].update_weights(TensorDict.from_module(factory(seed=1)).data.clone()) == 1  # one ahead
        pushed = TensorDict.from_module(factory(seed=2)).data.clone()
        assert push_weights(servers, pushed) == 2
        with pytest.raises(WeightSyncError, match="bias"):
            push_weights(servers, {"weight": torch.zeros(3, 4), "bias": torch.zeros(4)})
        for server in servers:
            assert_serves(Actor.options(resources=NODE_B).remote(server.remote_policy(), 0), 2, pushed)
            assert server.statistics().policy_version == 2
    finally:
        for server in servers:
            server.close()


def test_a_collector_on_an_actor_node_collects_through_the_ray_served_policy(cluster):
    def pendulum_policy() -> TensorDictModule:
        return TensorDictModule(PendulumNet(), in_keys=["th", "thdot"], out_keys=["action"])

    with served(pendulum_policy, max_batch_size=8) as handle:
        actor = Actor.options(resources=NODE_B).remote(handle.remote_policy(), 0)
        frames, versions = ray.get(actor.collect.remote(32))
        assert frames == 32 and versions == [0]
        assert handle.statistics().rows >= 32


def _call_in(remote, results) -> None:
    try:
        results.put(("ok", remote(TensorDict(obs=torch.ones(4)))["act"].tolist()))
    except BaseException as err:
        results.put((type(err).__name__, str(err)))


@ray.remote(num_cpus=0)
def fork_and_call(remote, warm: bool) -> tuple:
    """Call ``remote`` in a child forked from this Ray worker (after calling it here first, if ``warm``)."""
    import multiprocessing

    if warm:
        remote(TensorDict(obs=torch.ones(4)))
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    child = ctx.Process(target=_call_in, args=(remote, results))
    child.start()
    try:
        return results.get(timeout=60)
    finally:
        child.join(10)
        child.kill()


def test_a_child_forked_from_a_ray_worker_calls_through_the_hub_it_inherited_or_is_told_why_it_cannot(cluster):
    # Ray's connection does not survive a fork: asking the server actor from the child would hang
    with served() as handle:
        remote = handle.remote_policy()
        outcome, act = ray.get(fork_and_call.options(resources=NODE_A).remote(remote, True), timeout=120)
        assert outcome == "ok"
        torch.testing.assert_close(torch.tensor(act), reference(None, torch.ones(4)))
        outcome, why = ray.get(fork_and_call.options(resources=NODE_B).remote(remote, False), timeout=120)
        assert outcome == "ServerBrokenError" and "call it once before forking" in why


def pendulum_factory() -> TensorDictModule:
    torch.manual_seed(0)
    return TensorDictModule(PendulumNet(), in_keys=["th", "thdot"], out_keys=["action"])


def test_torchrls_ray_collector_given_the_handle_collects_through_the_server_and_pushes_through_it(cluster):
    # RayCollector(policy=...) takes a Ray-owned inference service as TorchRL's InferenceServer is one: the handle too
    from torchrl.collectors.distributed import RayCollector
    from torchrl.envs import PendulumEnv

    trainer = pendulum_factory()
    versions = {0: TensorDict.from_module(trainer).data.clone()}
    with served(pendulum_factory, max_batch_size=8) as handle:
        nodes = [{"num_cpus": 0, "resources": node} for node in (NODE_A, NODE_B)]
        collector = RayCollector(
            [PendulumEnv, PendulumEnv],
            policy=handle,
            frames_per_batch=32,
            total_frames=96,
            sync=True,
            remote_configs=nodes,
        )
        try:
            for i, batch in enumerate(collector):
                assert batch["policy_version"].unique().tolist() == [i]  # sync: each batch collected after the push
                net = pendulum_factory()
                versions[i].to_module(net)
                with torch.no_grad():
                    torch.testing.assert_close(batch["action"], net(batch.exclude("action"))["action"])
                with torch.no_grad():
                    trainer.module.linear.weight.add_(0.5)
                collector.update_policy_weights_(trainer)
                versions[i + 1] = TensorDict.from_module(trainer).data.clone()
        finally:
            collector.shutdown()
        assert i == 2 and handle.statistics().policy_version == 3
        assert handle.statistics().rows >= 96


@pytest.fixture
def torchrl_semaphores_removed():
    """Unlink the named semaphores (``/dev/shm/sem.mp-*``) that appeared during the test.

    A ``MultiSyncCollector`` in a Ray actor leaves its ``multiprocessing``
    semaphores behind: Ray ends the actor's child processes, its resource
    tracker among them, before they are unlinked (22 a run here). The package
    makes none (its shared memory is memfds, its bells eventfds), so what
    appears meanwhile is theirs; unlinking a name leaves any open handle working.
    """
    before = set(os.listdir("/dev/shm"))
    yield
    for name in set(os.listdir("/dev/shm")) - before:
        if name.startswith("sem.mp-"):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join("/dev/shm", name))


def ended_or_killed(pids: list[int], within: float = 20.0) -> None:
    """Wait for the processes of ``pids`` to end; kill those left after ``within`` seconds.

    TorchRL 0.14.1's ``RayCollector.shutdown()`` ends a remote ``MultiSyncCollector`` with the collector alive:
    if its default weight sync scheme is collected at the interpreter's exit, its ``__del__`` starts a thread,
    which never runs then, and the process hangs for good (a ``ray::MultiSyncCollector`` left after the suite).
    """
    deadline = time.monotonic() + within
    for pid in pids:
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.usefixtures("torchrl_semaphores_removed")
def test_worker_processes_of_a_collector_on_an_actor_node_reach_the_server_through_the_nodes_gateway(cluster):
    # each remote collector a MultiSyncCollector: it pickles the policy into spawned processes, which are not Ray
    # processes and cannot unpickle the server actor's handle; they get the hub of their node's gateway instead
    from torchrl.collectors import MultiSyncCollector
    from torchrl.collectors.distributed import RayCollector
    from torchrl.envs import PendulumEnv

    trainer = pendulum_factory()
    weights = TensorDict.from_module(trainer).data.clone()
    with served(pendulum_factory, max_batch_size=8) as handle:
        collector = RayCollector(
            [PendulumEnv],
            policy=handle,
            collector_class=MultiSyncCollector,
            num_workers_per_collector=2,
            frames_per_batch=32,
            total_frames=64,
            sync=True,
            remote_configs=[{"num_cpus": 0, "resources": NODE_A}],
        )
        # before iterating: the iterator shuts the collector down at its end, and lists no remote collector then
        pids = ray.get([c.__ray_call__.remote(lambda self: os.getpid()) for c in collector.remote_collectors])
        assert len(pids) == 1
        try:
            for i, batch in enumerate(collector):
                batch = batch.reshape(-1)
                assert batch.numel() == 32 and batch["policy_version"].unique().tolist() == [i]
                net = pendulum_factory()
                weights.to_module(net)
                with torch.no_grad():
                    torch.testing.assert_close(batch["action"], net(batch.exclude("action"))["action"])
                    trainer.module.linear.weight.mul_(-1)
                collector.update_policy_weights_(trainer)
                weights = TensorDict.from_module(trainer).data.clone()
        finally:
            collector.shutdown()
            ended_or_killed(pids)
        assert i == 1
        (gateway,) = handle.gateway_statistics().values()
        assert gateway.rows >= 64


def test_the_server_serves_on_when_a_node_with_actors_dies(cluster):
    node = cluster.add_node(num_cpus=1, resources={"node_c": 100})
    cluster.wait_for_nodes()
    with served(max_batch_size=16, timeout=0.002) as handle:
        remote = handle.remote_policy()
        doomed = Actor.options(resources={"node_c": 1}).remote(remote, 0)
        survivor = Actor.options(resources=NODE_A).remote(remote, 1)
        ray.get([doomed.calls.remote(3), survivor.calls.remote(3)])
        running = doomed.until_error.remote(60)
        cluster.remove_node(node)
        with pytest.raises(ray.exceptions.RayError):
            ray.get(running, timeout=60)
        for x, act, _ in ray.get(survivor.calls.remote(10)):
            torch.testing.assert_close(act, reference(None, x))
        # the dead node's gateway is left out of the statistics, which raised RayActorError once a node died
        gateways, alive = handle.gateway_statistics(), ray.get(survivor.node.remote())
        assert list(gateways) == [alive] and gateways[alive].rows == 13


def test_closing_a_ray_server_tells_its_actors_on_every_node_that_it_closed(cluster):
    # Not that it died: each node's gateway serves what its actors queued and tells them, before it goes.
    handle = serve_on_ray(factory, num_cpus=0, resources=SERVER, max_batch_size=16, timeout=0.002)
    remote = handle.remote_policy()
    actors = [*spread(remote, 2), Actor.options(resources=SERVER).remote(remote, 2)]  # the server's node too
    ray.get([a.calls.remote(1) for a in actors])
    running = [a.until_error.remote(120) for a in actors]
    while handle.statistics().batches < 6:  # all are calling
        time.sleep(0.05)
    start = handle.statistics()  # pickled here and back: still the server actor's own snapshot
    assert handle.statistics(since=start).requests >= 0
    # refused here, before anything reaches the actor or closes: the actors call on
    with pytest.raises(ValueError, match=r"timeout must be a finite number of seconds >= 0 \(got 'soon'\)"):
        handle.close(timeout="soon")
    with pytest.raises(TypeError, match=r"since must be a ServerStatistics \(an earlier statistics\(\)\), got int"):
        handle.statistics(since=5)
    for servers in ([], [handle, 5]):
        with pytest.raises(TypeError, match=r"servers must be a non-empty sequence of RayServer handles"):
            push_weights(servers, factory())
    assert not handle.closed
    assert handle.close() and handle.close()  # the second returns what the first did
    assert [name for name, _, _ in ray.get(running, timeout=120)] == ["ServerClosedError"] * 3
    # and so is every later call, though the server actor is gone by now
    assert [name for name, _, _ in ray.get([a.until_error.remote(30) for a in actors])] == ["ServerClosedError"] * 3
    for use in (lambda: handle.update_weights(factory()), handle.statistics, handle.gateway_statistics):
        with pytest.raises(ServerClosedError, match=r"the server is closed \(this handle closed it\)"):
            use()  # not Ray's ActorDiedError


def test_a_dead_server_actor_fails_every_waiting_actor_promptly(cluster):
    handle = serve_on_ray(slow_factory, num_cpus=0, resources=SERVER, max_batch_size=16, timeout=0.002)
    actors = spread(handle.remote_policy(), 2)
    ray.get([a.calls.remote(1) for a in actors])
    running = [a.until_error.remote(120) for a in actors]
    while handle.statistics().batches < 4:  # both are calling
        time.sleep(0.05)
    killed = time.time()
    ray.kill(handle.actor, no_restart=True)
    for name, when, message in ray.get(running, timeout=120):
        assert name == "ServerBrokenError", message
        assert when - killed < 30
    with pytest.raises(ServerBrokenError):
        handle.remote_policy()(TensorDict(obs=torch.ones(4)))


def test_a_gateway_that_ray_ends_gracefully_tells_its_actors_the_server_broke_not_that_it_closed(cluster):
    # A dead server actor's gateways go out of scope with it. Where Ray ended one gracefully (its atexit
    # handlers run) rather than at once, the gateway's server was abandoned, and its actors were told it
    # closed: RayEndpoint keeps a closed server's policy for good, so a restarted server was never found.
    from torchrl_batchserve import BatchedPolicyServer
    from torchrl_batchserve.gateway import Gateway, LinkListener

    with BatchedPolicyServer(factory(), max_batch_size=8) as server:  # the server actor's end, here
        links = LinkListener(server, ["act", "policy_version"], "127.0.0.1")
        try:
            gateway = (
                ray.remote(Gateway)
                .options(num_cpus=0, resources=NODE_A)
                .remote(
                    (links.address, links.authkey), ["obs"], ["act", "policy_version"], {"policy_version_key": None}
                )
            )
            remote = ray.get(gateway.remote_policy.remote())  # the node's hub: this process is on its host
            x = observation(0, 0)
            torch.testing.assert_close(remote(TensorDict(obs=x))["act"], reference(None, x))
            del gateway  # out of scope: Ray ends it gracefully
            with pytest.raises(ServerBrokenError):
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    remote(TensorDict(obs=x))
        finally:
            links.close()


def test_a_gateway_ended_by_sigterm_fails_its_actors_once_and_a_new_gateway_serves_them(cluster):
    # Its server was abandoned, and the node's actors were told "closed" for good while the server served on.
    def gateway_pid(server_actor, node):
        return ray.get(server_actor._gateways[node][0].__ray_call__.remote(lambda gateway: os.getpid()))

    with served(max_batch_size=16, timeout=0.002) as handle:
        actor = Actor.options(resources=NODE_A).remote(handle.remote_policy(), 0)
        ray.get(actor.calls.remote(1))
        node = ray.get(actor.node.remote())
        os.kill(ray.get(handle.actor.__ray_call__.remote(gateway_pid, node)), signal.SIGTERM)
        name, _, message = ray.get(actor.until_error.remote(60), timeout=120)
        assert name == "ServerBrokenError", message
        assert_serves(actor, 0, None)


def test_a_server_actor_ended_by_sigterm_is_broken_to_every_actor_and_found_again_once_restarted(cluster):
    # A SIGTERM (an operator's kill, a container stopped) ends the server actor gracefully: its server's finalizer
    # told the actors of its node "closed", which RayEndpoint keeps for good, so the restarted actor was
    # never found.
    with served(max_restarts=1, max_batch_size=16, timeout=0.002) as handle:
        remote = handle.remote_policy()
        actors = [Actor.options(resources=SERVER).remote(remote, 0), Actor.options(resources=NODE_A).remote(remote, 1)]
        ray.get([a.calls.remote(1) for a in actors])
        os.kill(ray.get(handle.actor.__ray_call__.remote(lambda self: os.getpid())), signal.SIGTERM)
        for name, _, message in ray.get([a.until_error.remote(60) for a in actors], timeout=120):
            assert name == "ServerBrokenError", message
        pushed = TensorDict.from_module(factory(seed=7)).data.clone()
        assert handle.update_weights(pushed) == 1
        for actor in actors:
            assert_serves(actor, 1, pushed)


def test_a_restarted_server_is_found_again_and_serves_after_the_next_push(cluster):
    with served(max_restarts=1, max_batch_size=16, timeout=0.002) as handle:
        remote = handle.remote_policy()
        actor = Actor.options(resources=NODE_A).remote(remote, 0)
        pushed = TensorDict.from_module(factory(seed=7)).data.clone()
        assert handle.update_weights(pushed) == 1
        assert {v for _, _, v in ray.get(actor.calls.remote(3))} == {1}
        ray.kill(handle.actor, no_restart=False)  # Ray restarts it from the factory
        name, _, _ = ray.get(actor.until_error.remote(60))
        assert name == "ServerBrokenError"  # its gateway went with the old server
        with pytest.raises(ServerBrokenError, match="restarted"):
            remote(TensorDict(obs=torch.ones(4)))  # the factory's weights are not served
        assert handle.update_weights(pushed) == 2  # versions go on from the handle's last push
        for x, act, version in ray.get(actor.calls.remote(5)) + [
            (x, remote(TensorDict(obs=x))["act"], 2) for x in [torch.ones(4)]
        ]:
            assert version == 2
            torch.testing.assert_close(act, reference(pushed, x))


def test_serve_on_ray_refuses_bad_arguments(cluster):
    with pytest.raises(ValueError, match="gateway_depth"):
        serve_on_ray(factory, gateway_depth=0)
    with pytest.raises(ValueError, match=r"start_timeout must be a finite number of seconds > 0 \(got 0\)"):
        serve_on_ray(factory, start_timeout=0)
    with pytest.raises(ValueError, match="max_batch_size"):
        serve_on_ray(factory, num_cpus=0, resources=SERVER, max_batch_size=0)


def stalled_factory() -> TensorDictModule:
    time.sleep(600)  # a checkpoint that takes long to load
    return factory()


def test_a_server_actor_that_does_not_start_in_time_is_killed_and_the_error_says_so(cluster):
    from ray.util.state import list_actors

    def server_actors() -> dict[str, str]:
        return {a.actor_id: a.state for a in list_actors(filters=[("class_name", "=", "_ServerActor")], limit=1000)}

    before = server_actors()
    with pytest.raises(TimeoutError, match=r"did not start within start_timeout=3 s \(its policy_factory included\)"):
        serve_on_ray(stalled_factory, num_cpus=0, resources=SERVER, start_timeout=3)
    deadline = time.monotonic() + 60
    while set((new := {i: s for i, s in server_actors().items() if i not in before}).values()) != {"DEAD"}:
        assert time.monotonic() < deadline, new  # left starting, with no handle to it
        time.sleep(0.2)  # ray.kill ends it asynchronously
    assert len(new) == 1


def test_a_server_actor_that_does_not_answer_is_a_server_broken_error_naming_what_was_asked(cluster, monkeypatch):
    # It raised Ray's bare GetTimeoutError from statistics() and push_weights, outside the library's error tree.
    import torchrl_batchserve.ray as batchserve_ray

    monkeypatch.setattr(batchserve_ray, "CONNECT_TIMEOUT", 2.0)
    with served() as handle:
        pid = ray.get(handle.actor.__ray_call__.remote(lambda self: os.getpid()))
        os.kill(pid, signal.SIGSTOP)  # alive, but answers nothing: a hung server actor
        try:
            with pytest.raises(ServerBrokenError, match="did not answer statistics within 2 s"):
                handle.statistics()
            with pytest.raises(ServerBrokenError, match="did not answer version within 2 s"):
                handle.update_weights(TensorDict.from_module(factory(seed=1)).data)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert handle.statistics().requests == 0  # it answers again once it runs


def test_a_gateway_link_given_a_reply_to_no_batch_fails_every_batch_in_flight():
    import threading
    from multiprocessing.connection import Listener

    from torchrl_batchserve.gateway import Link, outcome, recv, send

    listener = Listener(("127.0.0.1", 0), authkey=b"k" * 16)
    checked = threading.Event()

    def server_actor() -> None:  # reads two batches, answers a third that was never sent
        with listener.accept() as conn:
            seqs = [recv(conn)[0], recv(conn)[0]]
            send(conn, (max(seqs) + 1, outcome(None, TensorDict())))
            checked.wait(30)  # the connection stays open: only the stray reply can end the link

    thread = threading.Thread(target=server_actor)
    thread.start()
    link = Link(listener.address, b"k" * 16)
    futures = [link.submit(TensorDict(obs=torch.ones(4)), None) for _ in range(2)]
    errors = []
    try:
        for future in futures:
            with pytest.raises(ServerBrokenError, match="the link to the server actor ended") as caught:
                future.result(10)
            errors.append(caught.value)
        for _ in range(2):
            with pytest.raises(ServerBrokenError, match="the link to the server actor ended") as caught:
                link.submit(TensorDict(obs=torch.ones(4)), None)
            errors.append(caught.value)
        # each its own: one instance raised for every later batch would gather every raise's frames
        assert len({id(error) for error in errors}) == 4
    finally:
        checked.set()
        thread.join(30)
        listener.close()


def test_a_gateway_link_fails_only_the_batch_whose_reply_it_cannot_read():
    # An error or an output of a class the gateway's node cannot import ended the link: every batch in flight
    # on that node failed with it.
    import threading
    from multiprocessing.connection import Listener

    from torchrl_batchserve.errors import BatchServeError
    from torchrl_batchserve.gateway import Link, outcome, recv, send

    listener = Listener(("127.0.0.1", 0), authkey=b"k" * 16)
    act, checked = TensorDict(act=torch.ones(3)), threading.Event()

    def server_actor() -> None:
        with listener.accept() as conn:
            first, second = recv(conn)[0], recv(conn)[0]
            send(conn, (first, b"not a pickle of this node's"))
            send(conn, (second, outcome(None, act)))
            send(conn, (recv(conn)[0], outcome(None, act)))
            checked.wait(30)  # the connection stays open while the test looks at the link

    thread = threading.Thread(target=server_actor)
    thread.start()
    link = Link(listener.address, b"k" * 16)
    try:
        unreadable, fine = (link.submit(TensorDict(obs=torch.ones(4)), None) for _ in range(2))
        with pytest.raises(BatchServeError, match="the server's reply cannot be read on this node"):
            unreadable.result(10)
        assert torch.equal(fine.result(10)["act"], act["act"])
        assert torch.equal(link.submit(TensorDict(obs=torch.ones(4)), None).result(10)["act"], act["act"])
        assert link.broken is None
    finally:
        checked.set()
        thread.join(30)
        listener.close()


def test_a_server_actor_fails_only_the_gateway_batch_it_cannot_read():
    # An input of a class the server's process cannot import ended the link: every batch in flight on that
    # node failed with it.
    import pickle
    import threading
    from multiprocessing.connection import Client, Listener

    from torchrl_batchserve import BadRequestError, BatchedPolicyServer
    from torchrl_batchserve.gateway import recv, send, serve_link
    from torchrl_batchserve.transport.wire import dumps

    listener = Listener(("127.0.0.1", 0), authkey=b"k" * 16)
    with BatchedPolicyServer(factory(), max_batch_size=8) as server:  # the server actor's end alone, without Ray
        thread = threading.Thread(target=lambda: serve_link(server, listener.accept(), ["act", "policy_version"]))
        thread.start()
        with Client(listener.address, authkey=b"k" * 16) as gateway:
            x = torch.stack([observation(0, i) for i in range(2)])
            send(gateway, (1, None, b"not a pickle of this process's"))
            send(gateway, (2, None, dumps(TensorDict(obs=x, batch_size=[2]))))
            replies = dict(recv(gateway) for _ in range(2))
            send(gateway, (3, None, dumps(TensorDict(obs=x, batch_size=[2]))))  # the link still serves
            replies.update([recv(gateway)])
        thread.join(30)
    listener.close()
    error, outputs = pickle.loads(replies[1])
    assert isinstance(error, BadRequestError) and "cannot be read in the server's process" in str(error)
    for seq in (2, 3):
        error, outputs = pickle.loads(replies[seq])
        assert error is None and outputs["policy_version"].tolist() == [0, 0]
        torch.testing.assert_close(outputs["act"], reference(None, x))


def test_a_link_connection_that_never_proves_the_key_holds_up_no_gateway(monkeypatch):
    # Listener.accept() checks a connection's key before it accepts the next: one that connected and said
    # nothing kept every later gateway from connecting, for as long as it stayed open.
    import threading
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client

    from torchrl_batchserve import BatchedPolicyServer, gateway
    from torchrl_batchserve.gateway import Link, LinkListener

    with BatchedPolicyServer(factory(), max_batch_size=8) as server:  # the server actor's end alone, without Ray
        links = LinkListener(server, ["act", "policy_version"], "127.0.0.1")
        monkeypatch.setattr(gateway, "HANDSHAKE_TIMEOUT", 600.0)
        silent = socket.create_connection(links.address)
        made: list[Link] = []
        try:
            connecting = threading.Thread(target=lambda: made.append(Link(links.address, links.authkey)), daemon=True)
            connecting.start()
            connecting.join(30)
            assert made, "a gateway could not connect while another connection stayed silent"
            x = torch.stack([observation(0, i) for i in range(2)])
            out = made[0].submit(TensorDict(obs=x, batch_size=[2]), None).result(30)
            torch.testing.assert_close(out["act"], reference(None, x))
            with pytest.raises(AuthenticationError):
                Client(links.address, authkey=b"not the key")
            monkeypatch.setattr(gateway, "HANDSHAKE_TIMEOUT", 0.5)
            with socket.create_connection(links.address) as brief:
                brief.settimeout(30)
                while brief.recv(4096):  # the challenge, then the end: hung up on once its time was up
                    pass
        finally:
            silent.close()
            links.close()
            for link in made:
                link._conn.close()
    assert not [t for t in threading.enumerate() if t.name == "batchserve-link-accept"]  # close() ended it


def test_a_link_listener_that_cannot_start_a_thread_for_a_link_hangs_up_on_it_and_accepts_the_next(monkeypatch):
    # Under a container's process limit, starting a thread raises: the accept thread died of it, and every
    # later gateway waited out its handshake and failed.
    from conftest import no_thread_named

    from torchrl_batchserve import BatchedPolicyServer, gateway
    from torchrl_batchserve.gateway import Link, LinkListener

    monkeypatch.setattr(gateway, "HANDSHAKE_TIMEOUT", 5.0)
    with BatchedPolicyServer(factory(), max_batch_size=8) as server:
        links = LinkListener(server, ["act", "policy_version"], "127.0.0.1")
        try:
            with no_thread_named("batchserve-link"), pytest.raises(ServerBrokenError, match="cannot reach"):
                Link(links.address, links.authkey)  # hung up on at once, not at the handshake's timeout
            link = Link(links.address, links.authkey)
            x = torch.stack([observation(0, i) for i in range(2)])
            out = link.submit(TensorDict(obs=x, batch_size=[2]), None).result(30)
            torch.testing.assert_close(out["act"], reference(None, x))
            link._conn.close()
        finally:
            links.close()


def test_a_link_sends_each_message_at_once_from_both_ends():
    # A message is two writes (its head, then its body). With Nagle's algorithm on, the second waited for the
    # peer's delayed ACK of the first (40 ms on Linux) at each end: 88 ms a gateway batch on loopback.
    import threading

    from torchrl_batchserve import BatchedPolicyServer, gateway
    from torchrl_batchserve.gateway import Link, LinkListener

    served = []

    def serve_link(server, conn, returned):
        served.append(conn)
        return real_serve_link(server, conn, returned)

    real_serve_link = gateway.serve_link
    with BatchedPolicyServer(factory(), max_batch_size=8) as server, pytest.MonkeyPatch.context() as patch:
        patch.setattr(gateway, "serve_link", serve_link)
        links = LinkListener(server, ["act", "policy_version"], "127.0.0.1")
        link = Link(links.address, links.authkey)
        try:
            x = torch.stack([observation(0, i) for i in range(2)])
            torch.testing.assert_close(
                link.submit(TensorDict(obs=x, batch_size=[2]), None).result(30)["act"], reference(None, x)
            )
            for conn in (link._conn, *served):
                with socket.socket(fileno=os.dup(conn.fileno())) as sock:
                    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16) == bytes(16)  # reads wait
            assert len(served) == 1
        finally:
            links.close()
            link._conn.close()
    assert not [t for t in threading.enumerate() if t.name == "batchserve-link-accept"]


def test_a_gateway_whose_server_actor_never_answers_or_hangs_up_fails_in_time_naming_the_address(monkeypatch):
    # Client(address, authkey) waited for the key's challenge for good: a gateway's start hung with it.
    import threading

    from torchrl_batchserve import gateway
    from torchrl_batchserve.gateway import Link

    monkeypatch.setattr(gateway, "HANDSHAKE_TIMEOUT", 0.5)
    for hangs_up in (False, True):
        with socket.socket() as listener:  # the connection is made; then not a word, or the end
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            if hangs_up:
                threading.Thread(target=lambda: listener.accept()[0].close(), daemon=True).start()
            address = listener.getsockname()
            with pytest.raises(
                ServerBrokenError, match=re.escape(f"cannot reach the server actor's link at {address}")
            ):
                Link(address, b"k" * 16)


def test_a_gateway_that_stops_reading_holds_up_no_other_caller_of_the_server_actor():
    # serve_link sent each reply from the serve loop that finished its batch: a gateway that read nothing (its
    # node cut off, its process stopped) stopped the server actor's serve loop once its socket was full.
    import pickle
    import threading
    from multiprocessing.connection import Client, Listener

    from conftest import BigOutputs, wait_for

    from torchrl_batchserve import BatchedPolicyServer
    from torchrl_batchserve.gateway import recv, send, serve_link
    from torchrl_batchserve.transport.wire import dumps

    listener = Listener(("127.0.0.1", 0), authkey=b"k" * 16)
    policy = TensorDictModule(BigOutputs(), in_keys=["obs"], out_keys=["act"])
    with BatchedPolicyServer(policy) as server:  # the server actor's end alone, without Ray
        thread = threading.Thread(target=lambda: serve_link(server, listener.accept(), ["act", "policy_version"]))
        thread.start()
        with Client(listener.address, authkey=b"k" * 16) as gateway:
            send(gateway, (1, None, dumps(TensorDict(obs=torch.ones(1, 4), batch_size=[1]))))  # not read yet
            wait_for(lambda: server.statistics().batches >= 1, "its batch to run (its 32 MB reply then due)", 60)
            local = server.submit(TensorDict(obs=torch.ones(4))).result(30)  # served meanwhile
            assert local["act"].shape == (1 << 23,)
            seq, answer = recv(gateway)  # and the gateway gets all of its reply once it reads
            error, outputs = pickle.loads(answer)
            assert seq == 1 and error is None and outputs["act"].shape == (1, 1 << 23)
            assert float(outputs["act"].sum()) == float(1 << 23)
        thread.join(30)
    listener.close()


def test_a_gateway_starting_on_one_node_holds_up_no_other_nodes_connect_and_one_closed_meanwhile_is_stopped(
    monkeypatch,
):
    # connect held one lock while a gateway started (a new worker process on its node: seconds), so every other
    # node's first call waited for it; and a gateway that started after close() was left running.
    import threading
    import types

    from torchrl_batchserve import ray as batchserve_ray

    release, entered, killed, started, closed = threading.Event(), threading.Event(), [], [], []

    def start_gateway(node):
        started.append(node)
        if node == "slow":
            entered.set()
            assert release.wait(30)
        close = types.SimpleNamespace(remote=lambda timeout: closed.append(node))  # as Ray would call it
        return types.SimpleNamespace(node=node, close=close), f"policy-{node}"

    monkeypatch.setattr(batchserve_ray.ray, "kill", lambda actor, no_restart: killed.append(actor.node))
    monkeypatch.setattr(batchserve_ray.ray, "wait", lambda refs, **kwargs: (refs, []))
    monkeypatch.setattr(batchserve_ray, "_healthy", lambda gateway: True)
    actor = batchserve_ray._ServerActor.__new__(batchserve_ray._ServerActor)  # its connect and close, without Ray
    actor.__dict__.update(
        _waiting_for_weights=False,
        _node="server",
        _policy="policy-server",
        _server=types.SimpleNamespace(closed=False, close=lambda timeout: True),
        _links=types.SimpleNamespace(close=lambda: None),
        _gateways={},
        _starting={},
        _closed=False,
        _lock=threading.Lock(),
        _start_gateway=start_gateway,
    )
    outcome = []
    slow = threading.Thread(target=lambda: outcome.append(_outcome(actor.connect, "slow")))
    slow.start()
    assert entered.wait(30)
    fast = threading.Thread(target=lambda: outcome.append(_outcome(actor.connect, "fast")))
    fast.start()
    fast.join(30)
    assert not fast.is_alive() and outcome == ["policy-fast"]  # while the slow node's gateway still starts
    assert actor.connect("fast") == "policy-fast" and actor.connect("server") == "policy-server"
    assert started == ["slow", "fast"]  # a node's gateway is started once
    actor.close(1.0)
    assert closed == killed == ["fast"]  # closed (its node's queue served, its actors told), then ended
    release.set()
    slow.join(30)
    assert isinstance(outcome[1], ServerClosedError)  # its gateway started after the close: stopped, not served
    assert killed == ["fast", "slow"]


def _outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as err:
        return err


class Unpicklable(torch.nn.Module):
    """``factory``'s linear layer, and per row an object that does not pickle when its first input is negative."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, obs: torch.Tensor):
        import threading

        from tensordict import NonTensorStack

        info = NonTensorStack(*[threading.Lock() if v < 0 else "fine" for v in obs[:, 0].tolist()])
        return self.linear(obs), info


def unpicklable_factory() -> TensorDictModule:
    return TensorDictModule(Unpicklable(), in_keys=["obs"], out_keys=["act", "info"])


def test_outputs_that_cannot_reach_a_gateway_fail_their_batch_with_a_policy_error(cluster):
    with served(unpicklable_factory) as handle:
        actor = spread(handle.remote_policy(), 1)[0]
        got = ray.get(actor.outcomes.remote([1.0, -1.0, 1.0]))
    assert [kind for kind, _ in got] == ["ok", "PolicyError", "ok"], got
    assert "the outputs do not pickle" in got[1][1]
