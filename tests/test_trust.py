"""Results owned by their callers, and a trainer that trains the module it serves (#20)."""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import make_mlp, obs, wait_for
from tensordict import TensorDict
from tensordict.nn import InteractionType, TensorDictModule, TensorDictModuleBase, TensorDictSequential
from tensordict.nn.probabilistic import interaction_type

from torchrl_batchserve import (
    BatchedPolicyServer,
    ForwardTimeoutError,
    PolicyError,
    ServerBrokenError,
    WeightSyncError,
)
from torchrl_batchserve.gate import GATE
from torchrl_batchserve.intake import CURRENT

RANDOM = InteractionType.RANDOM


class BiasHead(torch.nn.Module):
    """A value head whose output is a view of its parameter (an expansion of the bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(3))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.bias.expand(observation.shape[0], 3)


class TableHead(torch.nn.Module):
    """A value head that returns its parameter detached: an alias of it that is not a view (no ``_base``)."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(4, 3))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.bias.detach()  # a request of 4 rows


class BufferPolicy(TensorDictModuleBase):
    """Writes its output into one persistent buffer at every call, as a CUDA-graph replay does."""

    def __init__(self) -> None:
        super().__init__()
        self.in_keys, self.out_keys = ["observation"], ["logits"]
        self.net = make_mlp()
        self.out = torch.zeros(64, 3)  # not a registered buffer: only its references can tell

    def forward(self, td):
        rows = td.batch_size[0]
        self.out[:rows] = self.net(td["observation"])
        td.set("logits", self.out[:rows] if rows < 64 else self.out)
        return td


class SameObjectPolicy(BufferPolicy):
    """Hands out the very buffer object (a full batch every time)."""

    def forward(self, td):
        self.out.copy_(self.net(td["observation"]).expand(64, 3)[: self.out.shape[0]])
        td.set("logits", self.out[: td.batch_size[0]].clone() if td.batch_size[0] != 64 else self.out)
        return td


@pytest.mark.parametrize("head, rows", [(BiasHead, ()), (TableHead, (4,))], ids=["view", "alias"])
def test_a_result_that_views_a_parameter_keeps_its_values_after_update_weights(head, rows):
    policy = TensorDictModule(head(), in_keys=["observation"], out_keys=["value"])
    shape = policy.module.bias.shape
    with BatchedPolicyServer(policy) as server:
        remote = server.remote_policy()
        first = remote(obs(*rows))
        assert torch.equal(first["value"], torch.zeros(*rows, 3))
        server.update_weights({"module.bias": torch.ones(shape)})
        second = remote(obs(*rows))
    assert torch.equal(first["value"], torch.zeros(*rows, 3))  # unchanged by the update
    assert torch.equal(second["value"], torch.ones(*rows, 3)) and bool((second["policy_version"] == 1).all())


@pytest.mark.parametrize("kind", [BufferPolicy, SameObjectPolicy])
def test_a_result_from_a_reused_output_buffer_keeps_its_values_after_later_batches(kind):
    policy = kind()
    with BatchedPolicyServer(policy, max_batch_size=64) as server:
        remote = server.remote_policy()
        first = remote(obs(64) if kind is SameObjectPolicy else obs())
        kept = first["logits"].clone()
        for _ in range(3):
            remote(obs(64) if kind is SameObjectPolicy else obs())
    torch.testing.assert_close(first["logits"], kept)
    with torch.no_grad():
        torch.testing.assert_close(first["logits"], policy.net(first["observation"]))


def test_writing_into_one_callers_result_changes_no_other_callers():
    policy = TensorDictModule(make_mlp(), in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy, max_batch_size=16, timeout=0.5) as server:
        remote = server.remote_policy()
        barrier = threading.Barrier(8)

        def call(td):
            barrier.wait()
            return remote(td)

        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(call, [obs() for _ in range(8)]))
        assert server.statistics().mean_batch_size > 1  # they shared batches
    kept = [o["logits"].clone() for o in outs]
    outs[0]["logits"].add_(100.0)
    outs[0]["policy_version"].add_(7)
    for out, want in zip(outs[1:], kept[1:]):
        torch.testing.assert_close(out["logits"], want)
        assert int(out["policy_version"]) == 0


class GradPlanner(torch.nn.Module):
    """Plans its action by a few gradient steps, with grad turned back on inside its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.cost = torch.nn.Linear(8, 1)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            action = torch.zeros_like(observation, requires_grad=True)
            for _ in range(3):
                (grad,) = torch.autograd.grad((self.cost(observation + action) ** 2).sum(), action)
                action = (action - 0.1 * grad).detach().requires_grad_()
            return action * 2.0  # an output with a graph behind it


def test_an_output_computed_with_grad_turned_on_inside_the_policy_reaches_callers_as_plain_data():
    # It came back as a view made under no_grad of a tensor that required grad: the caller could not write
    # into its result ("a view was created in no_grad mode"), and each result kept the batch's graph alive.
    policy = TensorDictModule(GradPlanner(), in_keys=["observation"], out_keys=["action"])
    requests = [obs(), obs(4), obs()]
    with BatchedPolicyServer(policy) as server:
        remote = server.remote_policy()
        outs = [remote(td.clone()) for td in requests[:2]] + [remote.submit(requests[2].clone()).result()]
    for out, td in zip(outs, requests):
        assert not out["action"].requires_grad and out["action"].grad_fn is None
        torch.testing.assert_close(out["action"], policy(td.clone())["action"].detach())
        out["action"].add_(1.0)  # the caller's to change


def test_a_fresh_output_is_handed_out_without_a_copy():
    from torchrl_batchserve.serve import owned

    output = TensorDict(a=torch.randn(4, 2), batch_size=[4])
    fresh = output.get("a").data_ptr()  # no reference kept: only the output holds the tensor
    owned(output, "a", frozenset())
    assert output.get("a").data_ptr() == fresh
    param = torch.nn.Parameter(torch.randn(2))
    output.set("b", param.expand(4, 2))
    owned(output, "b", frozenset())
    assert output.get("b").data_ptr() != param.data_ptr()
    # an output elsewhere than where the results go is left to the move there, which copies it
    output.set("c", param.expand(4, 2))
    owned(output, "c", frozenset(), torch.device("meta"))
    assert output.get("c").data_ptr() == param.data_ptr()


def test_training_the_served_module_in_place_while_16_threads_call_the_server():
    torch.manual_seed(0)
    net = make_mlp()
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    optim = torch.optim.SGD(net.parameters(), lr=0.5)
    snapshots = {0: {k: v.clone() for k, v in net.state_dict().items()}}
    results: list[TensorDict] = []
    lock = threading.Lock()
    with BatchedPolicyServer(policy, max_batch_size=16, timeout=0.001) as server:
        remote = server.remote_policy()
        stop = threading.Event()

        def actor(seed):
            g = torch.Generator().manual_seed(seed)
            while not stop.is_set():
                td = remote(TensorDict(observation=torch.randn(8, generator=g)))
                with lock:
                    results.append(td)

        actors = [threading.Thread(target=actor, args=(i,)) for i in range(16)]
        for a in actors:
            a.start()
        for _ in range(20):  # the trainer: steps on the module it passed in, then pushes it
            loss = net(torch.randn(32, 8)).pow(2).mean()
            optim.zero_grad()
            loss.backward()  # never "modified by an inplace operation": the server only reads it
            optim.step()
            version = server.update_weights()  # no argument: the module the server was built with
            snapshots[version] = {k: v.clone() for k, v in net.state_dict().items()}
        stop.set()
        for a in actors:
            a.join(30)
    reference = make_mlp()
    versions = {int(td["policy_version"]) for td in results}
    assert len(versions) > 3 and len(results) > 100
    for td in results:
        reference.load_state_dict(snapshots[int(td["policy_version"])])
        with torch.no_grad():
            torch.testing.assert_close(td["logits"], reference(td["observation"]))


class PendulumPolicy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, th: torch.Tensor, thdot: torch.Tensor) -> torch.Tensor:
        return 2 * torch.tanh(self.lin(torch.stack([th.sin(), th.cos(), thdot], -1)))


def test_the_server_given_to_a_collector_in_this_process_is_refused_with_our_advice_and_refuses_to_be_pickled():
    # Given the server itself, a collector's update_policy_weights_() would copy the trainer's weights onto
    # themselves and serve the old ones on, silently: it is refused at construction, saying what to pass.
    import pickle

    from torchrl.collectors import Collector
    from torchrl.envs import PendulumEnv

    net = PendulumPolicy()
    policy = TensorDictModule(net, in_keys=["th", "thdot"], out_keys=["action"])
    kw = {"auto_register_policy_transforms": False}
    with BatchedPolicyServer(policy, max_batch_size=8, timeout=0.005) as server:
        with pytest.raises(TypeError, match=r"give worker processes .* server.remote_policy\(\)"):
            pickle.dumps(server)
        with pytest.raises(TypeError, match=r"Collector was given the BatchedPolicyServer .* server.remote_policy\(\)"):
            Collector(PendulumEnv, server, frames_per_batch=16, total_frames=32, **kw)
        td = TensorDict(th=torch.ones(()), thdot=torch.zeros(()))
        served = server(td.clone())  # called directly, it serves batched, as a RemotePolicy does
    assert int(served["policy_version"]) == 0 and server.statistics().requests == 1
    with torch.no_grad():
        torch.testing.assert_close(served["action"], net(td["th"], td["thdot"]))


def test_a_policy_breaking_its_contract_raises_policy_error_naming_the_key():
    class TooMany(TensorDictModuleBase):
        def __init__(self):
            super().__init__()
            self.in_keys, self.out_keys = ["observation"], ["logits"]

        def forward(self, td):
            return TensorDict(logits=torch.zeros(td["observation"].shape[0] + 1, 3))  # one row too many

    with BatchedPolicyServer(TooMany()) as server:
        with pytest.raises(
            PolicyError, match=r"out_key 'logits': expected a leading dim of the batch's 1 rows, got shape \(2, 3\)"
        ):
            server.remote_policy()(obs())


def test_update_policy_weights_with_no_argument_serves_the_trained_module_as_a_new_version():
    from torchrl.collectors import Collector
    from torchrl.envs import PendulumEnv

    net = PendulumPolicy()
    policy = TensorDictModule(net, in_keys=["th", "thdot"], out_keys=["action"])
    optim = torch.optim.SGD(net.parameters(), lr=0.1)
    with BatchedPolicyServer(policy, timeout=0.001) as server:
        collector = Collector(
            PendulumEnv,
            server.remote_policy(),
            frames_per_batch=8,
            total_frames=32,
            auto_register_policy_transforms=False,
            weight_sync_schemes={"policy": server.weight_sync_scheme()},
        )
        seen = []
        try:
            for batch in collector:
                seen.append(int(batch["policy_version"][0]))
                with torch.no_grad():  # each batch was computed by the weights of the version it carries
                    torch.testing.assert_close(batch["action"], net_at(seen[-1])(batch["th"], batch["thdot"]))
                loss = net(batch["th"], batch["thdot"]).pow(2).mean()
                optim.zero_grad()
                loss.backward()
                optim.step()
                _VERSIONS[server.policy_version + 1] = {k: v.clone() for k, v in net.state_dict().items()}
                collector.update_policy_weights_()
        finally:
            collector.shutdown()
    assert seen == [0, 1, 2, 3]


_VERSIONS: dict[int, dict] = {0: {k: v.clone() for k, v in PendulumPolicy().state_dict().items()}}


def net_at(version: int) -> PendulumPolicy:
    net = PendulumPolicy()
    net.load_state_dict(_VERSIONS[version])
    return net


class PendulumParams(torch.nn.Module):
    """A Gaussian's parameters for PendulumEnv: (loc, scale)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, th: torch.Tensor, thdot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        loc, scale = self.lin(torch.stack([th.sin(), th.cos(), thdot], -1)).unbind(-1)
        return loc.unsqueeze(-1), torch.nn.functional.softplus(scale).unsqueeze(-1) + 0.01


def test_a_push_of_the_trainers_actor_around_the_served_network_serves_the_networks_weights():
    # Actors serve the network and sample around their RemotePolicy; the trainer's ProbabilisticActor
    # wraps its own copy of the network, so its weights hold the served ones one level down.
    from torchrl.collectors import Collector
    from torchrl.envs import PendulumEnv
    from torchrl.modules import ProbabilisticActor, TanhNormal

    def actor_around(module):
        spec = PendulumEnv().action_spec
        return ProbabilisticActor(module, in_keys=["loc", "scale"], spec=spec, distribution_class=TanhNormal)

    served = TensorDictModule(PendulumParams(), in_keys=["th", "thdot"], out_keys=["loc", "scale"])
    trainer = actor_around(TensorDictModule(PendulumParams(), in_keys=["th", "thdot"], out_keys=["loc", "scale"]))
    net = trainer.module[0].module
    with BatchedPolicyServer(served, timeout=0.001) as server:
        scheme = server.weight_sync_scheme()
        collector = Collector(
            PendulumEnv, actor_around(server.remote_policy()), frames_per_batch=8, total_frames=24,
            auto_register_policy_transforms=False, weight_sync_schemes={"policy": scheme},
        )  # fmt: skip
        try:
            for i, batch in enumerate(collector):
                assert (batch["policy_version"] == i).all()
                with torch.no_grad():
                    torch.testing.assert_close(batch["loc"], net(batch["th"], batch["thdot"])[0])
                    net.lin.weight.add_(0.5)
                collector.update_policy_weights_(trainer)
        finally:
            collector.shutdown()
        critic = torch.nn.Linear(3, 1)  # the trainer's other weights serve nothing and are left out
        assert server.update_weights(torch.nn.ModuleDict({"actor": trainer, "critic": critic})) == 4
        with pytest.raises(WeightSyncError, match="do not match the served policy"):  # held twice: which is meant?
            server.update_weights(torch.nn.ModuleDict({"actor": trainer, "target": copy.deepcopy(trainer)}))
        assert server.policy_version == 4


def test_a_collector_that_compiles_its_policy_compiles_around_the_remote_call_never_into_the_server():
    # compile_policy= compiles the collector's policy: tracing into the RemotePolicy traced the server's
    # own code (a lone caller runs its batch in its thread), the served forward and owned()'s refcounts too.
    from torchrl.collectors import Collector
    from torchrl.envs import PendulumEnv

    traced = []

    class Recording(PendulumPolicy):
        def forward(self, th: torch.Tensor, thdot: torch.Tensor) -> torch.Tensor:
            traced.append(torch.compiler.is_compiling())
            return super().forward(th, thdot)

    net = Recording()
    with BatchedPolicyServer(TensorDictModule(net, in_keys=["th", "thdot"], out_keys=["action"])) as server:
        squash = TensorDictModule(torch.tanh, in_keys=["action"], out_keys=["squashed"])  # compiled, locally
        collector = Collector(
            PendulumEnv, TensorDictSequential(server.remote_policy(), squash), frames_per_batch=8, total_frames=16,
            compile_policy={"backend": "eager"}, auto_register_policy_transforms=False,
        )  # fmt: skip
        try:
            batches = list(collector)
        finally:
            collector.shutdown()
    assert len(traced) >= 16 and not any(traced)  # every step (and the probe of its outputs) ran as it is
    for batch in batches:
        with torch.no_grad():
            torch.testing.assert_close(batch["action"], net(batch["th"], batch["thdot"]))
            torch.testing.assert_close(batch["squashed"], batch["action"].tanh())


def test_a_compiled_served_policy_runs_its_compiled_graph_when_a_lone_caller_runs_the_batch_itself():
    # RemotePolicy.forward is torch.compiler.disable'd, and a lone caller runs its batch inside it: the served
    # policy's own compilation must still run there, as in the serve thread.
    runs = []

    def backend(graph, inputs):
        def run(*args):
            runs.append(threading.current_thread())
            return graph.forward(*args)

        return run

    net = torch.compile(make_mlp(), backend=backend)
    with BatchedPolicyServer(TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])) as server:
        remote = server.remote_policy()
        results = [remote(obs()) for _ in range(3)]
        assert server.statistics().batches == 3
    assert len(runs) == 3  # each forward ran the compiled graph, the later ones in the caller's thread
    assert runs[1:] == [threading.main_thread()] * 2
    for td in results:
        with torch.no_grad():
            torch.testing.assert_close(td["logits"], net(td["observation"]))


def test_an_exploration_modules_annealed_buffer_reaches_the_actors_with_the_next_push():
    # A DQN recipe anneals EGreedyModule's eps (a buffer) with step(); the served
    # copy takes it, like the parameters, with the next versioned push.
    from tensordict.nn import InteractionType, TensorDictSequential, set_interaction_type
    from torchrl.data import OneHot
    from torchrl.modules import MLP, EGreedyModule, QValueActor

    torch.manual_seed(0)
    spec = OneHot(4)
    actor = QValueActor(MLP(in_features=8, out_features=4, num_cells=[16]), in_keys=["observation"], spec=spec)
    explore = EGreedyModule(spec, eps_init=1.0, eps_end=0.0, annealing_num_steps=10)
    with BatchedPolicyServer(TensorDictSequential(actor, explore), max_batch_size=64) as server:
        remote = server.remote_policy()

        def greedy() -> torch.Tensor:  # whether each of 64 served actions is the greedy one
            with set_interaction_type(InteractionType.RANDOM), ThreadPoolExecutor(8) as pool:
                tds = list(pool.map(remote, [obs() for _ in range(64)]))
            with torch.no_grad():
                best = [actor(td.select("observation").clone())["action"] for td in tds]
            return torch.tensor([bool((td["action"] == b).all()) for td, b in zip(tds, best)])

        assert not greedy().all()  # eps = 1: random actions (all 64 greedy by chance: 4**-64)
        explore.step(10)  # eps -> 0 on the trainer's module
        assert float(explore.eps) == 0.0 and not greedy().all()  # not served before a push
        assert server.update_weights() == 1
        assert greedy().all()


def test_a_module_keeping_unlisted_state_is_refused_in_the_served_policy_and_keeps_it_around_a_remote_policy():
    # OU noise reads is_init, _ou_prev_noise and _ou_steps, none of them in its in_keys: served, no request carried
    # them, so each step started the noise process anew (_ou_steps stayed 1), and deterministic steps failed.
    from tensordict.nn import TensorDictSequential
    from torchrl.envs import InitTracker, PendulumEnv, TransformedEnv
    from torchrl.modules import Actor, MultiStepActorWrapper, OrnsteinUhlenbeckProcessModule

    env = TransformedEnv(PendulumEnv(), InitTracker())
    net = torch.nn.Linear(2, 1)
    actor = Actor(lambda th, thdot: net(torch.stack([th, thdot], -1)), in_keys=["th", "thdot"], spec=env.action_spec)
    with pytest.raises(ValueError, match=r"'module.1' \(OrnsteinUhlenbeckProcessModule\).*_ou_steps.*remote_policy"):
        BatchedPolicyServer(TensorDictSequential(actor, OrnsteinUhlenbeckProcessModule(spec=env.action_spec)))
    with pytest.raises(ValueError, match=r"policy's MultiStepActorWrapper reads.*counter"):
        BatchedPolicyServer(MultiStepActorWrapper(actor, n_steps=4))  # (action chunks: its counter, likewise)
    with BatchedPolicyServer(actor) as server:
        explore = TensorDictSequential(server.remote_policy(), OrnsteinUhlenbeckProcessModule(spec=env.action_spec))
        td = env.rollout(5, explore)
    assert td["_ou_steps"].flatten().tolist() == [1, 2, 3, 4, 5]


def test_two_cpu_replicas_both_serve_exact_results_with_versions_that_never_go_back():
    net = make_mlp()
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy, device=["cpu", "cpu"], max_batch_size=4, timeout=0.001) as server:
        remote = server.remote_policy()

        def actor(i):
            seen = []
            for _ in range(30):
                td = remote(obs())
                seen.append(int(td["policy_version"]))
                with torch.no_grad():
                    torch.testing.assert_close(td["logits"], net(td["observation"]))
            return seen

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(actor, i) for i in range(8)]
            for _ in range(5):
                server.update_weights()  # the same values, a new version each time
            seen = [f.result(60) for f in futures]
        replicas = server.statistics().replicas
    assert len(replicas) == 2 and all(r.batches > 0 for r in replicas)
    assert all(s == sorted(s) for s in seen)


class ExplodesOnMarker(TensorDictModuleBase):
    """Raises for a batch holding an observation whose first entry is 1000."""

    def __init__(self, net):
        super().__init__()
        self.in_keys, self.out_keys, self.net = ["observation"], ["logits"], net

    def forward(self, td):
        if (td["observation"][..., 0] == 1000).any():
            raise ValueError("marked batch")
        td.set("logits", self.net(td["observation"]))
        return td


def test_a_replica_whose_forward_raises_fails_only_its_batch():
    net = make_mlp()
    with BatchedPolicyServer(ExplodesOnMarker(net), device=["cpu", "cpu"], max_batch_size=1) as server:
        remote = server.remote_policy()
        bomb = obs()
        bomb["observation"][0] = 1000
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(remote, obs()) for _ in range(40)]
            with pytest.raises(ValueError, match="marked batch"):
                remote(bomb)
            outs = [f.result(30) for f in futures]
        stats = server.statistics()
    assert stats.failed_batches == 1 and all(r.batches > 0 for r in stats.replicas)
    with torch.no_grad():
        for td in outs:
            torch.testing.assert_close(td["logits"], net(td["observation"]))


class ModeProbe(TensorDictModuleBase):
    """Records the interaction type at the start and the end of each forward; a RANDOM one waits for ``go``."""

    def __init__(self) -> None:
        super().__init__()
        self.in_keys, self.out_keys = ["observation"], ["logits"]
        self.started: list = []
        self.seen: list[tuple] = []
        self.random_entered, self.go = threading.Event(), threading.Event()

    def __deepcopy__(self, memo):
        return self  # both replicas share the record and the events (the probe has no weights)

    def forward(self, td):
        start = interaction_type()
        self.started.append(start)
        if start is InteractionType.RANDOM:
            self.random_entered.set()
            assert self.go.wait(30)
        self.seen.append((start, interaction_type()))
        td.set("logits", td["observation"][..., :3] * 1)
        return td


@pytest.mark.parametrize("where", ["two replicas", "two servers"])
def test_forwards_of_two_interaction_types_never_run_at_once(where):
    # tensordict's interaction type is one value per process: a DETERMINISTIC forward, on the free replica or of
    # another server, must wait for the RANDOM one running, or that one would sample under DETERMINISTIC halfway.
    probe = ModeProbe()
    kwargs = {"max_batch_size": 1, "policy_version_key": None}
    with contextlib.ExitStack() as stack:
        if where == "two replicas":
            first = second = stack.enter_context(BatchedPolicyServer(probe, device=["cpu", "cpu"], **kwargs))
        else:
            first, second = (stack.enter_context(BatchedPolicyServer(probe, **kwargs)) for _ in range(2))
        held = first.submit(obs(), interaction=InteractionType.RANDOM)
        assert probe.random_entered.wait(10)
        other = second.submit(obs(), interaction=InteractionType.DETERMINISTIC)
        wait_for(lambda: len(probe.started) == 2 or GATE._waiting == 1, "the other batch to start or wait")
        probe.go.set()
        held.result(10), other.result(10)
        assert interaction_type() is None  # put back as found
    assert probe.seen == [(InteractionType.RANDOM,) * 2, (InteractionType.DETERMINISTIC,) * 2]


def test_once_a_forward_of_another_type_waits_new_forwards_of_the_running_type_wait_too():
    # Joining the run, a stream of RANDOM forwards (other servers, other replicas) could starve the other type.
    probe = ModeProbe()
    kwargs = {"max_batch_size": 1, "policy_version_key": None}
    with contextlib.ExitStack() as stack:
        first, second, third = (stack.enter_context(BatchedPolicyServer(probe, **kwargs)) for _ in range(3))
        held = first.submit(obs(), interaction=RANDOM)
        assert probe.random_entered.wait(10)
        other = second.submit(obs(), interaction=InteractionType.DETERMINISTIC)
        wait_for(lambda: GATE._waiting == 1, "the DETERMINISTIC forward to wait for the RANDOM run")
        late = third.submit(obs(), interaction=RANDOM)
        wait_for(lambda: GATE._waiting == 2 or len(probe.started) == 2, "the late RANDOM forward to wait or start")
        assert probe.started == [RANDOM]  # it waits, though the run is of its type
        probe.go.set()
        held.result(10), other.result(10), late.result(10)
    deterministic = (InteractionType.DETERMINISTIC,) * 2
    assert sorted(probe.seen, key=str) == sorted([(RANDOM, RANDOM)] * 2 + [deterministic], key=str)


def test_a_server_whose_forward_times_out_holds_up_no_other_servers_forwards():
    probe = ModeProbe()
    broken = BatchedPolicyServer(probe, max_batch_size=1, forward_timeout=0.2, policy_version_key=None)
    stuck = broken.submit(obs(), interaction=InteractionType.RANDOM)
    assert probe.random_entered.wait(10)
    with BatchedPolicyServer(probe, max_batch_size=1, policy_version_key=None) as other:
        waiting = other.submit(obs(), interaction=InteractionType.DETERMINISTIC)  # waits for the stuck forward
        with pytest.raises(ForwardTimeoutError):
            stuck.result(10)
        assert waiting.result(10)["logits"].shape == (3,)  # served once that server broke, under its own type
    assert probe.seen == [(InteractionType.DETERMINISTIC,) * 2]
    assert broken.close(timeout=0.5) is False
    probe.go.set()


class CallsAnother(TensorDictModuleBase):
    """A policy whose forward is served by another server of its process; a RANDOM one waits for ``go`` first."""

    def __init__(self, inner, blocking: bool) -> None:
        super().__init__()
        self.in_keys, self.out_keys = ["observation"], ["logits"]
        self.inner, self.entered, self.go = inner, threading.Event(), threading.Event()
        self.blocking = blocking

    def __deepcopy__(self, memo):
        return self

    def forward(self, td):
        if interaction_type() is InteractionType.RANDOM:
            self.entered.set()
            assert self.go.wait(30)
        request = TensorDict(observation=td["observation"], batch_size=td.batch_size)
        if self.blocking:  # a serve loop's thread may call another server
            td.set("logits", self.inner.remote_policy()(request)["logits"])
        else:
            td.set("logits", self.inner.submit(request, interaction=CURRENT).result(10)["logits"])
        return td


@pytest.mark.parametrize("blocking", [False, True], ids=["submit", "call"])
def test_a_forward_that_calls_another_server_of_its_process_is_served_under_its_type_while_another_waits(blocking):
    # The inner request is part of the running forward: made under the forward's type, its forward joins the
    # run. Made under the type the forward replaced, or waiting behind the DETERMINISTIC forward that waits for
    # the run to end, it would wait for itself.
    probe = ModeProbe()
    with BatchedPolicyServer(probe, max_batch_size=8, policy_version_key=None) as inner:
        outer = CallsAnother(inner, blocking)
        with BatchedPolicyServer(outer, policy_version_key=None) as server, BatchedPolicyServer(probe) as third:
            held = server.submit(TensorDict(observation=torch.ones(2, 8), batch_size=[2]), interaction=RANDOM)
            assert outer.entered.wait(10)
            other = third.submit(obs(), interaction=InteractionType.DETERMINISTIC)
            wait_for(lambda: GATE._waiting == 1, "the DETERMINISTIC forward to wait for the RANDOM run")
            probe.go.set()  # the inner RANDOM forward need not wait
            outer.go.set()
            assert held.result(10)["logits"].shape == (2, 3)
            other.result(10)
    assert probe.seen == [(InteractionType.RANDOM,) * 2, (InteractionType.DETERMINISTIC,) * 2]


@pytest.mark.parametrize("how", ["call", "submit", "acall"])
def test_a_worker_client_in_a_process_running_a_forward_sends_its_callers_type_not_the_forwards(how):
    # While a forward of this process's server runs, the process-wide type is the forward's; a worker client
    # (of a server elsewhere) read it, so a caller that set no type had its request run under the forward's
    # RANDOM.
    import asyncio
    import pickle

    from process_workers import ModeEcho

    probe = ModeProbe()
    echo = TensorDictModule(ModeEcho(), in_keys=["observation"], out_keys=["mode"])
    with BatchedPolicyServer(probe, policy_version_key=None) as local, BatchedPolicyServer(echo) as elsewhere:
        client = pickle.loads(pickle.dumps(elsewhere.remote_policy()))  # as a worker process holds it
        client(obs())  # connected
        held = local.submit(obs(), interaction=InteractionType.RANDOM)
        assert probe.random_entered.wait(10)
        with ThreadPoolExecutor(1) as pool:
            if how == "call":
                pending = pool.submit(client, obs())
            elif how == "submit":
                pending = client.submit(obs())
            else:
                pending = pool.submit(asyncio.run, client.acall(obs()))
            # (both servers are in this process here: a forward of no type waits for the RANDOM run to end)
            wait_for(lambda: GATE._waiting == 1 or pending.done(), "the request's forward to wait, or to end")
            probe.go.set()
            out = pending.result(10)
        held.result(10)
    assert int(out["mode"]) == 0  # no type, as the caller was under


def test_a_forward_that_ends_after_its_server_broke_answers_with_the_break_not_its_outputs():
    # A server that breaks (a forward timed out) releases its hold on the gate: a forward of another replica
    # still running may then run on under another server's type, so its outputs are not handed out.
    class BreaksMidway(TensorDictModuleBase):
        in_keys, out_keys = ["observation"], ["logits"]

        def __deepcopy__(self, memo):
            return self

        def forward(self, td):
            server._serving.broken = ServerBrokenError("broke while this forward ran")  # as _break sets it
            td.set("logits", td["observation"][..., :3] * 1)
            return td

    with BatchedPolicyServer(BreaksMidway()) as server:
        with pytest.raises(ServerBrokenError, match="broke while this forward ran"):
            server.remote_policy()(obs())


def _serve_in_a_forked_child(results) -> None:
    try:
        results.put(interaction_type())
        with BatchedPolicyServer(TensorDictModule(make_mlp(), in_keys=["observation"], out_keys=["logits"])) as s:
            results.put(s.submit(obs(), interaction=InteractionType.DETERMINISTIC).result(10)["logits"].shape)
    except Exception as err:  # reported to the parent, which would otherwise only see a timeout
        results.put(err)


def test_a_process_forked_while_a_forward_runs_has_its_own_type_and_a_free_gate():
    # The child inherited the forward's type and a gate held by a forward that does not run there: a server of
    # its own waited for it forever.
    import multiprocessing

    probe = ModeProbe()
    fork = multiprocessing.get_context("fork")
    results = fork.Queue()
    with BatchedPolicyServer(probe, max_batch_size=1, policy_version_key=None) as server:
        held = server.submit(obs(), interaction=InteractionType.RANDOM)
        assert probe.random_entered.wait(10)
        child = fork.Process(target=_serve_in_a_forked_child, args=(results,))
        child.start()
        try:
            assert results.get(timeout=30) is None  # the type in effect before the forward, not RANDOM
            assert results.get(timeout=30) == (3,)
        finally:
            probe.go.set()
            held.result(10)
            child.join(10)
            if child.is_alive():
                child.kill()


def test_a_caller_of_the_servers_process_keeps_its_own_type_while_a_forward_has_set_another():
    # A worker's RANDOM batch runs in the server's process, under RANDOM for the whole process: a thread there
    # that set no type still submits under none, not under the forward's.
    probe = ModeProbe()
    with BatchedPolicyServer(probe, max_batch_size=1, policy_version_key=None) as server:
        held = server.submit(obs(), interaction=InteractionType.RANDOM)  # as a worker's, or a relay's, comes
        assert probe.random_entered.wait(10)
        assert interaction_type() is InteractionType.RANDOM  # the forward's, process-wide
        mine = server.remote_policy().submit(obs())
        probe.go.set()
        held.result(10), mine.result(10)
        assert interaction_type() is None
    assert probe.seen == [(InteractionType.RANDOM,) * 2, (None, None)]


class ModeTag(TensorDictModuleBase):
    """Tags each row with the interaction type seen at the start and at the end of its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.in_keys, self.out_keys = ["observation"], ["tag"]
        self.net = make_mlp()

    def forward(self, td):
        start = interaction_type()
        for _ in range(3):  # torch ops: the GIL goes to other threads in between
            self.net(td["observation"])
        code = [None, *InteractionType].index
        td.set("tag", torch.full(td.batch_size, code(start) * 10 + code(interaction_type())))
        return td


def test_requests_of_many_interaction_types_on_two_replicas_each_run_under_their_own():
    modes = [None, *InteractionType]
    with BatchedPolicyServer(ModeTag(), device=["cpu", "cpu"], max_batch_size=8, timeout=0.0005) as server:

        def actor(i: int) -> list[bool]:
            out = []
            for j in range(40):
                mode = modes[(i + j) % len(modes)]
                tag = int(server.submit(obs(), interaction=mode).result(30)["tag"])
                out.append(tag == modes.index(mode) * 11)
            return out

        with ThreadPoolExecutor(12) as pool:
            results = [ok for oks in pool.map(actor, range(12)) for ok in oks]
        replicas = server.statistics().replicas
    assert all(results) and len(results) == 12 * 40
    assert all(r.batches > 0 for r in replicas)
    assert interaction_type() is None


class Slow(TensorDictModuleBase):
    """Every forward takes 0.4 s; a RANDOM one tells when it began."""

    def __init__(self) -> None:
        super().__init__()
        self.in_keys, self.out_keys = ["observation"], ["logits"]
        self.random_entered = threading.Event()

    def __deepcopy__(self, memo):
        return self

    def forward(self, td):
        if interaction_type() is InteractionType.RANDOM:
            self.random_entered.set()
        time.sleep(0.4)
        td.set("logits", td["observation"][..., :3] * 1)
        return td


def test_the_wait_for_another_interaction_type_is_no_part_of_a_forwards_time():
    # Each forward takes 0.4 s, within forward_timeout=0.7; the DETERMINISTIC batch waits up to 0.4 s at the
    # gate first. Counted from before that wait, it would break the server though no forward ran long, and the
    # statistics would report a 0.8 s forward.
    slow = Slow()
    with BatchedPolicyServer(slow, device=["cpu", "cpu"], max_batch_size=1, forward_timeout=0.7) as server:
        first = server.submit(obs(), interaction=InteractionType.RANDOM)
        assert slow.random_entered.wait(10)
        second = server.submit(obs(), interaction=InteractionType.DETERMINISTIC)
        assert first.result(10)["logits"].shape == second.result(10)["logits"].shape == (3,)
        assert server.statistics().forward_p99 < 0.7


def test_a_batch_waiting_for_its_interaction_type_fails_when_a_forward_times_out():
    probe = ModeProbe()
    server = BatchedPolicyServer(probe, device=["cpu", "cpu"], max_batch_size=1, forward_timeout=0.2)
    stuck = server.submit(obs(), interaction=InteractionType.RANDOM)
    assert probe.random_entered.wait(10)
    waiting = server.submit(obs(), interaction=InteractionType.DETERMINISTIC)
    with pytest.raises(ForwardTimeoutError):
        stuck.result(10)
    with pytest.raises(ForwardTimeoutError):  # not left waiting behind a forward that never ends
        waiting.result(10)
    assert server.close(timeout=0.5) is False
    probe.go.set()


def test_the_server_given_to_a_multiprocess_collector_is_refused_with_our_advice_and_serves_on():
    from torchrl.collectors import MultiSyncCollector
    from torchrl.envs import PendulumEnv

    policy = TensorDictModule(PendulumPolicy(), in_keys=["th", "thdot"], out_keys=["action"])
    kw = {"frames_per_batch": 16, "total_frames": 32, "auto_register_policy_transforms": False}
    with BatchedPolicyServer(policy, max_batch_size=8) as server:
        with pytest.raises(RuntimeError) as info:
            MultiSyncCollector([PendulumEnv] * 2, server, **kw)
        cause = info.value.__cause__  # TorchRL chains the TypeError it got while starting a worker
        assert isinstance(cause, TypeError) and "server.remote_policy()" in str(cause)
        # (TorchRL 0.14.1 leaves the parameters of the policy it failed to send on the meta device;
        # the server serves its own copy, so serving goes on.)
        td = server.remote_policy()(TensorDict(th=torch.zeros(()), thdot=torch.zeros(())))
        assert td["action"].shape == (1,)


class ArangeShift(torch.nn.Module):
    """Adds ``arange``, made without a device: it lands on the default device of the thread that runs it."""

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return observation + torch.arange(observation.shape[-1])


def test_a_lone_caller_with_a_default_device_of_its_own_leaves_its_batch_to_a_serve_thread():
    # torch.set_default_device is per thread: a lone caller that ran its own batch under it had the policy's new
    # tensors made on its device ("Tensor on device meta is not on the expected device cpu"), where a serve
    # thread computes the same request.
    policy = TensorDictModule(ArangeShift(), in_keys=["observation"], out_keys=["shifted"])
    xs = [torch.randn(4) for _ in range(3)]

    def actor(remote) -> list[torch.Tensor]:
        remote(TensorDict(observation=torch.randn(4)))  # served alone: from now on this thread runs its own batches
        torch.set_default_device("meta")
        try:
            return [remote(TensorDict(observation=x.clone()))["shifted"] for x in xs]
        finally:
            torch.set_default_device(None)

    with BatchedPolicyServer(policy) as server, ThreadPoolExecutor(1) as pool:
        results = pool.submit(actor, server.remote_policy()).result()
    for x, result in zip(xs, results):
        torch.testing.assert_close(result, x + torch.arange(4, device="cpu"))


def test_a_lone_caller_running_its_own_batch_gets_what_a_serve_thread_computes_whatever_its_thread_has_on():
    # A lone blocking caller runs its batch in its own thread: under its autocast the result came back in
    # bfloat16, under its inference mode as an inference tensor (no in-place op outside it), and with an
    # input that requires grad under autograd (torch.inference_mode(False) turns grad mode back on), unlike
    # the same request served by a serve thread; and a cache would have handed that result to other callers.
    net = make_mlp()
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    x = torch.randn(8)
    with BatchedPolicyServer(policy) as server:
        remote = server.remote_policy()
        remote(obs())  # served alone: from now on this thread runs its own batches
        with torch.autocast("cpu", dtype=torch.bfloat16):
            under_autocast = remote(TensorDict(observation=x.clone()))["logits"]
        with torch.inference_mode():
            under_inference = remote(TensorDict(observation=x.clone()))["logits"]
        with_grad = remote(TensorDict(observation=x.clone().requires_grad_()))["logits"]
        with ThreadPoolExecutor(1) as pool:
            served = pool.submit(remote, TensorDict(observation=x.clone())).result()["logits"]
    assert under_autocast.dtype == under_inference.dtype == served.dtype == torch.float32
    assert not under_inference.is_inference()
    assert not with_grad.requires_grad and not served.requires_grad
    under_inference.add_(0)  # an in-place op outside inference mode, as a caller may do
    torch.testing.assert_close(under_autocast, served)
    torch.testing.assert_close(under_inference, served)
    torch.testing.assert_close(with_grad, served)
