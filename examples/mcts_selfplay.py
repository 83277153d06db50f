"""AlphaZero-style self-play: MCTS searchers share one BatchedPolicyServer.

Games are searched by ``torchrl_batchserve.mcts.TreeSearch`` (PUCT scored by
TorchRL's ``PUCTScore``) over a TorchRL env whose state lives in the
TensorDict (Connect Four, written below with the conventions of TorchRL's
``TicTacToeEnv``, or ``TicTacToeEnv`` itself). ``games_at_once`` games are
played at a time, each searched by ``searchers_per_tree`` walks of its one
tree at once (with ``virtual_loss`` spreading them out); every leaf goes to
one ``RemotePolicy``, and the server batches the leaves of all games and
searchers into one forward and answers repeated positions from its
``EvaluationCache``. A policy/value network learns from the games in the
same script and its weights are pushed to the server with
``update_weights`` after every round; games record the versions that
evaluated them. At checkpoints the net-guided search plays a random player
and plain MCTS (uniform priors, random rollouts) at the same number of
simulations; the win rates are printed, saved as JSON and plotted.

    python examples/mcts_selfplay.py                       # Connect Four, threads, the server
    python examples/mcts_selfplay.py no_server=true        # one model copy per game instead
    python examples/mcts_selfplay.py searchers_per_tree=16 games_at_once=1   # one game, 16 walks of its tree
    python examples/mcts_selfplay.py mode=asyncio game=tictactoe rounds=4
    python examples/mcts_selfplay.py mode=processes games_at_once=8   # worker processes

``searchers_per_tree=1`` batches across games only (one leaf in flight per
game). See ``docs/mcts.md`` for which setting learns fastest here, and why.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import multiprocessing as mp
import os
import pickle
import random
import threading
import time
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.data import LazyTensorStorage, ReplayBuffer
from torchrl.data.tensor_specs import Categorical, Composite, Unbounded
from torchrl.envs import EnvBase, TicTacToeEnv
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from torchrl_batchserve.config import build_server
from torchrl_batchserve.mcts import Tree, TreeSearch

STATE_KEYS = ("board", "turn", "mask")


# -- Connect Four, with TicTacToeEnv's conventions -------------------------------------------


class ConnectFourEnv(EnvBase):
    """Connect Four (6 rows × 7 columns) as a stateless TorchRL env.

    Like TorchRL's ``TicTacToeEnv``, the state is in the TensorDict: ``board``
    as seen by the player to move (1: its pieces, 0: the opponent's, -1:
    empty), ``turn`` (0 or 1), ``mask`` (playable columns); the action is a
    column; ``(player{i}, reward)`` is 1 when player ``i`` has just won.
    """

    batch_locked = False
    rows, cols = 6, 7

    def __init__(self, device: Any = None) -> None:
        super().__init__(device=device)
        self.action_spec = Categorical(n=self.cols, shape=(), device=device)
        self.full_observation_spec = Composite(
            board=Unbounded(shape=(self.rows, self.cols), dtype=torch.int, device=device),
            turn=Categorical(2, shape=(1,), dtype=torch.int, device=device),
            mask=Categorical(2, shape=(self.cols,), dtype=torch.bool, device=device),
            device=device,
        )
        self.state_spec = self.observation_spec.clone()
        self.reward_spec = Composite(
            {
                ("player0", "reward"): Unbounded(shape=(1,), device=device),
                ("player1", "reward"): Unbounded(shape=(1,), device=device),
            },
            device=device,
        )
        self.full_done_spec = Composite(done=Categorical(2, shape=(1,), dtype=torch.bool, device=device), device=device)
        self.full_done_spec["terminated"] = self.full_done_spec["done"].clone()
        self.full_done_spec["truncated"] = self.full_done_spec["done"].clone()

    def _reset(self, reset_td: TensorDictBase | None) -> TensorDictBase:
        shape = reset_td.shape if reset_td is not None else ()
        state = self.state_spec.zero(shape)
        state["board"] -= 1
        state["mask"].fill_(True)
        return state.update(self.full_done_spec.zero(shape))

    def _step(self, td: TensorDictBase) -> TensorDictBase:
        if td.batch_dims:
            return torch.stack([self._step(row) for row in td.unbind(0)])
        board = td["board"].tolist()
        col, turn = int(td["action"]), int(td["turn"])
        if board[0][col] != -1:
            raise ValueError(f"action {col}: the column is full (mask {td['mask'].tolist()})")
        won = drop(board, col, 1)
        flipped = [[-1 if v == -1 else 1 - v for v in row] for row in board]
        mask = torch.tensor([v == -1 for v in flipped[0]])
        done = torch.tensor([won or not mask.any()])
        return TensorDict(
            {
                "board": torch.tensor(flipped, dtype=torch.int),
                "turn": torch.tensor([1 - turn], dtype=torch.int),
                "mask": mask,
                "done": done,
                "terminated": done.clone(),
                "truncated": torch.zeros(1, dtype=torch.bool),
                ("player0", "reward"): torch.tensor([float(won and turn == 0)]),
                ("player1", "reward"): torch.tensor([float(won and turn == 1)]),
            },
            batch_size=[],
        )

    def _set_seed(self, seed: int | None) -> None:
        pass

    @staticmethod
    def random_playout(td: TensorDictBase, rng: random.Random) -> float:
        """Play uniformly random moves to the end: +1 if the player to move wins, -1 if it loses, 0 for a draw."""
        board = td["board"].tolist()
        piece = 1  # the mover's pieces are 1, the opponent's 0
        while True:
            legal = [c for c in range(len(board[0])) if board[0][c] == -1]
            if not legal:
                return 0.0
            if drop(board, rng.choice(legal), piece):
                return 1.0 if piece == 1 else -1.0
            piece = 1 - piece


def drop(board: list[list[int]], col: int, piece: int) -> bool:
    """Drop ``piece`` in ``col`` (in place); whether it makes four in a row."""
    rows, cols = len(board), len(board[0])
    row = max(r for r in range(rows) if board[r][col] == -1)
    board[row][col] = piece
    for dr, dc in ((0, 1), (1, 0), (1, 1), (1, -1)):
        count = 1
        for sign in (1, -1):
            r, c = row + sign * dr, col + sign * dc
            while 0 <= r < rows and 0 <= c < cols and board[r][c] == piece:
                count += 1
                r, c = r + sign * dr, c + sign * dc
        if count >= 4:
            return True
    return False


def env_playout(env: EnvBase, td: TensorDictBase, rng: random.Random) -> float:
    """:meth:`ConnectFourEnv.random_playout` for any env with these conventions, through ``env.step``."""
    mover, sign = int(td["turn"]), 1.0
    state = td.select(*STATE_KEYS)
    while True:
        legal = state["mask"].nonzero().flatten().tolist()
        turn = int(state["turn"])
        nxt = env.step(state.set("action", torch.tensor(rng.choice(legal))))["next"]
        if bool(nxt[f"player{turn}", "reward"] > 0):
            return sign if turn == mover else -sign
        if bool(nxt["done"]):
            return 0.0
        state = nxt.select(*STATE_KEYS)


def make_env(game: str) -> EnvBase:
    if game == "connect4":
        return ConnectFourEnv()
    if game == "tictactoe":
        return TicTacToeEnv()
    raise ValueError(f"game must be 'connect4' or 'tictactoe' (got {game!r})")


# -- the policy/value network -------------------------------------------------------------------


class PolicyValueNet(nn.Module):
    """Board (-1 empty, 1 own, 0 opponent) -> move logits and a value in [-1, 1] for the player to move."""

    def __init__(self, rows: int, cols: int, actions: int, channels: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(2, channels, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1),
            nn.ReLU(),
            nn.Flatten(-3),
            nn.Linear(channels * rows * cols, hidden),
            nn.ReLU(),
        )
        self.policy = nn.Linear(hidden, actions)
        self.value = nn.Linear(hidden, 1)

    def forward(self, board: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        planes = torch.stack([board == 1, board == 0], dim=-3).float()
        h = self.body(planes)
        return self.policy(h), torch.tanh(self.value(h))


def make_policy(env: EnvBase, seed: int) -> TensorDictModule:
    torch.manual_seed(seed)
    rows, cols = env.full_observation_spec["board"].shape
    net = PolicyValueNet(rows, cols, int(env.action_spec.n))
    return TensorDictModule(net, in_keys=["board"], out_keys=["logits", "value"])


# -- games, searched by torchrl_batchserve.mcts.TreeSearch ------------------------------------------

# A game yields the searches it needs, ``(search, tree, simulations, options)``, and
# is sent each result; drivers run them with TreeSearch.run (threads) or .arun (asyncio).
Game = Generator[tuple[TreeSearch, Tree, int, dict], TensorDictBase, Any]


class Counter:
    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def add(self, n: int = 1) -> None:
        with self._lock:
            self.value += n


class Evaluator:
    """The leaf evaluator of one game's search: counts leaves and records the policy versions that answered."""

    def __init__(self, policy: Any, evals: Counter, in_keys: tuple[str, ...] = ("board",)) -> None:
        self.policy, self.evals, self.versions = policy, evals, set()
        self.in_keys = list(in_keys)  # what TreeSearch sends of each leaf

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        self.evals.add(td.numel() or 1)
        return self._seen(self.policy(td))

    async def acall(self, td: TensorDictBase) -> TensorDictBase:
        self.evals.add(td.numel() or 1)
        acall = getattr(self.policy, "acall", None)
        return self._seen(await acall(td) if acall is not None else self.policy(td))

    def _seen(self, out: TensorDictBase) -> TensorDictBase:
        if "policy_version" in out.keys():
            self.versions.update(out["policy_version"].reshape(-1).tolist())
        return out


def rollout_policy(env: EnvBase, rng: random.Random) -> Callable[[TensorDictBase], TensorDictBase]:
    """Plain MCTS's evaluator: uniform priors, the value of one random playout."""
    playout = getattr(env, "random_playout", None) or (lambda td, r: env_playout(env, td, r))
    actions = int(env.action_spec.n)

    def evaluate(td: TensorDictBase) -> TensorDictBase:
        return td.set("logits", torch.zeros(actions)).set("value", torch.tensor([playout(td, rng)]))

    return evaluate


def make_search(env: EnvBase, policy: Any, cfg: DictConfig, seed: int, searchers: int | None = None) -> TreeSearch:
    return TreeSearch(
        env,
        policy,
        searchers=cfg.searchers_per_tree if searchers is None else searchers,
        virtual_loss=cfg.virtual_loss,
        leaves_per_request=cfg.leaves_per_request if searchers is None else 1,
        c_puct=cfg.c_puct,
        state_keys=list(STATE_KEYS),
        dirichlet_alpha=cfg.dirichlet_alpha,
        dirichlet_eps=cfg.dirichlet_eps,
        seed=seed,
    )


def self_play(env: EnvBase, policy: Any, cfg: DictConfig, seed: int, evals: Counter) -> Game:
    """One self-play game; returns its training samples and the versions that evaluated it."""
    evaluator = Evaluator(policy, evals)
    search = make_search(env, evaluator, cfg, seed)
    tree = search.tree(env.reset())
    history: list[tuple[torch.Tensor, torch.Tensor, int, float]] = []
    try:
        while tree.root.terminal is None:
            temperature = 1.0 if len(history) < cfg.temperature_moves else 0.0
            out = yield search, tree, cfg.simulations, {"noise": True, "temperature": temperature}
            visits = out["visits"].float()
            history.append(
                (tree.root.state["board"], visits / visits.sum(), int(tree.root.state["turn"]), float(out["value"]))
            )
            tree = search.advance(tree, int(out["action"]))
    finally:
        search.close()
    mover = history[-1][2]
    winner = mover if tree.root.terminal < 0 else None  # the last mover won, or the game is drawn
    outcome = [0.0 if winner is None else (1.0 if turn == winner else -1.0) for _, _, turn, _ in history]
    # The value target averages the game's outcome with the search's value
    # (a common small-scale AlphaZero choice: less noise than the outcome alone).
    samples = TensorDict(
        board=torch.stack([h[0] for h in history]),
        pi=torch.stack([h[1] for h in history]),
        z=torch.tensor([(z + h[3]) / 2 for z, h in zip(outcome, history)]).unsqueeze(-1),
        batch_size=[len(history)],
    )
    return {"samples": samples, "versions": sorted(evaluator.versions), "moves": len(history)}


def match(env: EnvBase, policy: Any, cfg: DictConfig, opponent: str, net_first: bool, seed: int) -> Game:
    """One evaluation game of the net-guided search against ``opponent``; returns 1, 0.5 or 0 for the net.

    Both sides search with one searcher per tree, so the score measures the network, whatever the
    self-play search settings.
    """
    rng = random.Random(seed)
    net = make_search(env, Evaluator(policy, Counter()), cfg, seed, searchers=1)
    plain = make_search(env, Evaluator(rollout_policy(env, rng), Counter(), STATE_KEYS), cfg, seed, searchers=1)
    game = net.tree(env.reset())
    net_turn = 0 if net_first else 1
    while game.root.terminal is None:
        turn = int(game.root.state["turn"])
        if turn != net_turn and opponent == "random":
            action = rng.choice([a for a, legal in enumerate(game.root.legal) if legal])
        else:
            search = net if turn == net_turn else plain
            out = yield search, search.tree(game.root.state), cfg.eval.simulations, {"temperature": 0.0}
            action = int(out["action"])
        game = net.advance(game, action)
        game.root.children.clear()  # keep only the game's path
    if game.root.terminal == 0:
        return 0.5
    return 1.0 if turn == net_turn else 0.0


def drive(game: Game) -> Any:
    try:
        search, tree, simulations, options = next(game)
        while True:
            search, tree, simulations, options = game.send(search.run(tree, simulations, **options))
    except StopIteration as stop:
        return stop.value


async def adrive(game: Game) -> Any:
    try:
        search, tree, simulations, options = next(game)
        while True:
            out = await search.arun(tree, simulations, **options)
            search, tree, simulations, options = game.send(out)
    except StopIteration as stop:
        return stop.value


def play(env: EnvBase, policy: Any, cfg: DictConfig, job: tuple, evals: Counter) -> Game:
    """The game a job names: ``("self_play", seed)`` or ``("match", opponent, net_first, seed)``."""
    if job[0] == "self_play":
        return self_play(env, policy, cfg, job[1], evals)
    return match(env, policy, cfg, *job[1:])


def run_games(
    env: EnvBase, jobs: list[tuple], cfg: DictConfig, policies: list[Any], evals: Counter, done: Callable[[Any], None]
) -> list[Any]:
    """Play ``jobs``, ``cfg.games_at_once`` at a time (threads or asyncio tasks); game slot i uses ``policies[i]``."""
    results: list[Any] = [None] * len(jobs)
    todo = iter(range(len(jobs)))
    lock = threading.Lock()

    def next_game() -> int | None:
        with lock:
            return next(todo, None)

    if cfg.mode == "threads":

        def games(i: int) -> None:
            with torch.no_grad():  # grad mode is per thread
                while (g := next_game()) is not None:
                    results[g] = drive(play(env, policies[i], cfg, jobs[g], evals))
                    done(results[g])

        with ThreadPoolExecutor(cfg.games_at_once) as pool:
            list(pool.map(games, range(cfg.games_at_once)))
    elif cfg.mode == "asyncio":

        async def task(i: int) -> None:
            while (g := next_game()) is not None:
                results[g] = await adrive(play(env, policies[i], cfg, jobs[g], evals))
                done(results[g])

        async def main() -> None:
            await asyncio.gather(*(task(i) for i in range(cfg.games_at_once)))

        asyncio.run(main())
    else:
        raise ValueError(f"mode must be 'threads', 'asyncio' or 'processes' (got {cfg.mode!r})")
    return results


class ProcessSearchers:
    """``cfg.games_at_once`` worker processes (spawned once), each playing the jobs it takes.

    With a server, each worker holds a pickled copy of its ``RemotePolicy``
    (its own client of the server, shared by the searcher threads of its
    tree); without one, each holds a model copy whose weights come with the jobs.
    A worker exits with the run, however the run ends (a SIGKILL included).
    """

    def __init__(self, cfg: DictConfig, remote: Any) -> None:
        ctx = mp.get_context("spawn")
        self._jobs, self._results = ctx.Queue(), ctx.Queue()
        config = OmegaConf.to_container(cfg, resolve=True)
        self._procs = [
            ctx.Process(target=_searcher_process, args=(config, remote, self._jobs, self._results), daemon=True)
            for _ in range(cfg.games_at_once)
        ]
        for proc in self._procs:
            proc.start()

    def run(self, jobs: list[tuple], evals: Counter, done: Callable[[Any], None], weights: Any = None) -> list[Any]:
        for i, job in enumerate(jobs):
            self._jobs.put((i, job, weights))
        results: list[Any] = [None] * len(jobs)
        for _ in jobs:
            i, payload, evaluations = self._results.get(timeout=3600)
            result = pickle.loads(payload)
            if isinstance(result, BaseException):
                raise result
            results[i] = result
            evals.add(evaluations)
            done(result)
        return results

    def close(self) -> None:
        for _ in self._procs:
            self._jobs.put(None)
        for proc in self._procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def _searcher_process(config: dict, remote: Any, jobs: Any, results: Any) -> None:
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    torch.set_num_threads(1)
    cfg = OmegaConf.create(config)
    env = make_env(cfg.game)
    local, loaded = (None, None) if remote is not None else (make_policy(env, cfg.seed), None)
    with torch.no_grad():
        while (item := jobs.get()) is not None:
            i, job, weights = item
            if local is not None and weights is not None and weights[0] != loaded:
                local.module.load_state_dict(pickle.loads(weights[1]))
                loaded = weights[0]
            counter = Counter()
            try:
                result = drive(play(env, remote if remote is not None else _direct(local), cfg, job, counter))  # type: ignore[arg-type]
            except Exception as err:
                result = err
            results.put((i, pickle.dumps(result), counter.value))


def _exit_with_parent() -> None:
    # A run killed by a signal it cannot handle (SIGTERM, SIGKILL) never sends the searchers their None:
    # they would wait for jobs forever. Its sentinel becomes ready when it is gone.
    wait([mp.parent_process().sentinel])  # type: ignore[union-attr]
    os._exit(1)


# -- training and the whole run ----------------------------------------------------------------


def flip(samples: TensorDictBase) -> TensorDictBase:
    """Mirror boards and move targets left-right (both games are symmetric)."""
    out = samples.clone()
    out["board"] = samples["board"].flip(-1)
    pi = samples["pi"]
    if pi.shape[-1] == samples["board"].shape[-1]:  # a move per column
        out["pi"] = pi.flip(-1)
    else:  # a move per cell
        out["pi"] = pi.reshape(*samples["board"].shape).flip(-1).flatten(-2)
    return out


def train(learner: TensorDictModule, optimizer: torch.optim.Optimizer, buffer: ReplayBuffer, steps: int) -> float:
    losses = []
    for _ in range(steps):
        batch = buffer.sample()
        logits, value = learner.module(batch["board"])
        policy_loss = -(batch["pi"] * torch.log_softmax(logits, -1)).sum(-1).mean()
        loss = policy_loss + nn.functional.mse_loss(value, batch["z"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return sum(losses) / max(1, len(losses))


# Counts of the config that must be positive (rounds, eval.every and temperature_moves may be 0 too).
COUNTS = (
    "games_at_once",
    "games_per_round",
    "train.steps_per_round",
    "train.batch_size",
    "train.buffer_size",
    "eval.games",
    "eval.simulations",
)


def run(cfg: DictConfig) -> dict:
    for key, least in [*((k, 1) for k in COUNTS), ("rounds", 0), ("eval.every", 0), ("temperature_moves", 0)]:
        value = OmegaConf.select(cfg, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{key} must be an int >= {least} (got {value!r})")
    torch.manual_seed(cfg.seed)
    env = make_env(cfg.game)
    served = make_policy(env, cfg.seed)
    learner = copy.deepcopy(served)
    optimizer = torch.optim.AdamW(learner.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    buffer = ReplayBuffer(storage=LazyTensorStorage(cfg.train.buffer_size), batch_size=cfg.train.batch_size)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, out_dir / "config.yaml", resolve=True)  # next to the results it produced
    evals, history, games_played = Counter(), [], 0
    total_games = cfg.rounds * cfg.games_per_round
    bar = tqdm(total=total_games, desc=f"{cfg.game} self-play", unit="game", disable=not cfg.progress)
    server = None if cfg.no_server else build_server(cfg.server, served)
    procs = cfg.mode == "processes"
    copies = [copy.deepcopy(served) for _ in range(cfg.games_at_once)] if cfg.no_server and not procs else []

    pool = ProcessSearchers(cfg, server.remote_policy() if server is not None else None) if procs else None

    def policies() -> list[Any]:
        if server is not None:
            return [server.remote_policy()] * cfg.games_at_once
        return [_direct(c) for c in copies]

    def games(jobs: list[tuple], counter: Counter, done: Callable[[Any], None]) -> list[Any]:
        if pool is not None:
            weights = None if server is not None else (version, pickle.dumps(learner.module.state_dict()))
            return pool.run(jobs, counter, done, weights)
        return run_games(env, jobs, cfg, policies(), counter, done)

    def status() -> dict:
        out = {"games": bar.n, "evals/s": f"{evals.value / max(1e-9, self_play_seconds + time.perf_counter() - t):.0f}"}
        if server is not None:
            s = server.statistics()
            out.update(batch=f"{s.mean_batch_size:.1f}", hit=f"{s.cache_hit_rate:.0%}", version=server.policy_version)
        return out

    def finished(result: Any) -> None:
        bar.update(1)
        bar.set_postfix(status(), refresh=False)

    def evaluate_now(version: int) -> dict:
        scores: dict[str, float] = {}
        for opponent in ("random", "mcts"):
            jobs = [("match", opponent, i % 2 == 0, 10_000 + i) for i in range(cfg.eval.games)]
            desc = f"eval vs {opponent}"
            with torch.no_grad(), tqdm(total=len(jobs), desc=desc, leave=False, disable=not cfg.progress) as ebar:
                results = games(jobs, Counter(), lambda r: ebar.update(1))
            scores[opponent] = sum(results) / len(results)
        # learning time so far: self-play and training, evaluations left out
        row = {"games": games_played, "seconds": self_play_seconds + train_seconds, "policy_version": version}
        row["vs_random"] = scores["random"]
        row["vs_mcts"] = scores["mcts"]
        tqdm.write(
            f"[{games_played} games, version {version}] net search vs random {scores['random']:.0%}, "
            f"vs plain MCTS ({cfg.eval.simulations} simulations) {scores['mcts']:.0%}"
        )
        return row

    t = time.perf_counter()
    self_play_seconds, train_seconds, version, versions_seen, loss = 0.0, 0.0, 0, [], float("nan")
    try:
        if server is not None:
            server.start()
        if cfg.eval.every:  # the untrained network's search: the baseline of the curve
            history.append(evaluate_now(version) | {"loss": float("nan")})
        for r in range(cfg.rounds):
            jobs = [("self_play", cfg.seed * 1_000_000 + games_played + i) for i in range(cfg.games_per_round)]
            t = time.perf_counter()
            with torch.no_grad():
                results = games(jobs, evals, finished)
            self_play_seconds += time.perf_counter() - t
            games_played += len(results)
            for res in results:
                buffer.extend(res["samples"])
                buffer.extend(flip(res["samples"]))
                versions_seen.append(res["versions"])
            t_train = time.perf_counter()
            loss = train(learner, optimizer, buffer, cfg.train.steps_per_round)
            weights = TensorDict.from_module(learner)
            if server is not None:
                version = server.update_weights(weights)
            else:
                version += 1
                for c in copies:
                    weights.to_module(c)
            train_seconds += time.perf_counter() - t_train
            if cfg.eval.every and ((r + 1) % cfg.eval.every == 0 or r + 1 == cfg.rounds):
                row = evaluate_now(version)
                row["loss"] = loss
                history.append(row)
    finally:
        bar.close()
        if pool is not None:
            pool.close()
        stats = server.statistics() if server is not None else None
        if server is not None:
            server.close()
    result = {
        "game": cfg.game,
        "mode": cfg.mode,
        "server": server is not None,
        "games_at_once": cfg.games_at_once,
        "searchers_per_tree": cfg.searchers_per_tree,
        "virtual_loss": cfg.virtual_loss,
        "games": games_played,
        "evaluations": evals.value,
        "self_play_seconds": self_play_seconds,
        "evaluations_per_second": evals.value / max(1e-9, self_play_seconds),
        "final_loss": loss,
        "policy_version": version,
        "game_versions": versions_seen,
        "history": history,
    }
    if stats is not None:
        result.update(
            mean_batch_size=stats.mean_batch_size,
            cache_hit_rate=stats.cache_hit_rate,
            cache_hits=stats.cache_hits,
            cache_misses=stats.cache_misses,
            cache_coalesced=stats.cache_coalesced,
        )
    name = f"{cfg.game}_{'no_server' if cfg.no_server else 'server'}_{cfg.mode}"
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1))
    torch.save(learner.module.state_dict(), out_dir / f"{name}.pt")  # the trained net, e.g. for benchmarks/mcts.py
    if history:
        plot(history, out_dir / f"{name}.png", cfg)
    print(summary(result))
    return result


def _direct(policy: TensorDictModule) -> Callable[[TensorDictBase], TensorDictBase]:
    """Call a model copy's network on the tensors, without its TensorDictModule wrapper.

    (The server calls the wrapper once per batch; calling it per leaf here
    would add its overhead to every evaluation and flatter the server.)
    """
    module, in_keys, out_keys = policy.module, policy.in_keys, policy.out_keys

    def call(td: TensorDictBase) -> TensorDictBase:
        outputs = module(*(td[key] for key in in_keys))
        return td.update(dict(zip(out_keys, outputs)))

    return call


def summary(result: dict) -> str:
    lines = [
        f"{result['games']} games, {result['evaluations']} leaf evaluations in {result['self_play_seconds']:.1f} s "
        f"of self-play: {result['evaluations_per_second']:.0f} evaluations/s "
        f"({'one server' if result['server'] else 'one model per game'}, {result['games_at_once']} games at once "
        f"as {result['mode']}, {result['searchers_per_tree']} searcher(s) per tree, "
        f"virtual loss {result['virtual_loss']})"
    ]
    if result["server"]:
        lines.append(
            f"server: mean batch {result['mean_batch_size']:.1f}, cache hit rate {result['cache_hit_rate']:.1%} "
            f"(hits {result['cache_hits']}, coalesced {result['cache_coalesced']}, misses {result['cache_misses']})"
        )
    for row in result["history"]:
        lines.append(
            f"after {row['games']} games (version {row['policy_version']}): vs random {row['vs_random']:.0%}, "
            f"vs plain MCTS {row['vs_mcts']:.0%}"
        )
    return "\n".join(lines)


def plot(history: list[dict], path: Path, cfg: DictConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    games = [h["games"] for h in history]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(games, [h["vs_random"] for h in history], marker="o", label="vs random player")
    ax.plot(games, [h["vs_mcts"] for h in history], marker="o", label=f"vs plain MCTS ({cfg.eval.simulations} sims)")
    ax.axhline(0.5, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="self-play games", ylabel="net-guided search score", ylim=(0, 1.02), title=f"{cfg.game}: learning")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@hydra.main(config_path="../conf", config_name="mcts_selfplay", version_base=None)
def main(cfg: DictConfig) -> None:
    print(OmegaConf.to_yaml(cfg))
    with logging_redirect_tqdm([logging.getLogger("torchrl")]):  # TorchRL's log lines print above the bar
        run(cfg)


if __name__ == "__main__":
    main()
