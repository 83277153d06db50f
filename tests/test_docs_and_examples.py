"""The README's code runs, every shipped YAML loads, every example runs small."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import ROOT, load_script
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import torchrl_batchserve.config  # noqa: F401  (registers server/batchserve, which the shipped configs extend)


def python_blocks(page: str) -> list[str]:
    """The Python code blocks of ``page`` (a path under the repository's root), in order."""
    return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.S)


def test_readme_python_blocks_run():
    blocks = python_blocks("README.md")
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {"__name__": "readme"})


def test_readme_has_exactly_the_two_setup_commands():
    text = (ROOT / "README.md").read_text()
    bash = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    commands = [line.split("#")[0].strip() for block in bash for line in block.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    assert "make test" in (ROOT / ".ci" / "run").read_text()


CONFIGS = sorted(p.relative_to(ROOT / "conf").with_suffix("").as_posix() for p in (ROOT / "conf").rglob("*.yaml"))


@pytest.mark.parametrize("name", CONFIGS)
def test_every_shipped_config_composes(name):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name=name)
    assert OmegaConf.to_container(cfg, resolve=True)


def _documented_command_lines() -> list[tuple[str, tuple[str, ...]]]:
    """Every ``python examples/<name>.py key=value ...`` written in the examples, the docs and the README,
    and the command-line overrides each shipped recipe's comment gives as an example."""
    sources = [*(ROOT / "examples").glob("*.py"), *(ROOT / "docs").glob("*.md"), ROOT / "README.md"]
    found = set()
    for path in sources:
        for name, args in re.findall(r"python examples/(\w+)\.py((?: +[\w.+~]+=[^\s`#]*)*)", path.read_text()):
            found.add((name, tuple(args.split())))
    for path in (ROOT / "conf").glob("*.yaml"):
        for args in re.findall(r"# Override anything on the command line, e\.g\. `([^`]*)`", path.read_text()):
            found.add((path.stem, tuple(args.split())))
    assert len(found) >= 8, f"the pattern finds too few of the documented command lines: {sorted(found)}"
    return sorted(found)


@pytest.mark.parametrize("name, overrides", _documented_command_lines())
def test_every_documented_example_command_line_composes(name, overrides):
    # As Hydra parses them from a command line: a key that is also a config group (TorchRL registers
    # collector, env, policy, ...) is taken as a choice of that group, and fails.
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        assert compose(config_name=name, overrides=list(overrides)) is not None


def test_padded_server_config_serves_variable_lengths():
    import torch
    from tensordict import TensorDict
    from tensordict.nn import TensorDictModule

    from torchrl_batchserve import LengthCost, PadCollate
    from torchrl_batchserve.config import build_server

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="server/padded").server  # it extends server/batchserve
    assert cfg.timeout == 0.002 and cfg.name == "server"  # the schema's fields, filled in
    policy = TensorDictModule(lambda tokens, mask: tokens * 2, in_keys=["tokens", "mask"], out_keys=["logits"])
    with build_server(cfg, policy) as server:
        assert isinstance(server.collate, PadCollate) and server.max_batch_cost == 4096
        futures = [server.submit(TensorDict(tokens=torch.randn(n, 3))) for n in (5, 40)]
        for fut in futures:
            td = fut.result(10)
            torch.testing.assert_close(td["logits"], td["tokens"] * 2)  # trimmed to its own length
    assert isinstance(server.cost_fn, LengthCost)


@pytest.mark.parametrize(
    "node",
    [
        {"observation": {"shape": [8], "dtype": "float32"}},
        {"_target_": "torchrl.data.Composite", "observation": {"_target_": "torchrl.data.Unbounded", "shape": [8]}},
    ],
)
def test_a_server_config_gives_the_input_layout(node):
    import torch
    from tensordict import TensorDict
    from tensordict.nn import TensorDictModule

    from torchrl_batchserve import BadRequestError
    from torchrl_batchserve.config import build_server

    policy = TensorDictModule(torch.nn.Linear(8, 2), in_keys=["observation"], out_keys=["logits"])
    with build_server(OmegaConf.create({"input_spec": node}), policy) as server:
        with pytest.raises(BadRequestError, match=r"key 'observation': expected feature shape \(8,\)"):
            server.submit(TensorDict(observation=torch.zeros(5)))  # refused from the first request on
        assert server.submit(TensorDict(observation=torch.zeros(8))).result(10)["logits"].shape == (2,)
    with pytest.raises(
        ValueError, match="input_spec entry 'observation': dtype must name a torch dtype, got 'float23'"
    ):
        build_server(OmegaConf.create({"input_spec": {"observation": {"shape": [8], "dtype": "float23"}}}), policy)


def test_a_server_node_resolves_its_interpolations_in_its_recipe():
    import torch
    from tensordict.nn import TensorDictModule

    from torchrl_batchserve.config import build_server

    recipe = OmegaConf.create({"searchers": 12, "obs": 5, "server": {"max_batch_size": "${searchers}"}})
    recipe.server.input_spec = {"observation": {"shape": ["${obs}"]}}
    policy = TensorDictModule(torch.nn.Linear(5, 2), in_keys=["observation"], out_keys=["logits"])
    server = build_server(recipe.server, policy)
    assert server.max_batch_size == 12 and server._intake.layout.specs[0].shape == (5,)
    server.close()


def test_the_migration_pages_side_by_side_loop_runs_on_both_servers():
    import copy

    from tensordict import TensorDict
    from tensordict.nn import TensorDictModule

    block = python_blocks("docs/migration.md")[0]
    policy = TensorDictModule(torch.nn.Linear(4, 2), in_keys=["observation"], out_keys=["logits"])
    new_policy = copy.deepcopy(policy)
    scope = {"policy": policy, "new_policy": new_policy, "obs": torch.randn(4), "TensorDict": TensorDict}
    exec(compile(block, "migration.md", "exec"), scope)
    assert scope["td"]["logits"].shape == (2,) and scope["server"].policy_version == 1


_PENDULUM_POLICY = """
import torch
from tensordict.nn import TensorDictModule
from torchrl_batchserve import BatchedPolicyServer

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)

    def forward(self, th, thdot):
        return self.lin(torch.stack([th, thdot], -1))

policy = TensorDictModule(Net(), in_keys=["th", "thdot"], out_keys=["action"])
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("push", ["collector.update_policy_weights_()", "server.update_weights()"])
def test_the_collector_loop_of_the_processes_page_runs_as_a_script_and_exits(tmp_path, push):
    # As a script, its collector still referenced when the interpreter exits. There TorchRL 0.14.1's default
    # weight-sync scheme, never used by a loop that pushes through the server, starts a thread from __del__ and
    # the exit hangs. The page gives the collector the server's scheme.
    block = python_blocks("docs/processes.md")[0]
    assert "collector.update_policy_weights_()" in block
    main = (
        block.replace("collector.update_policy_weights_()", push) + "print('served version', server.policy_version)\n"
    )
    script = tmp_path / "collect.py"
    script.write_text(_PENDULUM_POLICY + "\nif __name__ == '__main__':\n" + textwrap.indent(main, "    "))
    try:
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the script did not exit within 90 s; its output: {err.stdout!r}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "served version 8" in done.stdout  # 2,048 frames in batches of 256, a push after each


def test_collector_example_smoke(tmp_path):
    collector_pendulum = load_script("examples", "collector_pendulum")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(
            config_name="collector_pendulum",
            overrides=["workers=2", "frames_per_batch=64", "total_frames=192", "train_steps=2", "progress=false"]
            + [f"out_dir={tmp_path}"],
        )
    result = collector_pendulum.run(cfg)
    assert result["mismatches"] == 0 and result["frames"] == 192
    assert result["versions"] == [[0], [1], [2]]  # each rollout served with the weights pushed after the last
    assert result["statistics"].failed_batches == 0
    assert (tmp_path / "reward.png").exists() and (tmp_path / "config.yaml").exists()
    for override, message in (("workers=0", "workers must be"), ("frames_per_batch=0", "frames_per_batch must be")):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
            bad = compose(config_name="collector_pendulum", overrides=[override, f"out_dir={tmp_path / 'bad'}"])
        with pytest.raises(ValueError, match=message + r" an int >= 1 \(got 0\)"):  # TorchRL's unpacking, a modulo
            collector_pendulum.run(bad)
    assert not (tmp_path / "bad").exists()  # refused before the run wrote anything


def test_actors_demo_smoke():
    actors_demo = load_script("examples", "actors_demo")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="actors_demo", overrides=["threads=4", "tasks=8", "requests_per_actor=10"])
    result = actors_demo.run(cfg)
    assert result["mismatches"] == 0 and result["requests"] == 120
    assert result["statistics"].requests == 120
    for override, message in (
        ("threads=0", r"threads \+ tasks must be at least 1"),
        ("threads=-1", r"threads must be"),
    ):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
            bad = compose(config_name="actors_demo", overrides=[override, "tasks=0"])
        with pytest.raises(ValueError, match=message):  # a stack of no results failed at the end; -1 ran none
            actors_demo.run(bad)


def test_benchmark_quick_smoke(tmp_path):
    out = load_script("benchmarks", "run").main(["--quick", "--only", "vector", "--out", str(tmp_path)])
    report = (tmp_path / "benchmarks_quick.md").read_text()
    assert re.search(r"a thread wake-up round trip takes \d+ us here", report)  # measured, not assumed
    row = next(r for r in out["rows"] if r["actors"] == 8 and r["mode"] == "threads")
    assert row["ours"]["rps"] > 0 and row["torchrl"]["rps"] > 0 and row["x_torchrl"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without CUDA")
def test_a_benchmark_asked_for_a_cuda_device_without_one_says_so(capsys):
    with pytest.raises(SystemExit):
        load_script("benchmarks", "run").main(["--quick", "--device", "cuda"])
    assert "--device cuda: this torch build or machine has no CUDA device" in capsys.readouterr().err


def test_pickling_benchmark_quick_smoke():
    rows = load_script("benchmarks", "pickling").main(["--quick", "--rows", "4"])  # each payload round-trips
    assert [r["payload"] for r in rows] == ["vector, one row", "vector, 4 rows", "pixels, one row", "pixels, 4 rows"]
    assert all(r[k] > 0 for r in rows for k in ("enc ours", "enc torch", "dec ours", "dec torch"))


def test_varlen_benchmark_quick_smoke(tmp_path):
    out = load_script("benchmarks", "varlen").main(["--quick", "--actors", "8", "--out", str(tmp_path)])
    assert (tmp_path / "benchmarks_varlen_quick.md").exists()
    rows = {r["system"]: r for r in out["rows"]}
    assert set(rows) == {"ours-pad", "ours-buckets", "ours-pack", "torchrl-pad"}
    assert rows["ours-pack"]["overhead"] == 1.0  # packing computes no padding
    assert rows["ours-pad"]["overhead"] > 1.0 and all(r["rps"] > 0 for r in rows.values())


def test_process_benchmark_quick_smoke(tmp_path):
    argv = ["--quick", "--only", "vector", "--procs", "2,2x4", "--out", str(tmp_path)]
    rows = load_script("benchmarks", "processes").main(argv)["rows"]
    assert [row["procs"] for row in rows] == ["2", "2x4"]
    assert all(row["ours"]["rps"] > 0 and row["torchrl"]["rps"] > 0 for row in rows)
    assert rows[0]["floor"]["rps"] > 0 and rows[0]["floor"]["mean_batch"] >= 1  # the floor: one call per worker
    assert not rows[1]["floor"]
    assert "| vector | 2 x 4 tasks |" in (tmp_path / "benchmarks_processes_quick.md").read_text()


@pytest.mark.skipif(
    [name for _, name in socket.if_nameindex()] != ["lo"], reason="Ray runs in a loopback-only namespace (make test)"
)
@pytest.mark.timeout(600)
@pytest.mark.ray_cluster
def test_ray_benchmark_quick_smoke(tmp_path):
    pytest.importorskip("ray")
    argv = ["--quick", "--actors", "2", "--seconds", "1", "--out", str(tmp_path)]
    rows = load_script("benchmarks", "ray_cluster").main(argv)  # what benchmarks/ray.py runs
    assert {r["system"] for r in rows} == {"ours", "torchrl", "serve"} and all(r["requests"] > 0 for r in rows)
    assert "| 2 |" in (tmp_path / "benchmarks_ray_quick.md").read_text()


def test_torchrl_transports_benchmark_measures_each_transport(tmp_path):
    argv = ["--torchrl-transports", "--quick", "--only", "vector", "--procs", "2", "--out", str(tmp_path)]
    runs = load_script("benchmarks", "processes").main(argv)["runs"]
    assert {system for _, _, system in runs} == {"torchrl", "torchrl-shm", "torchrl-mp"}
    assert all(r["rps"] > 0 and r["mean_batch"] >= 1 for rs in runs.values() for r in rs)
    report = (tmp_path / "benchmarks_torchrl_transports_quick.md").read_text()
    assert "| vector | 2 |" in report and "MPTransport" in report and "SharedMemoryTransport" in report


def test_weights_benchmark_quick_smoke(tmp_path):
    out = load_script("benchmarks", "weights").main(["--quick", "--out", str(tmp_path)])
    for row in out["rows"]:
        assert row["ours"]["pushes"] > 0 and row["torchrl"]["pushes"] > 0
        assert row["ours"]["lag_ms"] > 0 and row["torchrl"]["pushing"] > 0
    assert (tmp_path / "benchmarks_weights_quick.md").exists()


def test_worker_cost_benchmark_smoke():
    rows = load_script("benchmarks", "worker_cost").main(["--procs", "2", "--calls", "50"])
    assert len(rows) == 2 and all(make > 0 and call > 0 and hot > 0 for make, call, hot in rows)


def test_tuning_benchmark_quick_smoke(tmp_path):
    rows = load_script("benchmarks", "tuning").main(["--quick", "--out", str(tmp_path)])
    assert {(r["mode"], r["max_batch_size"], r["timeout"]) for r in rows} == {
        (mode, size, timeout)
        for mode in ("threads", "tasks", "processes")
        for size, timeout in ((8, 0.002), (64, 0.002), (64, 0.0005))
    }
    assert all(r["rps"] > 0 and 1 <= r["batch"] <= r["max_batch_size"] for r in rows)
    assert (tmp_path / "tuning_curves_quick.md").exists() and (tmp_path / "tuning_curves_quick.png").exists()


def test_mcts_benchmark_quick_smoke(tmp_path):
    bench = load_script("benchmarks", "mcts")
    out = bench.main(["--quick", "--out", str(tmp_path)])
    grid = {(r["games"], r["searchers"]): r for r in out["throughput"]}
    assert set(grid) == {(g, s) for g in (1, 16) for s in (1, 4, 16, 64)}
    assert all(r["evaluations_per_s"] > 0 and r["mean_batch"] >= 1 for r in grid.values())
    assert all(0 <= m["score"] <= 1 and m["games"] == 1 for m in out["strength"])
    assert (tmp_path / "benchmarks_mcts_quick.md").exists() and (tmp_path / "benchmarks_mcts_quick.png").exists()


@pytest.mark.parametrize(
    "replicas, cache, faults, modes",
    [(1, False, False, False), (2, True, False, False), (2, True, True, False), (2, True, False, True)],
    ids=["one-replica", "two-replicas-cache", "two-replicas-cache-faults", "two-replicas-cache-modes"],
)
def test_a_short_soak_loses_duplicates_and_corrupts_nothing_and_leaves_nothing_behind(replicas, cache, faults, modes):
    # benchmarks/soak.py with small settings: mixed threads, futures, asyncio tasks and a
    # worker process while weights are pushed; every result checked at its stamped version
    # (no older than the newest staged before it was sent; never older for one caller with one
    # request at a time). With two replicas and the cache, rows come from one pool, so hits and
    # coalesced rows are checked too. With faults, some rows make their batch raise, some calls
    # are cancelled and a worker is killed mid-run: each of those requests fails or is cancelled,
    # never lost and never answered wrongly, and every other request is served. With modes, two
    # worker processes run under RANDOM and DETERMINISTIC, the others under none, and the policy's
    # output tells them apart: no row is served under another's interaction type.
    result = load_script("benchmarks", "soak").run(
        4000,
        threads=2,
        futures=1,
        tasks=4,
        processes=2 if modes else 1,
        replicas=replicas,
        cache=cache,
        faults=faults,
        modes=modes,
    )
    assert result["sent"] >= result["done"] > 0
    assert (result["lost"], result["duplicated"], result["wrong"], result["errors"]) == (0, 0, 0, 0)
    assert (result["refused"] > 0, result["cancelled"] > 0) == (faults, faults)
    assert result["pushes"] > 0
    assert len(result["replica_batches"]) == replicas and all(result["replica_batches"])
    assert (result["cache_hits"] > 0) == cache
    before, after = result["before"], result["after"]
    assert after["fds"] <= before["fds"] and after["threads"] <= before["threads"]  # others may end meanwhile
    assert after["dev_shm"] <= before["dev_shm"]


def test_every_public_name_is_in_the_api_reference():
    import torchrl_batchserve

    reference = (ROOT / "docs" / "api.md").read_text()
    missing = [name for name in torchrl_batchserve.__all__ if f"::: torchrl_batchserve.{name}\n" not in reference]
    assert not missing, f"docs/api.md lacks {missing}"
    for module in ("torchrl_batchserve.mcts", "torchrl_batchserve.config"):
        assert f"::: {module}\n" in reference


def test_every_docs_page_is_in_the_site_navigation():
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def pages(entries):
        for entry in entries:
            for value in entry.values():
                yield from pages(value) if isinstance(value, list) else [value]

    assert sorted(pages(nav)) == sorted(p.name for p in (ROOT / "docs").glob("*.md"))


def _ppo_recipe(tmp_path, *overrides: str):
    """The PPO recipe's module and its config, two workers of 400 frames a batch, written to ``tmp_path``."""
    ppo_pendulum = load_script("examples", "ppo_pendulum")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(
            config_name="ppo_pendulum",
            overrides=[
                *overrides,
                "collector.num_workers=2",
                "collector.frames_per_batch=400",
                f"out_dir={tmp_path}",
            ],
        )
    return ppo_pendulum, cfg


def test_ppo_recipe_smoke(tmp_path):
    ppo_pendulum, cfg = _ppo_recipe(tmp_path, "collector.total_frames=1200", "ppo.epochs=1", "progress=false")
    result = ppo_pendulum.run(cfg)
    assert [h["versions"] for h in result["history"]] == [[0], [1], [2]]  # each iteration's push was served
    assert result["frames"] == 1200 and result["statistics"]["requests"] > 0
    assert (tmp_path / "reward.png").exists() and (tmp_path / "config.yaml").exists()
    assert (tmp_path / "result.json").exists() and list(tmp_path.rglob("*.csv"))  # the statistics, per iteration


def test_ppo_recipe_measures_frames_per_second(tmp_path):
    ppo_pendulum, cfg = _ppo_recipe(tmp_path, "measure=true", "measure_frames=800")
    result = ppo_pendulum.run(cfg)
    assert set(result) == {
        "MultiSyncCollector, one server",
        "server mean batch",
        "MultiSyncCollector, a policy copy per worker",
        "AsyncBatchedCollector (TorchRL's server), transport='driver'",
        "AsyncBatchedCollector (TorchRL's server), transport='auto'",
    }
    assert all(v > 0 for v in result.values())
