"""torchrl_batchserve.mcts: tree-parallel PUCT, exact under concurrency, typed errors, no hung walks."""

from __future__ import annotations

import asyncio
import math
import threading

import pytest
import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule
from torchrl.envs import TicTacToeEnv
from torchrl.modules.mcts import PUCTScore

from torchrl_batchserve import BatchedPolicyServer, EvaluationCache, SearchError, ServerClosedError
from torchrl_batchserve.mcts import Node, TreeSearch

C_PUCT = 1.5


class Net(torch.nn.Module):
    """Board -> move logits and a value in [-1, 1]: fixed random weights, a deterministic evaluator."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.logits = torch.nn.Linear(9, 9)
        self.value = torch.nn.Linear(9, 1)

    def forward(self, board: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        flat = board.flatten(-2).float()
        return self.logits(flat), torch.tanh(self.value(flat))


def make_policy(seed: int = 0) -> TensorDictModule:
    return TensorDictModule(Net(seed), in_keys=["board"], out_keys=["logits", "value"])


class Counting:
    """A local policy that counts its calls and records each request's batch size."""

    def __init__(self, policy, fail_at: int | None = None) -> None:
        self.policy, self.fail_at, self.calls, self.shapes = policy, fail_at, 0, []
        self.in_keys = policy.in_keys
        self._lock = threading.Lock()

    def __call__(self, td: TensorDictBase) -> TensorDictBase:
        with self._lock:
            self.calls += 1
            self.shapes.append(tuple(td.batch_size))
            if self.calls == self.fail_at:
                raise ValueError("policy failed on purpose")
        return self.policy(td)


def sequential_puct(env, policy, state: TensorDictBase, simulations: int) -> list[int]:
    """A plain recursive PUCT, one simulation at a time: the root's visit counts."""
    keys = ["board", "turn", "mask"]

    def evaluate(td):
        out = policy(td.select("board"))
        legal = td["mask"]
        priors = torch.softmax(out["logits"].double().masked_fill(~legal, -math.inf), -1).tolist()
        return priors, float(out["value"])

    def make(td, terminal=None):
        return {
            "td": td.select(*keys),
            "terminal": terminal,
            "priors": None,
            "n": [0.0] * 9,
            "w": [0.0] * 9,
            "kids": {},
        }

    root = make(state)
    with torch.no_grad():
        root["priors"], _ = evaluate(root["td"])

    def simulate(node) -> float:  # the value for the player to move at node
        legal = node["td"]["mask"].tolist()
        total = sum(node["n"]) + 1.0
        best, best_score = None, -math.inf
        for a in range(9):
            if not legal[a]:
                continue
            n, w, p = node["n"][a], node["w"][a], node["priors"][a]
            score = (w / n if n else 0.0) + C_PUCT * p * math.sqrt(total) / (1 + n)
            if score > best_score:
                best, best_score = a, score
        a = best
        if a not in node["kids"]:
            turn = int(node["td"]["turn"])
            nxt = env.step(node["td"].clone().set("action", torch.tensor(a)))["next"]
            terminal = -float(nxt[f"player{turn}", "reward"]) if bool(nxt["done"]) else None
            node["kids"][a] = make(nxt, terminal)
        child = node["kids"][a]
        if child["terminal"] is not None:
            value = child["terminal"]
        elif child["priors"] is None:
            child["priors"], value = evaluate(child["td"])
        else:
            value = simulate(child)
        node["n"][a] += 1
        node["w"][a] += -value
        return -value

    with torch.no_grad():
        for _ in range(simulations):
            simulate(root)
    return [int(n) for n in root["n"]]


def walk(node: Node):
    yield node
    for child in node.children.values():
        yield from walk(child)


def assert_consistent(root: Node, simulations: int) -> None:
    """Every visit accounted for, and no walk left in flight."""
    assert root.total == simulations
    for node in walk(root):
        assert node.pending == [0] * len(node.pending)
        for action, child in node.children.items():
            assert node.visits[action] >= child.total  # every walk through a child passed its edge


@pytest.mark.parametrize("virtual_loss", [0.0, 1.0])
@pytest.mark.parametrize("moves", [0, 3])
def test_one_searcher_equals_a_plain_sequential_puct(virtual_loss, moves):
    env = TicTacToeEnv()
    policy = make_policy()
    state = env.reset()
    for action in (4, 0, 8)[:moves]:
        state = env.step(state.set("action", torch.tensor(action)))["next"].select("board", "turn", "mask")
    search = TreeSearch(env, policy, searchers=1, virtual_loss=virtual_loss, c_puct=C_PUCT)
    tree = search.tree(state)
    out = search.run(tree, 200)
    assert out["visits"].tolist() == sequential_puct(env, policy, state, 200)


def test_the_score_is_torchrls_puct_score():
    c, vl = 1.3, 2.0
    search = TreeSearch(TicTacToeEnv(), make_policy(), c_puct=c, virtual_loss=vl)
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        node = Node(TensorDict(), [True] * 6 + [False] * 3)
        node.priors = torch.softmax(torch.randn(9, generator=gen, dtype=torch.float64), -1).tolist()
        node.visits = torch.randint(1, 20, (9,), generator=gen).double().tolist()
        node.win_count = [v * q for v, q in zip(node.visits, torch.rand(9, generator=gen).mul(2).sub(1).tolist())]
        node.pending = torch.randint(0, 3, (9,), generator=gen).tolist()
        pending = torch.tensor(node.pending, dtype=torch.float64) * vl
        stats = TensorDict(
            win_count=torch.tensor(node.win_count, dtype=torch.float64) - pending,
            visits=torch.tensor(node.visits, dtype=torch.float64) + pending,
            total_visits=torch.tensor(sum(node.visits) + sum(node.pending) + 1.0, dtype=torch.float64),
            prior_prob=torch.tensor(node.priors, dtype=torch.float64),
        )
        scores = PUCTScore(c=c)(stats)["score"][:6]
        assert search._select(node) == int(scores.argmax())


@pytest.mark.parametrize("searchers", [8, 32])
def test_many_searcher_threads_count_every_simulation_exactly(searchers):
    env = TicTacToeEnv()
    policy = make_policy()
    with BatchedPolicyServer(policy, max_batch_size=searchers, timeout=0.01) as server:
        with TreeSearch(env, server.remote_policy(), searchers=searchers) as search:
            for simulations in (1, 7, 64, 150) * 5:
                tree = search.tree(env.reset())
                out = search.run(tree, simulations)
                assert int(out["visits"].sum()) == simulations
                assert_consistent(tree.root, simulations)
        sizes = server.statistics().batch_size_histogram
    assert max(sizes) > 1  # walks of one tree were evaluated together


def test_asyncio_searchers_count_every_simulation_exactly():
    env = TicTacToeEnv()

    async def main(server) -> None:
        search = TreeSearch(env, server.remote_policy(), searchers=16, leaves_per_request=2)
        for simulations in (5, 64, 200):
            tree = search.tree(env.reset())
            out = await search.arun(tree, simulations)
            assert int(out["visits"].sum()) == simulations
            assert_consistent(tree.root, simulations)

    with BatchedPolicyServer(make_policy(), max_batch_size=32, timeout=0.01) as server:
        asyncio.run(main(server))


def test_a_tree_reused_across_moves_keeps_its_statistics():
    env = TicTacToeEnv()
    search = TreeSearch(env, make_policy(), searchers=1)
    tree = search.tree(env.reset())
    out = search.run(tree, 100)
    action = int(out["visits"].argmax())
    kept = tree.root.children[action].total
    tree = search.advance(tree, action)
    assert tree.root.total == kept > 0
    search.run(tree, 50)
    assert tree.root.total == kept + 50


def test_several_leaves_per_request_travel_as_one_request():
    env = TicTacToeEnv()
    policy = Counting(make_policy())
    search = TreeSearch(env, policy, leaves_per_request=4, virtual_loss=1.0)
    tree = search.tree(env.reset())
    search.run(tree, 40)
    assert policy.shapes[0] == ()  # the root
    assert (4,) in policy.shapes[1:] and all(len(shape) == 1 and shape[0] <= 4 for shape in policy.shapes[1:])
    assert_consistent(tree.root, 40)


def test_result_target_temperature_noise_and_value():
    env = TicTacToeEnv()
    search = TreeSearch(env, make_policy(), seed=0, dirichlet_alpha=0.3)
    tree = search.tree(env.reset())
    out = search.run(tree, 60, temperature=0)
    visits = out["visits"]
    assert set(out.keys()) == {"visits", "policy", "value", "action"}
    assert out["policy"].tolist() == torch.nn.functional.one_hot(visits.argmax(), 9).float().tolist()
    assert int(out["action"]) == int(visits.argmax())
    assert -1 <= float(out["value"]) <= 1
    warm = search.run(tree, 60, temperature=1.0)
    assert torch.allclose(warm["policy"], warm["visits"].float() / 120)
    cold = search.run(tree, 60, temperature=1e-3)  # visits ** 1000 would overflow: near-greedy, as 0 is
    assert torch.isfinite(cold["policy"]).all() and float(cold["policy"].max()) > 0.99
    assert int(cold["policy"].argmax()) == int(cold["visits"].argmax()) == int(cold["action"])
    priors = list(tree.root.priors)
    fresh = search.tree(env.reset())
    plain = search.run(fresh, 60).get("visits")
    noisy_tree = search.tree(env.reset())
    noisy = search.run(noisy_tree, 60, noise=True).get("visits")
    assert tree.root.priors == priors and noisy_tree.root.priors == fresh.root.priors
    assert not torch.equal(plain, noisy)  # the noise changed where the walks went, not the priors kept


def test_root_noise_with_a_tiny_alpha_puts_its_weight_on_one_legal_move():
    # gammavariate(0.001) is 0.0 about half the time: all eight draws at once (run 307 of this seed) divided by 0.
    env = TicTacToeEnv()
    search = TreeSearch(env, make_policy(), dirichlet_alpha=1e-3, dirichlet_eps=1.0, seed=0)
    state = env.step(env.reset().set("action", torch.tensor(4)))["next"].select("board", "turn", "mask")
    for _ in range(400):
        tree = search.tree(state)
        search.run(tree, 1, noise=True)  # the noisy priors are put back after the run: look at the walk
        [action] = [a for a, n in enumerate(tree.root.visits) if n]
        assert tree.root.legal[action]


def test_a_search_takes_an_immediate_win_and_blocks_a_loss():
    env = TicTacToeEnv()

    def uniform(td):  # plain search: uniform priors, a draw as every leaf's value
        return td.set("logits", torch.zeros(*td.batch_size, 9)).set("value", torch.zeros(*td.batch_size, 1))

    search = TreeSearch(env, uniform, observation_keys=["board"], searchers=4)
    state = env.reset()
    for action in (0, 4, 1):  # X threatens 2; O to move must block
        state = env.step(state.set("action", torch.tensor(action)))["next"].select("board", "turn", "mask")
    assert int(search.run(search.tree(state), 400, temperature=0)["action"]) == 2
    state = env.step(state.set("action", torch.tensor(8)))["next"].select("board", "turn", "mask")  # O blunders
    assert int(search.run(search.tree(state), 400, temperature=0)["action"]) == 2  # X wins


class ExtraMove:
    """A two-move game in which a player may move twice in a row.

    Player 0 moves first: move 0 gives it another move, in which it can win (0) or lose (1); move 1 passes the
    turn to player 1, who can win (0) or draw (1). Player 0's best move is 0.
    """

    def reset(self) -> TensorDictBase:
        return self._state(stage=0, turn=0, done=False)

    @staticmethod
    def _state(stage: int, turn: int, done: bool, reward0: float = 0.0) -> TensorDictBase:
        return TensorDict(
            board=torch.tensor([stage]),
            turn=torch.tensor(turn),
            mask=torch.tensor([not done, not done]),
            done=torch.tensor([done]),
            player0=TensorDict(reward=torch.tensor([reward0])),
            player1=TensorDict(reward=torch.tensor([-reward0])),
        )

    def step(self, td: TensorDictBase) -> TensorDictBase:
        stage, action = int(td["board"]), int(td["action"])
        if stage == 0:
            nxt = self._state(stage=1, turn=0, done=False) if action == 0 else self._state(stage=2, turn=1, done=False)
        elif stage == 1:  # player 0 again
            nxt = self._state(stage=3, turn=1, done=True, reward0=1.0 if action == 0 else -1.0)
        else:  # player 1
            nxt = self._state(stage=3, turn=0, done=True, reward0=-1.0 if action == 0 else 0.0)
        return td.set("next", nxt)


@pytest.mark.parametrize("searchers", [1, 4])
def test_each_edge_is_scored_for_the_player_to_move_there_even_when_a_player_moves_twice(searchers):
    def uniform(td):  # plain search: uniform priors, a draw as every leaf's value
        return td.set("logits", torch.zeros(*td.batch_size, 2)).set("value", torch.zeros(*td.batch_size, 1))

    env = ExtraMove()
    search = TreeSearch(
        env, uniform, searchers=searchers, observation_keys=["board"], state_keys=["board", "turn", "mask"]
    )
    tree = search.tree(env.reset())
    out = search.run(tree, 200, temperature=0)
    assert int(out["action"]) == 0  # scored as if the turns alternated, move 0 looked like a loss
    assert float(out["value"]) > 0.5  # a forced win for player 0, the player to move at the root
    again = search.advance(tree, 0)  # player 0 to move again: its win is its best move
    assert int(search.run(again, 50, temperature=0)["action"]) == 0
    search.close()


class Puzzle:
    """A game of one player (no turn key): three binary moves; only the path 1, 0, 1 scores 1, any other -1."""

    GOAL = (1, 0, 1)

    def reset(self) -> TensorDictBase:
        return TensorDict(path=torch.tensor([-1, -1, -1]), mask=torch.tensor([True, True]))

    def step(self, td: TensorDictBase) -> TensorDictBase:
        path = td["path"].clone()
        depth = int((path >= 0).sum())
        path[depth] = int(td["action"])
        done = depth == 2
        reward = (1.0 if tuple(path.tolist()) == self.GOAL else -1.0) if done else 0.0
        nxt = TensorDict(path=path, mask=torch.tensor([not done] * 2), done=torch.tensor([done]))
        return td.set("next", nxt.set("reward", torch.tensor([reward])))


@pytest.mark.parametrize("searchers", [1, 4])
def test_a_game_of_one_player_without_a_turn_key_finds_its_scoring_path(searchers):
    def uniform(td):
        return td.set("logits", torch.zeros(*td.batch_size, 2)).set("value", torch.zeros(*td.batch_size, 1))

    env = Puzzle()
    search = TreeSearch(
        env,
        uniform,
        searchers=searchers,
        observation_keys=["path"],
        state_keys=["path", "mask"],
        turn_key=None,
        reward_key="reward",
    )
    tree, played = search.tree(env.reset()), []
    for _ in range(3):
        out = search.run(tree, 100, temperature=0)
        played.append(int(out["action"]))
        if len(played) == 1:
            assert float(out["value"]) > 0.5  # the player's own win, never its sign flipped as an opponent's
        if len(played) < 3:
            tree = search.advance(tree, played[-1])
    assert tuple(played) == Puzzle.GOAL
    search.close()


@pytest.mark.parametrize("searchers", [1, 8])
def test_a_policy_that_raises_mid_search_ends_it_with_a_typed_error(searchers):
    env = TicTacToeEnv()
    policy = Counting(make_policy(), fail_at=10)
    search = TreeSearch(env, policy, searchers=searchers)
    tree = search.tree(env.reset())
    with pytest.raises(SearchError) as info:
        search.run(tree, 500)
    assert isinstance(info.value.__cause__, ValueError)
    assert_consistent(tree.root, tree.root.total)  # no virtual loss left behind
    assert tree.root.total < 500
    search.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("mcts-searcher")]
    assert search.run(tree, 5) is not None  # the tree and the search still work: later calls succeed


def test_after_a_failed_evaluation_the_other_searchers_finish_their_walks_in_flight_and_claim_no_more():
    # On one event loop the order is fixed: the failed task stops the run before any other task resumes.
    env = TicTacToeEnv()
    policy = Counting(make_policy(), fail_at=10)
    searchers = 8

    class Async:
        in_keys = policy.in_keys

        async def acall(self, td):
            await asyncio.sleep(0)  # every task's request is in flight together
            return policy(td)

        def __call__(self, td):
            return policy(td)

    search = TreeSearch(env, Async(), searchers=searchers)
    tree = search.tree(env.reset())
    with pytest.raises(SearchError):
        asyncio.run(search.arun(tree, 500))
    assert policy.calls <= 10 + searchers - 1  # the failed call, and one in flight for each other task
    assert_consistent(tree.root, tree.root.total)


class Diverged(torch.nn.Module):
    """``Net``, but from its ``after``-th call on, the last row's logits (``"logits"``) or value (``"value"``) is nan."""

    def __init__(self, key: str, after: int) -> None:
        super().__init__()
        self.net, self.key, self.after, self.calls = Net(), key, after, 0

    def forward(self, board: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, value = self.net(board)
        self.calls += 1
        if self.calls >= self.after:
            (logits if self.key == "logits" else value)[-1] = math.nan
        return logits, value


class Miscounted(torch.nn.Module):
    """``Net``, but with its ``key``'s last dim cut (``"logits"``: 8 of 9) or doubled (``"value"``: 2)."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.net, self.key = Net(), key

    def forward(self, board: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, value = self.net(board)
        return (logits[..., :8], value) if self.key == "logits" else (logits, torch.cat([value, value], -1))


@pytest.mark.parametrize(
    "key, message",
    [
        ("logits", r"'logits' must hold one logit per action \(9\), got shape \(8,\)"),
        ("value", r"'value' must hold one value per leaf \(1\), got shape \(2,\)"),
    ],
)
def test_a_head_with_the_wrong_count_of_logits_or_values_ends_the_search_by_name(key, message):
    env = TicTacToeEnv()
    policy = TensorDictModule(Miscounted(key), in_keys=["board"], out_keys=["logits", "value"])
    search = TreeSearch(env, policy)
    with pytest.raises(SearchError, match=message):
        search.run(search.tree(env.reset()), 10)


def test_priors_are_the_softmax_over_the_legal_moves_and_logits_that_give_none_are_refused():
    # computed over Python floats, as torch computes them in double over the masked logits
    search = TreeSearch(TicTacToeEnv(), TensorDictModule(Net(), in_keys=["board"], out_keys=["logits", "value"]))
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        logits = torch.randn(9, generator=gen) * 10
        legal = torch.rand(9, generator=gen) < 0.6
        legal[int(torch.randint(9, (1,), generator=gen))] = True
        expected = torch.softmax(logits.double().masked_fill(~legal, -math.inf), -1).tolist()
        assert search._priors(logits.tolist(), legal.tolist()) == pytest.approx(expected, rel=1e-12, abs=1e-300)
    legal = [True, True, False]
    assert search._priors([0.0, -math.inf, math.nan], legal) == [1.0, 0.0, 0.0]  # an illegal move's nan is masked
    for bad in ([math.nan, 0.0, 0.0], [math.inf, 0.0, 0.0], [-math.inf, -math.inf, 0.0]):
        with pytest.raises(SearchError, match="'logits' give no distribution over the legal moves"):
            search._priors(bad, legal)


@pytest.mark.parametrize("key", ["logits", "value"])
def test_a_policy_gone_nan_ends_the_search_by_name_leaving_no_walk_in_flight(key):
    # nan scores made the selection pick index -1: an illegal move, or an index error, far from the cause.
    env = TicTacToeEnv()
    policy = TensorDictModule(Diverged(key, after=5), in_keys=["board"], out_keys=["logits", "value"])
    search = TreeSearch(env, policy, searchers=2, leaves_per_request=4)
    tree = search.tree(env.reset())
    with pytest.raises(SearchError, match=f"'{key}'"):
        search.run(tree, 200)
    assert_consistent(tree.root, tree.root.total)  # the leaves before the bad one were not backed up alone
    assert all(math.isfinite(w) for node in walk(tree.root) for w in node.win_count)


class FailingEnv:
    """TicTacToe whose ``fail_at``-th step raises, or (``stuck``) whose steps lead nowhere without ending."""

    def __init__(self, fail_at: int | None = None, stuck: bool = False) -> None:
        self.env, self.steps, self.fail_at, self.stuck = TicTacToeEnv(), 0, fail_at, stuck
        self.full_state_spec, self.observation_spec = self.env.full_state_spec, self.env.observation_spec

    def reset(self) -> TensorDictBase:
        return self.env.reset()

    def step(self, td: TensorDictBase) -> TensorDictBase:
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("env failed on purpose")
        out = self.env.step(td)
        if self.stuck:
            out["next", "mask"] = torch.zeros_like(out["next", "mask"])
            out["next", "done"] = torch.zeros_like(out["next", "done"])
        return out


@pytest.mark.parametrize("searchers", [1, 4])
@pytest.mark.parametrize("leaves_per_request", [1, 4])
def test_an_env_step_that_raises_mid_search_leaves_no_walk_in_flight(searchers, leaves_per_request):
    env = FailingEnv(fail_at=30)
    search = TreeSearch(env, make_policy(), searchers=searchers, leaves_per_request=leaves_per_request)
    tree = search.tree(env.reset())
    with pytest.raises(SearchError, match="env failed on purpose") as info:
        search.run(tree, 500)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert_consistent(tree.root, tree.root.total)  # the walks that were descending, or waiting, left nothing
    done = tree.root.total
    search.run(tree, 20)  # the tree searches on, unbiased by stale virtual losses
    assert_consistent(tree.root, done + 20)
    search.close()


def test_a_step_into_a_stuck_state_and_an_illegal_move_are_refused():
    env = FailingEnv(stuck=True)
    search = TreeSearch(env, make_policy(), searchers=2)
    tree = search.tree(env.reset())
    with pytest.raises(SearchError, match=r"led to a state with no legal move \('mask' all False\) whose 'done'"):
        search.run(tree, 10)
    assert_consistent(tree.root, 0)
    with pytest.raises(SearchError, match="action 4 led to a state with no legal move"):
        search.advance(search.tree(env.reset()), 4)
    legal = TicTacToeEnv()
    search = TreeSearch(legal, make_policy())
    tree = search.advance(search.tree(legal.reset()), 4)
    with pytest.raises(
        ValueError, match=r"action must be a legal move of the root, one of \[0, 1, 2, 3, 5, 6, 7, 8\] \(got 4\)"
    ):
        search.advance(tree, 4)
    # what is no state or no tree is named, not an AttributeError from inside the search
    with pytest.raises(TypeError, match=r"state must be a TensorDict \(e.g. env.reset\(\)\), got ndarray"):
        search.tree(legal.reset()["board"].numpy())
    for call in (lambda: search.run(None, 3), lambda: search.advance(legal.reset(), 4)):
        with pytest.raises(TypeError, match=r"tree must be a Tree \(search.tree\(state\) or search.advance"):
            call()
    search.close()


def test_a_finished_game_is_refused_as_a_root_whether_given_or_reached_by_advance_and_is_never_played_on():
    # After a win, TicTacToe's mask still shows the free cells: searched, it handed out a move of a game over.
    env = TicTacToeEnv()
    with BatchedPolicyServer(make_policy()) as server:
        search = TreeSearch(env, server.remote_policy())
        state, tree = env.reset(), search.tree(env.reset())
        for action in (0, 3, 1, 4, 2):  # the first player fills the top row
            state = env.step(state.set("action", torch.tensor(action)))["next"]
            tree = search.advance(tree, action)
        assert bool(state["done"]) and any(tree.root.legal)
        with pytest.raises(ValueError, match=r"state is a finished game \('done' is True\): there is no move"):
            search.tree(state)
        with pytest.raises(ValueError, match="the root is a finished game: there is nothing to search"):
            search.run(tree, 3)
        with pytest.raises(ValueError, match="the root is a finished game: there is nothing to search"):
            asyncio.run(search.arun(tree, 3))
        with pytest.raises(ValueError, match="the root is a finished game: there is no move to play"):
            search.advance(tree, 5)  # a free cell, which the env would have stepped into
        search.close()
        assert server.statistics().requests == 0  # nothing was evaluated


@pytest.mark.parametrize("mode", ["threads", "asyncio"])
def test_a_server_that_closes_mid_search_ends_it_with_a_typed_error(mode):
    env = TicTacToeEnv()
    served = threading.Event()

    class Signalling(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.calls = Net(), 0

        def forward(self, board):
            self.calls += 1
            if self.calls == 20:
                served.set()
            return self.net(board)

    policy = TensorDictModule(Signalling(), in_keys=["board"], out_keys=["logits", "value"])
    server = BatchedPolicyServer(policy, max_batch_size=16, timeout=0.001, cache=EvaluationCache(1000)).start()
    search = TreeSearch(env, server.remote_policy(), searchers=8)
    tree = search.tree(env.reset())
    errors: list[BaseException] = []

    def searching() -> None:
        try:
            if mode == "threads":
                search.run(tree, 10**6)
            else:
                asyncio.run(search.arun(tree, 10**6))
        except BaseException as err:
            errors.append(err)

    thread = threading.Thread(target=searching)
    thread.start()
    assert served.wait(60)
    server.close()
    thread.join(60)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], SearchError)
    assert isinstance(errors[0].__cause__, ServerClosedError)
    assert_consistent(tree.root, tree.root.total)
    search.close()


def test_bad_arguments_and_outputs_are_refused_by_name():
    env = TicTacToeEnv()
    with pytest.raises(ValueError, match=r"searchers must be an int >= 1 \(got 0\)"):
        TreeSearch(env, make_policy(), searchers=0)
    with pytest.raises(ValueError, match=r"virtual_loss must be a finite number >= 0 \(got -1\)"):
        TreeSearch(env, make_policy(), virtual_loss=-1)
    with pytest.raises(ValueError, match=r"virtual_loss must be a finite number >= 0 \(got inf\)"):
        TreeSearch(env, make_policy(), virtual_loss=math.inf)  # a walk in flight made every score nan
    with pytest.raises(ValueError, match=r"c_puct must be a finite number >= 0 \(got inf\)"):
        TreeSearch(env, make_policy(), c_puct=math.inf)
    with pytest.raises(ValueError, match=r"dirichlet_alpha must be a finite number > 0 \(got 0\)"):
        TreeSearch(env, make_policy(), dirichlet_alpha=0)  # no Dirichlet noise has it
    with pytest.raises(ValueError, match=r"dirichlet_eps must be a finite number >= 0 \(got '0.25'\)"):
        TreeSearch(env, make_policy(), dirichlet_eps="0.25")
    with pytest.raises(TypeError, match="policy must be callable as policy\\(td\\) .*, got str"):
        TreeSearch(env, "policy")  # (a config's node left uninstantiated): it failed at the first leaf
    with pytest.raises(TypeError, match="env must be a TorchRL env whose state is the TensorDict, got str"):
        TreeSearch("tictactoe", make_policy())
    with pytest.raises(TypeError, match=r"value_key: expected a key \(a str or a tuple of str\), got 3"):
        TreeSearch(env, make_policy(), value_key=3)  # it failed at the first leaf
    with pytest.raises(TypeError, match=r"turn_key: expected a key \(a str or a tuple of str\), got ''"):
        TreeSearch(env, make_policy(), turn_key="")
    search = TreeSearch(env, make_policy())
    with pytest.raises(ValueError, match=r"simulations must be an int >= 1 \(got 0\)"):
        search.run(search.tree(env.reset()), 0)
    for temperature in (-1.0, math.nan, math.inf):  # an inverted target; no target; illegal moves in it
        with pytest.raises(ValueError, match=rf"temperature must be a finite number >= 0 \(got {temperature}\)"):
            search.run(search.tree(env.reset()), 3, temperature=temperature)
    no_value = TreeSearch(env, lambda td: td.set("logits", torch.zeros(9)), observation_keys=["board"])
    with pytest.raises(SearchError, match="the policy's output has no 'value'"):
        no_value.run(no_value.tree(env.reset()), 3)
    with pytest.raises(TypeError, match="arun needs a policy with acall"):
        asyncio.run(search.arun(search.tree(env.reset()), 3))


def test_a_local_policy_and_the_server_search_alike():
    env = TicTacToeEnv()
    policy = make_policy()
    local = TreeSearch(env, policy).run(TreeSearch(env, policy).tree(env.reset()), 100)["visits"]
    with BatchedPolicyServer(make_policy(), max_batch_size=4) as server:
        search = TreeSearch(env, server.remote_policy())
        remote = search.run(search.tree(env.reset()), 100)["visits"]
    assert torch.equal(local, remote)


def test_leaf_requests_are_fresh_tensordicts_of_the_observation_keys():
    env = TicTacToeEnv()
    seen: list[set] = []

    def record(td):
        seen.append(set(td.keys()))
        return td.set("logits", torch.zeros(*td.batch_size, 9)).set("value", torch.zeros(*td.batch_size, 1))

    search = TreeSearch(env, record, observation_keys=["board"])
    tree = search.tree(env.reset())
    search.run(tree, 10)
    assert seen and all(keys == {"board"} for keys in seen)
    assert set(tree.root.state.keys()) == {"board", "turn", "mask"}  # the policy's writes never reach the tree
    assert isinstance(tree.root.state, TensorDict)


@pytest.mark.parametrize("mode", ["threads", "asyncio"])
def test_a_failed_root_evaluation_is_a_search_error_on_both_paths(mode):
    env = TicTacToeEnv()

    class Failing:
        in_keys = ["board"]

        def __call__(self, td):
            raise ValueError("no evaluation")

        async def acall(self, td):
            raise ValueError("no evaluation")

    search = TreeSearch(env, Failing(), searchers=4)
    tree = search.tree(env.reset())
    with pytest.raises(SearchError, match="the root's evaluation failed") as info:
        if mode == "threads":
            search.run(tree, 8)
        else:
            asyncio.run(search.arun(tree, 8))
    assert isinstance(info.value.__cause__, ValueError) and tree.root.priors is None


def test_every_searcher_thread_evaluates_a_local_policy_without_grad():
    # Grad mode is a thread's own: the search's no_grad reached the thread that called run(), not its helpers,
    # whose evaluations of a local module built autograd graphs.
    env = TicTacToeEnv()
    policy = make_policy()
    both_in = threading.Barrier(2, timeout=30)  # the first two leaf evaluations meet: two threads evaluate
    calls: list[tuple[int, bool]] = []
    lock = threading.Lock()

    def evaluate(td):
        with lock:
            calls.append((threading.get_ident(), torch.is_grad_enabled()))
            leaf = len(calls) - 1  # the root's evaluation is call 0
        if leaf in (1, 2):
            both_in.wait()
        return policy(td)

    evaluate.in_keys = ["board"]  # type: ignore[attr-defined]
    with TreeSearch(env, evaluate, searchers=4) as search:
        tree = search.tree(env.reset())
        search.run(tree, 32)
    assert_consistent(tree.root, 32)
    assert len({thread for thread, _ in calls}) > 1
    assert not any(grad for _, grad in calls)


def test_an_asyncio_search_leaves_grad_on_for_the_other_tasks_of_its_loop():
    # It held torch.no_grad across its awaits: a training task on the same loop ran without grad meanwhile.
    env = TicTacToeEnv()
    seen: list[bool] = []

    class Local:
        in_keys = ["board"]

        def __init__(self) -> None:
            self.policy = make_policy()

        async def acall(self, td):
            await asyncio.sleep(0)
            return self.policy(td)

        def __call__(self, td):
            return self.policy(td)

    async def main() -> None:
        done = asyncio.Event()

        async def trainer() -> None:
            while not done.is_set():
                seen.append(torch.is_grad_enabled())
                await asyncio.sleep(0)

        other = asyncio.ensure_future(trainer())
        await asyncio.sleep(0)
        search = TreeSearch(env, Local(), searchers=4)
        tree = search.tree(env.reset())
        await search.arun(tree, 32)
        done.set()
        await other
        assert_consistent(tree.root, 32)

    asyncio.run(main())
    assert len(seen) > 1 and all(seen)
