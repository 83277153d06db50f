"""The MCTS self-play example: its env, its search and a smoke run of the whole script."""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # kept: spawned searcher processes import the example too
import mcts_selfplay as mcts  # noqa: E402


def config(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return compose(config_name="mcts_selfplay", overrides=list(overrides))


def test_connect_four_rules_through_env_step():
    env = mcts.ConnectFourEnv()
    td = env.reset()
    for col in (3, 4, 3, 4, 3, 4):  # player 0 stacks column 3, player 1 column 4
        td = env.step(td.set("action", torch.tensor(col)))["next"].select(*mcts.STATE_KEYS)
    assert int(td["turn"]) == 0 and (td["board"] == 1).sum() == 3 and (td["board"] == 0).sum() == 3
    nxt = env.step(td.set("action", torch.tensor(3)))["next"]
    assert bool(nxt["done"]) and float(nxt["player0", "reward"]) == 1.0 and float(nxt["player1", "reward"]) == 0.0
    full = env.reset()
    for _ in range(6):
        full = env.step(full.set("action", torch.tensor(0)))["next"].select(*mcts.STATE_KEYS)
    assert not bool(full["mask"][0]) and bool(full["mask"][1:].all())
    with pytest.raises(ValueError, match="action 0: the column is full"):
        env.step(full.set("action", torch.tensor(0)))


def test_plain_mcts_on_connect_four_takes_an_immediate_win_and_blocks_one():
    env = mcts.ConnectFourEnv()
    cfg = config()
    td = env.reset()
    for col in (0, 6, 0, 6, 0):  # player 1 to move; player 0 threatens column 0
        td = env.step(td.set("action", torch.tensor(col)))["next"].select(*mcts.STATE_KEYS)
    plain = mcts.Evaluator(mcts.rollout_policy(env, random.Random(0)), mcts.Counter(), mcts.STATE_KEYS)
    search = mcts.make_search(env, plain, cfg, seed=0, searchers=1)
    assert int(search.run(search.tree(td), 200, temperature=0)["action"]) == 0  # block
    td = env.step(td.set("action", torch.tensor(5)))["next"].select(*mcts.STATE_KEYS)  # player 1 blunders
    assert int(search.run(search.tree(td), 200, temperature=0)["action"]) == 0  # win


def test_playouts_agree_between_the_fast_rules_and_env_step():
    env = mcts.ConnectFourEnv()
    td = env.reset()
    for seed in range(5):
        assert env.random_playout(td, random.Random(seed)) == mcts.env_playout(env, td, random.Random(seed))


@pytest.mark.parametrize(
    "overrides",
    [
        ["mode=threads"],
        ["mode=threads", "searchers_per_tree=4", "leaves_per_request=2"],
        ["mode=asyncio", "game=tictactoe", "searchers_per_tree=3"],
        ["no_server=true", "searchers_per_tree=2"],
        ["mode=processes", "games_at_once=2", "searchers_per_tree=2"],
        ["mode=processes", "games_at_once=2", "no_server=true", "game=tictactoe"],
    ],
    ids=["threads-connect4", "tree-parallel", "asyncio-tictactoe", "no-server", "processes", "processes-no-server"],
)
def test_selfplay_smoke(tmp_path, overrides):
    cfg = config(
        "rounds=2",
        "games_per_round=4",
        "games_at_once=4",
        "simulations=6",
        "train.steps_per_round=2",
        "train.batch_size=16",
        "eval.every=1",
        "eval.games=2",
        "eval.simulations=4",
        "progress=false",
        f"out_dir={tmp_path}",
        *overrides,
    )
    result = mcts.run(cfg)
    assert result["games"] == 8 and result["evaluations"] > 0
    assert [h["games"] for h in result["history"]] == [0, 4, 8]  # before training, then each checkpoint
    assert all(0.0 <= h["vs_random"] <= 1.0 and 0.0 <= h["vs_mcts"] <= 1.0 for h in result["history"])
    saved = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert saved["games"] == 8 and next(tmp_path.glob("*.png")).stat().st_size > 0
    assert OmegaConf.load(tmp_path / "config.yaml").games_at_once == cfg.games_at_once  # the run's config, saved
    if not cfg.no_server:
        # games of round r were evaluated by version r: pushed weights reached the searchers
        assert result["game_versions"] == [[0]] * 4 + [[1]] * 4
        assert result["policy_version"] == 2 and result["cache_misses"] > 0


@pytest.mark.parametrize(
    "override, message",
    [
        ("games_at_once=0", r"games_at_once must be an int >= 1 \(got 0\)"),  # ThreadPoolExecutor's max_workers
        ("games_per_round=0", r"games_per_round must be an int >= 1 \(got 0\)"),  # an empty replay buffer's
        ("rounds=-1", r"rounds must be an int >= 0 \(got -1\)"),
        ("eval.games=0", r"eval.games must be an int >= 1 \(got 0\)"),
    ],
)
def test_a_count_out_of_range_is_refused_by_its_key_before_anything_runs(tmp_path, override, message):
    # each failed later with the error of whatever it reached first, naming no key
    with pytest.raises(ValueError, match=message):
        mcts.run(config(override, "progress=false", f"out_dir={tmp_path}"))
    assert not any(tmp_path.iterdir())  # refused before the run's folder is written


def test_searcher_processes_exit_when_their_run_is_killed(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(
        "import multiprocessing as mp, sys\n"
        f"sys.path.insert(0, {str(ROOT / 'examples')!r})\n"
        "from omegaconf import OmegaConf\n"
        "import mcts_selfplay\n"
        "if __name__ == '__main__':\n"
        "    cfg = OmegaConf.create({'games_at_once': 2, 'seed': 0, 'game': 'tictactoe'})\n"
        "    pool = mcts_selfplay.ProcessSearchers(cfg, None)\n"
        "    print(*[p.pid for p in mp.active_children()], flush=True)\n"
        "    sys.stdin.read()  # until killed\n"
    )
    run = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    exits = []
    try:
        exits = [os.pidfd_open(int(pid)) for pid in run.stdout.readline().split()]  # readable once it exits
        assert len(exits) == 2
        os.kill(run.pid, signal.SIGKILL)  # no chance to tell the searchers
        run.wait(30)
        for fd in exits:
            assert select.select([fd], [], [], 60)[0], "a searcher process outlived its run"
    finally:
        run.kill()
        for fd in exits:
            if not select.select([fd], [], [], 0)[0]:  # still running: leave nothing behind
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            os.close(fd)
