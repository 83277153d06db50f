"""Our config nodes inside TorchRL's own: one server behind a collector's policy and weight-sync scheme."""

from __future__ import annotations

import gc
import threading
import weakref
from dataclasses import dataclass

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from hydra.utils import instantiate
from omegaconf.errors import ValidationError
from tensordict import TensorDict
from tensordict.nn import InteractionType, NormalParamExtractor, TensorDictModule, set_interaction_type
from torchrl.modules import ProbabilisticActor, ValueOperator
from torchrl.trainers.algorithms.configs.common import ConfigBase

import torchrl_batchserve.config  # noqa: F401  (registers our nodes)


class PendulumNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, th: torch.Tensor, thdot: torch.Tensor) -> torch.Tensor:
        return 2 * torch.tanh(self.lin(torch.stack([th.sin(), th.cos(), thdot], -1)))


def make_policy() -> TensorDictModule:
    torch.manual_seed(0)
    return TensorDictModule(PendulumNet(), in_keys=["th", "thdot"], out_keys=["action"])


@dataclass
class PendulumEnvConfig(ConfigBase):
    """TorchRL's PendulumEnv as an env node (TorchRL registers envs of other libraries only)."""

    _target_: str = "torchrl.envs.PendulumEnv"
    _partial_: bool = True

    def __post_init__(self) -> None:
        pass


ConfigStore.instance().store(group="env", name="pendulum_for_tests", node=PendulumEnvConfig)

# A collector whose policy and weight-sync scheme come from the one server node.
COLLECTOR = """collector:
  create_env_fn: ${env}
  frames_per_batch: 16
  total_frames: 48
  auto_register_policy_transforms: false
  policy:
    _target_: torchrl_batchserve.config.remote_policy
    server: ${server}
  weight_sync_schemes:
    policy:
      _target_: torchrl_batchserve.config.weight_sync_scheme
      server: ${server}
"""

RECIPE = f"""
defaults:
  - env: pendulum_for_tests
  - collector: sync
  - server@server: batchserve
  - _self_
server:
  name: collector_recipe
  max_batch_size: 8
  timeout: 0.005
  policy:
    _target_: {__name__}.make_policy
{COLLECTOR}"""


@pytest.fixture
def recipe_dir(tmp_path):
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    return str(tmp_path)


def test_a_torchrl_collector_config_collects_through_our_server_and_takes_pushed_weights(recipe_dir):
    with initialize_config_dir(config_dir=recipe_dir, version_base=None):
        cfg = compose(config_name="recipe")
    collector = instantiate(cfg.collector)
    server = instantiate(cfg.server)  # the one server both nodes refer to
    try:
        assert collector.policy is not server and server.max_batch_size == 8
        batches = iter(collector)
        first = next(batches)
        assert server.statistics().requests > 0  # the collector's frames went through the server
        assert first["policy_version"].eq(0).all()
        with torch.no_grad():
            for param in server.module.parameters():  # the trainer trains the module it serves
                param.add_(1.0)
        collector.update_policy_weights_()
        assert server.policy_version == 1
        second = next(batches)
        assert second["policy_version"].eq(1).all()
        expected = server.module(second[0].select("th", "thdot").clone())["action"]
        assert torch.equal(second[0]["action"], expected)
    finally:
        collector.shutdown()
        server.close()


class PendulumFeatures(torch.nn.Module):
    def __init__(self, out: int, head: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, out)
        self.head = head or torch.nn.Identity()

    def forward(self, th: torch.Tensor, thdot: torch.Tensor) -> torch.Tensor:
        return self.head(self.lin(torch.stack([th.sin(), th.cos(), thdot], -1)))


def make_actor() -> ProbabilisticActor:
    """A Gaussian policy over the angle and speed, as PPO trains it."""
    torch.manual_seed(0)
    module = TensorDictModule(
        PendulumFeatures(2, NormalParamExtractor()), in_keys=["th", "thdot"], out_keys=["loc", "scale"]
    )
    return ProbabilisticActor(
        module, in_keys=["loc", "scale"], distribution_class=torch.distributions.Normal, return_log_prob=True
    )


def make_critic() -> ValueOperator:
    torch.manual_seed(1)
    return ValueOperator(PendulumFeatures(1), in_keys=["th", "thdot"])


# TorchRL's own trainer: its PPO loss trains the served module (model/batchserve_served) and its
# UpdateWeights hook pushes it through our scheme (weight_update_map) after each batch.
TRAINER_RECIPE = f"""
defaults:
  - env: pendulum_for_tests
  - collector: sync
  - server@server: batchserve
  - model@actor: batchserve_served
  - loss: ppo
  - optimizer: adam
  - trainer: ppo
  - _self_
server:
  name: trainer_recipe
  max_batch_size: 8
  timeout: 0.005
  policy: {{_target_: {__name__}.make_actor}}
actor:
  server: ${{server}}
{COLLECTOR}
loss:
  actor_network: ${{actor}}
  critic_network: {{_target_: {__name__}.make_critic}}
trainer:
  collector: ${{collector}}
  loss_module: ${{loss}}
  optimizer: ${{optimizer}}
  total_frames: 48
  optim_steps_per_batch: 2
  replay_buffer: null
  logger: null
  save_trainer_file: null
  progress_bar: false
  weight_update_map: {{policy: loss_module.actor_network}}
"""


@pytest.mark.filterwarnings("ignore:.*experimental:UserWarning")  # TorchRL's own note on its trainers
def test_torchrls_ppo_trainer_config_trains_the_served_module_and_serves_each_update(tmp_path):
    (tmp_path / "trainer.yaml").write_text(TRAINER_RECIPE)
    with initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        cfg = compose(config_name="trainer")
    trainer = instantiate(cfg.trainer)
    server = instantiate(cfg.server)
    try:
        assert trainer.loss_module.actor_network is server.module  # one module: trained here, served there
        before = TensorDict.from_module(server.module).clone()
        versions: list[list[int]] = []
        trainer.register_op("batch_process", lambda batch: versions.append(batch["policy_version"].unique().tolist()))
        trainer.train()
        assert versions == [[0], [1], [2]]  # each batch collected with the weights of the update before it
        assert server.policy_version == 3
        trained = TensorDict.from_module(server.module)
        assert not (trained == before).all()  # the optimizer stepped the served module in place
        td = TensorDict(th=torch.tensor(0.3), thdot=torch.tensor(-0.2))
        with set_interaction_type(InteractionType.DETERMINISTIC):
            served = server.remote_policy()(td.clone())
            with torch.no_grad():
                expected = server.module(td.clone())
        assert int(served["policy_version"]) == 3
        torch.testing.assert_close(served["loc"], expected["loc"])  # the last update is what serves
    finally:
        trainer.collector.shutdown()
        server.close()


def test_a_served_module_node_refuses_a_server_without_a_module_here_and_every_node_one_that_is_no_server():
    node = {"_target_": "torchrl_batchserve.config.served_module", "server": {"_target_": "builtins.object"}}
    with pytest.raises(HydraException, match="built in this process, got object") as failed:
        instantiate(node)
    assert isinstance(failed.value.__cause__, TypeError)
    for target in ("remote_policy", "weight_sync_scheme"):  # an AttributeError from inside them before
        node = {"_target_": f"torchrl_batchserve.config.{target}", "server": 3}
        with pytest.raises(HydraException, match=r"server must be a server node's server .*, got int: 3") as failed:
            instantiate(node)
        assert isinstance(failed.value.__cause__, TypeError)


def test_a_wrong_value_fails_at_compose_time_naming_the_key(recipe_dir):
    with initialize_config_dir(config_dir=recipe_dir, version_base=None):
        with pytest.raises((ValidationError, HydraException), match=r"server\.timeout"):
            compose(config_name="recipe", overrides=["server.timeout=fast"])


def test_one_name_one_server_and_other_settings_under_it_are_refused(recipe_dir):
    with initialize_config_dir(config_dir=recipe_dir, version_base=None):
        cfg = compose(config_name="recipe", overrides=["server.name=shared"])
        other = compose(config_name="recipe", overrides=["server.name=shared", "server.max_batch_size=4"])
    server = instantiate(cfg.server)
    try:
        assert instantiate(cfg.collector.policy.server) is server
        with pytest.raises(HydraException, match=r"server 'shared' already exists .*'max_batch_size': \(8, 4\)"):
            instantiate(other.server)
    finally:
        server.close()
    rebuilt = instantiate(cfg.server)  # a closed server is built anew
    assert rebuilt is not server and not rebuilt.closed
    rebuilt.close()
    gone = weakref.ref(rebuilt)
    del server, rebuilt
    gc.collect()
    assert gone() is None  # the name does not keep a closed server (and its replicas' memory) alive


def test_a_server_node_serves_a_plain_module_given_its_keys():
    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from tensordict import TensorDict

    from torchrl_batchserve.config import ServerConfig

    linear = {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 3}
    node = {"name": "plain", "policy": linear, "in_keys": ["obs"], "out_keys": ["act"]}
    server = instantiate(OmegaConf.merge(OmegaConf.structured(ServerConfig), node))
    try:
        assert server.remote_policy()(TensorDict(obs=torch.ones(2)))["act"].shape == (3,)
    finally:
        server.close()


def test_a_server_node_takes_nested_keys_as_lists_as_torchrls_configs_do():
    # a multi-agent policy reads ("agents", "observation"): in YAML, [[agents, observation]]
    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from tensordict import TensorDict

    from torchrl_batchserve.config import ServerConfig

    yaml = """
    name: nested
    policy: {_target_: torch.nn.Linear, in_features: 2, out_features: 3}
    in_keys: [[agents, observation]]
    out_keys: [[agents, action]]
    policy_version_key: [stats, version]
    """
    server = instantiate(OmegaConf.merge(OmegaConf.structured(ServerConfig), OmegaConf.create(yaml)))
    try:
        td = TensorDict(agents=TensorDict(observation=torch.ones(4, 2), batch_size=[4]))
        out = server.remote_policy()(td)
        with torch.no_grad():
            torch.testing.assert_close(out["agents", "action"], server.module(td)["agents", "action"])
        assert int(out["stats", "version"]) == 0
    finally:
        server.close()


def test_an_input_spec_in_yaml_fixes_the_layout_by_key_and_names_the_entry_it_cannot_read():
    from tensordict import TensorDict

    from torchrl_batchserve import BadRequestError
    from torchrl_batchserve.config import build_server

    spec = {"th": {"shape": [], "dtype": "float32"}, "thdot": {"shape": [], "dtype": "torch.float32"}}
    with build_server({"input_spec": spec}, make_policy()) as server:
        remote = server.remote_policy()
        with pytest.raises(BadRequestError, match="key 'thdot'"):  # refused before any request was served
            remote(TensorDict(th=torch.zeros(()), thdot=torch.zeros((), dtype=torch.float64)))
        assert remote(TensorDict(th=torch.zeros(()), thdot=torch.zeros(())))["action"].shape == (1,)
    with pytest.raises(ValueError, match="input_spec entry 'th': dtype must name a torch dtype, got 'float99'"):
        build_server({"input_spec": {"th": {"shape": [], "dtype": "float99"}}}, make_policy())
    with pytest.raises(ValueError, match=r"input_spec entry 'th' must be a mapping, got \[1\]"):
        build_server({"input_spec": {"th": [1]}}, make_policy())
    with pytest.raises(ValueError, match=r"entry 'th': unknown fields \['dtyp'\] \(it takes shape, dtype, device\)"):
        build_server({"input_spec": {"th": {"shape": [], "dtyp": "int64"}}}, make_policy())  # not float32 silently
    with pytest.raises(ValueError, match="entry 'th': shape must be a list of sizes >= 0, got 4"):
        build_server({"input_spec": {"th": {"shape": 4}}}, make_policy())
    with pytest.raises(ValueError, match="entry 'th': device 'gpu' is unusable here"):
        build_server({"input_spec": {"th": {"shape": [], "device": "gpu"}}}, make_policy())


class Helped(torch.nn.Module):
    """A policy that asks another server for its features: ``act = lin(helper(obs))``."""

    def __init__(self, helper) -> None:
        super().__init__()
        self.helper = helper
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.lin(self.helper(obs=obs))


def make_helped(helper) -> TensorDictModule:
    return TensorDictModule(Helped(helper), in_keys=["obs"], out_keys=["act"])


def test_a_server_node_whose_policy_calls_another_server_node_builds_both():
    # The outer server's policy node holds the helper's remote_policy node: building the outer server builds the
    # helper inside it, where the outer one holds the names' lock (a plain lock hung there for good).
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(
        {
            "helper": {
                "_target_": "torchrl_batchserve.config.server",
                "_recursive_": False,
                "name": "helper",
                "policy": {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 2},
                "in_keys": ["obs"],
                "out_keys": ["h"],
            },
            "main": {
                "_target_": "torchrl_batchserve.config.server",
                "_recursive_": False,
                "name": "helped",
                "policy": {
                    "_target_": f"{__name__}.make_helped",
                    "helper": {"_target_": "torchrl_batchserve.config.remote_policy", "server": "${helper}"},
                },
            },
        }
    )
    built: list = []
    building = threading.Thread(target=lambda: built.append(instantiate(cfg.main)), daemon=True)
    building.start()
    building.join(60)
    assert built, "building the outer server hung"
    [main] = built
    helper = instantiate(cfg.helper)  # the one built for the outer policy
    try:
        obs = torch.randn(2)
        out = main.remote_policy()(TensorDict(obs=obs))
        assert torch.allclose(out["act"], main.module.module.lin(helper.module(obs)))
    finally:
        main.close()
        helper.close()
