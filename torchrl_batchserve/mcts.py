"""Tree-parallel PUCT search: several searchers walk one tree at the same time.

A search is sequential at heart: a walk selects down to a leaf, needs the
leaf's evaluation, and only then backs the value up. :class:`TreeSearch` runs
``searchers`` walks of one tree at once (threads, or asyncio tasks on one
loop), so one game gives the server as many leaves as it has searchers.

Each walk holds the tree's lock while it selects and while it backs up, never
while its leaf is being evaluated. While a walk is in flight every edge on its
path carries a *virtual loss*: the edge counts ``virtual_loss`` extra visits
that each lost, so the next walk prefers other branches; the backup replaces
them with the real result. Two walks may still reach the same unexpanded leaf
(always so with ``virtual_loss=0``): both evaluate it (an
:class:`~torchrl_batchserve.EvaluationCache` on the server computes it once),
the first to return expands it, and both back its value up. Every walk is one
simulation, so after ``run(tree, S)`` the root has exactly ``S`` more visits.

Scoring is PUCT exactly as TorchRL's :class:`~torchrl.modules.mcts.PUCTScore`
computes it (``W/N + c * P * sqrt(N_parent) / (1 + N)``, tested equal to it),
with an unvisited move's ``W/N`` taken as 0 and the parent's count as
``N_parent + 1``, so that the first walk from a fresh node follows the
priors. It is written over the node's Python lists rather than by calling
``PUCTScore``, which scores one node per call with small tensor ops, each
releasing and retaking the GIL that the other walkers wait for (the A/B is in
``docs/performance.md``). It would fit a search that scores a whole frontier
of nodes in one call. A leaf's priors are computed the same way: a softmax
over the legal moves' logits, read once per request into Python floats.

The env's state lives in the TensorDict, as in TorchRL's ``TicTacToeEnv``:
``env.step`` from a state and an ``action``, a boolean action mask, the
player to move, ``done`` and the reward of the player who moved; a node keeps
its state TensorDict. A value is backed up for the player to move at each
node, so players need not alternate (a game may give a player an extra move).
(Why not :class:`torchrl.data.MCTSForest`: it stores collected rollouts in a
storage keyed by observation and builds trees from them on query; a search
that updates visit counts and virtual losses in place, under concurrent
walks, needs per-node statistics that live with the node.)
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase

from torchrl_batchserve.checks import check_int, check_number
from torchrl_batchserve.errors import SearchError
from torchrl_batchserve.varlen import as_key

__all__ = ["Node", "Tree", "TreeSearch"]

# A walker yields the leaves it wants evaluated (one request) and is sent the policy's output.
Walker = Generator[TensorDictBase, TensorDictBase, None]


def _resume(walker: Walker, result: TensorDictBase | None = None, error: BaseException | None = None) -> Any:
    """The walker's next request, computed without grad: never across an await, where other tasks run."""
    with torch.no_grad():
        return walker.send(result) if error is None else walker.throw(error)


def _check_tree(tree: Any) -> None:
    if not isinstance(tree, Tree):
        raise TypeError(f"tree must be a Tree (search.tree(state) or search.advance(...)), got {type(tree).__name__}")


class Node:
    """A position of the tree: its env state and the statistics of its moves.

    ``turn`` is the player to move here (the state's turn key).
    ``legal``, ``visits``, ``win_count`` (the sum of backed-up values, for
    the player to move here) and ``pending`` (walks in flight through each
    move) are lists with one entry per action; ``priors`` is ``None`` until
    the node is expanded. ``terminal`` is the value of a finished game for
    ``turn``, else ``None``.
    """

    __slots__ = ("children", "legal", "pending", "priors", "state", "terminal", "turn", "visits", "win_count")

    def __init__(self, state: TensorDictBase, legal: list[bool], terminal: float | None = None, turn: int = 0) -> None:
        actions = len(legal)
        self.state = state
        self.legal = legal
        self.turn = turn
        self.terminal = terminal
        self.priors: list[float] | None = None
        self.visits = [0.0] * actions
        self.win_count = [0.0] * actions
        self.pending = [0] * actions
        self.children: dict[int, Node] = {}

    @property
    def total(self) -> int:
        """The visits of this node's moves: the simulations that passed through it."""
        return int(sum(self.visits))


class Tree:
    """One search tree: its root and the lock its walks share. Reused from move to move by
    :meth:`TreeSearch.advance`."""

    def __init__(self, root: Node) -> None:
        self.root = root
        self.lock = threading.Lock()


class _Run:
    """One call of :meth:`TreeSearch.run`: the simulations left to claim, and the first error."""

    def __init__(self, simulations: int) -> None:
        self.left = simulations
        self.error: BaseException | None = None

    def claim(self, k: int) -> int:  # under the tree's lock
        n = 0 if self.error is not None else min(k, self.left)
        self.left -= n
        return n

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error


class TreeSearch:
    """PUCT search in which ``searchers`` walks explore one tree concurrently.

    Args:
        env: a TorchRL env whose state is the TensorDict (``TicTacToeEnv``'s
            conventions): ``env.step(state.set("action", a))["next"]`` gives the
            next state, ``done`` and the mover's reward.
        policy: evaluates leaves: a :class:`~torchrl_batchserve.RemotePolicy`
            (its ``acall`` is used by :meth:`arun`), or any callable that takes
            a TensorDict of ``observation_keys`` (batch ``[]``, or ``[k]`` with
            ``leaves_per_request=k``) and returns it with ``prior_key`` (move
            logits) and ``value_key`` (the value for the player to move, in
            ``[-1, 1]``).

    Keyword Args:
        searchers (int): walks in flight at once on one tree. Default 1.
        virtual_loss (float): the losses a walk in flight adds to each edge of
            its path. Default 1.0; 0 lets concurrent walks pile onto one leaf.
        leaves_per_request (int): a searcher walks this many times (each with
            its virtual loss) and sends the leaves as one request of that many
            rows. Default 1.
        c_puct (float): the exploration constant of PUCT. Default 1.5.
        observation_keys: the keys sent to the policy; default the policy's
            ``in_keys``, or the whole state.
        state_keys: the keys of a state; default the env's state and observation keys.
        prior_key, value_key, mask_key, turn_key, done_key (NestedKey): where
            the policy writes logits and value, and where the state holds the
            action mask and the player to move, and the step its done flag.
            Defaults ``"logits"``, ``"value"``, ``"mask"``, ``"turn"``, ``"done"``.
            ``turn_key=None``: a game of one player (a puzzle), always to move.
        reward_key: the mover's reward in the step's ``"next"``; ``"{turn}"``
            in its strings becomes the mover's turn (0 for one player). Default
            ``("player{turn}", "reward")``; for one player, often ``"reward"``.
        dirichlet_alpha (float): AlphaZero's exploration noise at the
            root for runs with ``noise=True``. Default 1.0.
        dirichlet_eps (float): the weight of that noise. Default 0.25.
        seed (int, optional): seeds the noise and the sampled actions.

    Examples:
        >>> import torch
        >>> from tensordict.nn import TensorDictModule
        >>> from torchrl.envs import TicTacToeEnv
        >>> from torchrl_batchserve import BatchedPolicyServer
        >>> from torchrl_batchserve.mcts import TreeSearch
        >>> class Net(torch.nn.Module):
        ...     def forward(self, board):
        ...         flat = board.flatten(-2).float()
        ...         return torch.zeros_like(flat), torch.zeros(*flat.shape[:-1], 1)
        >>> policy = TensorDictModule(Net(), in_keys=["board"], out_keys=["logits", "value"])
        >>> env = TicTacToeEnv()
        >>> with BatchedPolicyServer(policy, max_batch_size=8) as server:
        ...     with TreeSearch(env, server.remote_policy(), searchers=8) as search:
        ...         tree = search.tree(env.reset())
        ...         out = search.run(tree, simulations=64)
        ...         tree = search.advance(tree, int(out["action"]))
        >>> int(out["visits"].sum()), out["policy"].shape, out["value"].shape
        (64, torch.Size([9]), torch.Size([1]))
    """

    def __init__(
        self,
        env: Any,
        policy: Callable[[TensorDictBase], TensorDictBase],
        *,
        searchers: int = 1,
        virtual_loss: float = 1.0,
        leaves_per_request: int = 1,
        c_puct: float = 1.5,
        observation_keys: Sequence[NestedKey] | None = None,
        state_keys: Sequence[NestedKey] | None = None,
        prior_key: NestedKey = "logits",
        value_key: NestedKey = "value",
        mask_key: NestedKey = "mask",
        turn_key: NestedKey | None = "turn",
        done_key: NestedKey = "done",
        reward_key: NestedKey = ("player{turn}", "reward"),
        dirichlet_alpha: float = 1.0,
        dirichlet_eps: float = 0.25,
        seed: int | None = None,
    ) -> None:
        for name, value in (("searchers", searchers), ("leaves_per_request", leaves_per_request)):
            check_int(name, value, 1)
        check_number("virtual_loss", virtual_loss)
        check_number("c_puct", c_puct)
        check_number("dirichlet_alpha", dirichlet_alpha, positive=True)
        check_number("dirichlet_eps", dirichlet_eps)
        if dirichlet_eps > 1:
            raise ValueError(f"dirichlet_eps must be in [0, 1] (got {dirichlet_eps!r})")
        if not callable(policy):
            raise TypeError(f"policy must be callable as policy(td) (e.g. a RemotePolicy), got {type(policy).__name__}")
        if not callable(getattr(env, "step", None)):
            raise TypeError(f"env must be a TorchRL env whose state is the TensorDict, got {type(env).__name__}")
        prior_key, value_key, mask_key, done_key, reward_key = (
            as_key(key, name)
            for name, key in (
                ("prior_key", prior_key),
                ("value_key", value_key),
                ("mask_key", mask_key),
                ("done_key", done_key),
                ("reward_key", reward_key),
            )
        )
        turn_key = None if turn_key is None else as_key(turn_key, "turn_key")
        self.env = env
        self.policy = policy
        self.searchers = searchers
        self.virtual_loss = float(virtual_loss)
        self.leaves_per_request = leaves_per_request
        self.c_puct = float(c_puct)
        if state_keys is None:
            state_keys = list(
                dict.fromkeys([*env.full_state_spec.keys(True, True), *env.observation_spec.keys(True, True)])
            )
        self.state_keys = list(state_keys)
        in_keys = getattr(policy, "in_keys", None)
        self.observation_keys = list(observation_keys or in_keys or self.state_keys)
        self.prior_key, self.value_key, self.mask_key = prior_key, value_key, mask_key
        self.turn_key, self.done_key, self.reward_key = turn_key, done_key, reward_key
        self.dirichlet_alpha, self.dirichlet_eps = dirichlet_alpha, dirichlet_eps
        self.rng = random.Random(seed)
        self._pool: ThreadPoolExecutor | None = None

    # -- the tree ------------------------------------------------------------------------------

    def tree(self, state: TensorDictBase) -> Tree:
        """A fresh tree rooted at ``state`` (e.g. ``env.reset()``); ``ValueError`` for a finished game.

        (Its mask may still show free cells: searched, it would hand out a move of a game that is over.)
        """
        if not isinstance(state, TensorDictBase):
            raise TypeError(f"state must be a TensorDict (e.g. env.reset()), got {type(state).__name__}")
        done = state.get(self.done_key, None)
        if done is not None and bool(done.any()):
            raise ValueError(f"state is a finished game ({self.done_key!r} is True): there is no move to search")
        return Tree(self._node(state.select(*self.state_keys)))

    def advance(self, tree: Tree, action: int) -> Tree:
        """The tree after ``action`` is played: the child's subtree, its statistics kept."""
        _check_tree(tree)
        if tree.root.terminal is not None:
            raise ValueError("the root is a finished game: there is no move to play")
        legal = [a for a, ok in enumerate(tree.root.legal) if ok]
        if isinstance(action, bool) or action not in legal:
            raise ValueError(f"action must be a legal move of the root, one of {legal} (got {action!r})")
        with tree.lock:
            return Tree(self._child(tree.root, int(action)))

    def _node(self, state: TensorDictBase) -> Node:
        turn = 0 if self.turn_key is None else int(state[self.turn_key])
        return Node(state, state[self.mask_key].reshape(-1).bool().tolist(), turn=turn)

    def _child(self, node: Node, action: int) -> Node:
        child = node.children.get(action)
        if child is None:
            step = self.env.step(node.state.select(*self.state_keys).set("action", torch.tensor(action)))["next"]
            child = self._node(step.select(*self.state_keys))
            if bool(step[self.done_key].any()):
                reward = float(step[self._mover_reward(node.turn)])
                child.terminal = reward if child.turn == node.turn else -reward
            elif not any(child.legal):
                raise SearchError(
                    f"action {action} led to a state with no legal move ({self.mask_key!r} all False) "
                    f"whose {self.done_key!r} is False"
                )
            node.children[action] = child
        return child

    def _mover_reward(self, turn: int) -> NestedKey:
        keys = (self.reward_key,) if isinstance(self.reward_key, str) else tuple(self.reward_key)
        keys = tuple(k.replace("{turn}", str(turn)) for k in keys)
        return keys[0] if len(keys) == 1 else keys

    # -- one walk --------------------------------------------------------------------------------

    def _select(self, node: Node) -> int:
        """The PUCT choice at ``node``, each walk in flight counted as ``virtual_loss`` lost visits."""
        assert node.priors is not None
        vl, c = self.virtual_loss, self.c_puct
        sqrt_total = math.sqrt(sum(node.visits) + sum(node.pending) + 1.0)
        best, best_score = -1, -math.inf
        for action, legal in enumerate(node.legal):
            if legal:
                n = node.visits[action] + vl * node.pending[action]
                w = node.win_count[action] - vl * node.pending[action]
                score = (w / n if n else 0.0) + c * node.priors[action] * sqrt_total / (1 + n)  # PUCTScore's order
                if score > best_score:
                    best, best_score = action, score
        return best

    def _descend(self, root: Node) -> tuple[list[tuple[Node, int]], Node]:
        """Select from ``root`` to a leaf, marking the path in flight (under the tree's lock).

        Returns the path and its leaf: a finished game, or a node to evaluate.
        """
        node, path = root, []
        try:
            while True:
                action = self._select(node)
                node.pending[action] += 1
                path.append((node, action))
                child = self._child(node, action)  # may step the env, which may raise
                if child.terminal is not None or child.priors is None:
                    return path, child
                node = child
        except BaseException:
            self._undo(path)
            raise

    @staticmethod
    def _backup(path: list[tuple[Node, int]], value: float, turn: int) -> None:
        """Count a walk's ``value``, for the player ``turn``, on each edge: for the player to move at its node.

        (Not by alternating signs: in some games a player moves twice in a row.)
        """
        for node, action in path:
            node.pending[action] -= 1
            node.visits[action] += 1
            node.win_count[action] += value if node.turn == turn else -value

    @staticmethod
    def _undo(path: list[tuple[Node, int]]) -> None:
        for node, action in path:
            node.pending[action] -= 1

    def _priors(self, logits: list[float], legal: list[bool]) -> list[float]:
        """The softmax of ``logits`` over the legal moves (0 for the others), over a few Python floats."""
        if len(logits) != len(legal):
            raise SearchError(
                f"{self.prior_key!r} must hold one logit per action ({len(legal)}), got shape {(len(logits),)}"
            )
        allowed = [x for x, ok in zip(logits, legal) if ok]
        top = max(allowed, default=-math.inf)
        if top == -math.inf or not all(-math.inf <= x < math.inf for x in allowed):  # (nan compares False)
            raise SearchError(f"the policy's {self.prior_key!r} give no distribution over the legal moves: {logits}")
        exps = [math.exp(x - top) if ok else 0.0 for x, ok in zip(logits, legal)]
        total = sum(exps)
        return [e / total for e in exps]

    def _request(self, leaves: list[Node]) -> TensorDictBase:
        if len(leaves) == 1 and self.leaves_per_request == 1:
            return leaves[0].state.select(*self.observation_keys)
        return torch.stack([leaf.state.select(*self.observation_keys) for leaf in leaves])

    def _read(self, out: TensorDictBase, rows: int) -> tuple[list[list[float]], list[float]]:
        for key in (self.prior_key, self.value_key):
            if key not in out.keys(True):
                raise SearchError(f"the policy's output has no {key!r} (it has {sorted(map(str, out.keys(True)))})")
        logits, value = out[self.prior_key], out[self.value_key]
        if value.numel() != rows:
            raise SearchError(
                f"{self.value_key!r} must hold one value per leaf ({rows}), got shape {tuple(value.shape)}"
            )
        values = value.reshape(-1).tolist()
        if not all(math.isfinite(v) for v in values):
            raise SearchError(f"{self.value_key!r} must be finite, got {values}")
        return logits.reshape(rows, -1).tolist(), values

    def _walker(self, tree: Tree, run: _Run) -> Walker:
        """Claim simulations and walk them, ``leaves_per_request`` leaves a request, until none are left."""
        while True:
            walks: list[tuple[list[tuple[Node, int]], Node]] = []
            try:
                with tree.lock:
                    count = run.claim(self.leaves_per_request)
                    if not count:
                        return
                    for _ in range(count):
                        path, leaf = self._descend(tree.root)
                        if leaf.terminal is not None:
                            self._backup(path, leaf.terminal, leaf.turn)
                        else:
                            walks.append((path, leaf))
                if not walks:
                    continue
                out = yield self._request([leaf for _, leaf in walks])
                logits, values = self._read(out, len(walks))
                priors = [self._priors(row, leaf.legal) for (_, leaf), row in zip(walks, logits)]
            except BaseException:  # an env step or the evaluation failed: no walk stays in flight
                with tree.lock:
                    for path, _ in walks:
                        self._undo(path)
                raise
            with tree.lock:
                for (path, leaf), leaf_priors, value in zip(walks, priors, values):
                    if leaf.priors is None:  # another walk may have expanded it meanwhile
                        leaf.priors = leaf_priors
                    self._backup(path, value, leaf.turn)

    # -- running searches -----------------------------------------------------------------------

    def run(self, tree: Tree, simulations: int, *, noise: bool = False, temperature: float = 1.0) -> TensorDict:
        """Run ``simulations`` walks on ``tree`` with ``searchers`` threads; the root's result.

        Args:
            tree: from :meth:`tree` or :meth:`advance`.
            simulations: walks to add; the root gains exactly this many visits.

        Keyword Args:
            noise: mix Dirichlet noise into the root's priors for this run
                (self-play exploration).
            temperature: of the policy target and the sampled action: visit
                counts to the power ``1/temperature``; 0 takes the most visited.

        Returns:
            A TensorDict with ``visits`` (per action), ``policy`` (the improved
            policy target), ``value`` (the root's value for the player to
            move, shape ``[1]``) and ``action`` (sampled from ``policy``).

        Raises:
            SearchError: a leaf evaluation failed (the server closed, the
                policy raised, or returned a value or logits that are not
                finite) or an env step did (chained as ``__cause__``),
                or a step led to a state with no legal move that is not done.
                The search stopped, every walk in flight finished, and the
                tree holds the walks that completed, none left in flight.
        """
        request = self._check(tree, simulations, temperature)
        with torch.no_grad():
            try:
                out = None if request is None else self.policy(request)
            except Exception as err:
                raise SearchError(f"the root's evaluation failed: {err!r}") from err
        priors = self._begin(tree, out, noise)
        run = _Run(simulations)
        helpers = []
        try:
            helpers = [self._executor().submit(self._drive, tree, run) for _ in range(self.searchers - 1)]
            self._drive(tree, run)
        except BaseException as err:  # a KeyboardInterrupt while the helpers walk: they stop claiming too
            run.fail(err)
            raise
        finally:
            wait(helpers)
            tree.root.priors = priors
        return self._result(tree, run, temperature)

    async def arun(self, tree: Tree, simulations: int, *, noise: bool = False, temperature: float = 1.0) -> TensorDict:
        """:meth:`run` with ``searchers`` asyncio tasks on the running loop, awaiting ``policy.acall``."""
        acall = getattr(self.policy, "acall", None)
        if acall is None:
            raise TypeError(f"arun needs a policy with acall (a RemotePolicy); got {type(self.policy).__name__}")
        request = self._check(tree, simulations, temperature)
        try:
            out = None if request is None else await acall(request)
        except Exception as err:
            raise SearchError(f"the root's evaluation failed: {err!r}") from err
        priors = self._begin(tree, out, noise)
        run = _Run(simulations)

        async def searcher() -> None:
            walker = self._walker(tree, run)
            try:
                request = _resume(walker)
                while True:
                    try:
                        result = await acall(request)
                    except BaseException as err:
                        request = _resume(walker, error=err)
                    else:
                        request = _resume(walker, result)
            except StopIteration:
                pass
            except asyncio.CancelledError:
                raise
            except BaseException as err:
                run.fail(err)

        try:
            await asyncio.gather(*(searcher() for _ in range(self.searchers)))
        finally:
            tree.root.priors = priors
        return self._result(tree, run, temperature)

    def _check(self, tree: Tree, simulations: int, temperature: float) -> TensorDictBase | None:
        """Refuse a run that cannot be searched; the root's request when it is not expanded yet."""
        _check_tree(tree)
        check_int("simulations", simulations, 1)
        check_number("temperature", temperature)
        root = tree.root
        if root.terminal is not None or not any(root.legal):
            raise ValueError("the root is a finished game: there is nothing to search")
        return root.state.select(*self.observation_keys) if root.priors is None else None

    def _begin(self, tree: Tree, out: TensorDictBase | None, noise: bool) -> list[float]:
        """Expand the root from ``out`` (its evaluation, if it needed one) and add the noise; its own priors."""
        root = tree.root
        if out is not None:
            logits, _ = self._read(out, 1)
            root.priors = self._priors(logits[0], root.legal)
        priors = root.priors
        assert priors is not None
        if noise:
            gammas = [self.rng.gammavariate(self.dirichlet_alpha, 1.0) if legal else 0.0 for legal in root.legal]
            if not any(gammas):  # every draw underflowed (alpha ~0.001): the noise is all on one move
                gammas[self.rng.choice([a for a, legal in enumerate(root.legal) if legal])] = 1.0
            eps, total = self.dirichlet_eps, sum(gammas)
            root.priors = [(1 - eps) * p + eps * g / total for p, g in zip(priors, gammas)]
        return priors

    def _drive(self, tree: Tree, run: _Run) -> None:
        """Walk in this thread until no simulation is left, without grad (grad mode is the thread's)."""
        walker = self._walker(tree, run)
        try:
            with torch.no_grad():
                request = next(walker)
                while True:
                    try:
                        result = self.policy(request)
                    except BaseException as err:
                        request = walker.throw(err)
                    else:
                        request = walker.send(result)
        except StopIteration:
            pass
        except BaseException as err:
            run.fail(err)

    def _result(self, tree: Tree, run: _Run, temperature: float) -> TensorDict:
        if run.error is not None:
            error = run.error
            if isinstance(error, SearchError) or not isinstance(error, Exception):
                raise error  # a KeyboardInterrupt stays one
            raise SearchError(f"the search stopped: {error!r}") from error
        root = tree.root
        visits = torch.tensor(root.visits, dtype=torch.float64)
        if temperature == 0:
            target = torch.zeros_like(visits)
            target[int(visits.argmax())] = 1.0
        else:
            weights = (visits / visits.max()) ** (1.0 / temperature)  # near 0: the most visited, never inf
            target = weights / weights.sum()
        action = self.rng.choices(range(len(target)), weights=target.tolist())[0]
        return TensorDict(
            visits=visits.long(),
            policy=target.float(),
            value=torch.tensor([sum(root.win_count) / max(1.0, sum(root.visits))]),
            action=torch.tensor(action),
        )

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.searchers - 1, thread_name_prefix="mcts-searcher")
        return self._pool

    # -- lifecycle --------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the searcher threads (idempotent). The trees stay usable by another search."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> TreeSearch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
