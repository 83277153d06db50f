"""Tree-parallel MCTS on Connect Four: what several searchers per tree buy, and what they cost.

Two measurements in one run, both with ``torchrl_batchserve.mcts.TreeSearch``
and the policy/value network of ``examples/mcts_selfplay.py``, served by one
``BatchedPolicyServer`` (no cache, so every leaf is computed):

* **throughput**: self-play moves (64 simulations each, root noise) with 1
  game and with 16 games at once, each searched by 1, 4, 16 or 64 walks of
  its tree (virtual loss 1): leaf evaluations/s and the server's mean batch.
  Twice: with the example's small network as it is (its forward costs a few
  µs a row on CPU, so the walks' own Python bounds everything), and with a
  forward that costs a fixed ``--forward-ms`` per batch whatever its rows (a
  sleep after the real forward: the shape of a large network on a GPU,
  where one row costs about what 64 do);
* **strength**: the net-guided search with 1, 4 or 16 searchers and virtual
  loss 0, 1 or 3 against plain MCTS (one searcher, uniform priors, random
  rollouts) at the same simulations per move, colours alternating.

``--weights`` loads a trained network (``make demo`` saves one as
``outputs/mcts_selfplay/<run>/connect4_server_threads.pt``; the newest is the
default when there is one); without one the strength games use the untrained
network.

    python benchmarks/mcts.py            # writes docs/benchmarks_mcts.md and docs/benchmarks_mcts.png
    python benchmarks/mcts.py --quick    # seconds; a smoke test
    python benchmarks/mcts.py --curves A.json B.json   # learning curves of example runs -> docs/mcts_learning.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from run import provenance

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import mcts_selfplay as example  # noqa: E402

from torchrl_batchserve import BatchedPolicyServer  # noqa: E402
from torchrl_batchserve.mcts import TreeSearch  # noqa: E402

DEFAULT_WEIGHTS = max((ROOT / "outputs" / "mcts_selfplay").glob("*/connect4_server_threads.pt"), default=None)


class FixedCost(torch.nn.Module):
    """The network, then a sleep to ``ms`` per forward: a batch costs the same whatever its rows."""

    def __init__(self, net: torch.nn.Module, ms: float) -> None:
        super().__init__()
        self.net, self.ms = net, ms

    def forward(self, board: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start = time.perf_counter()
        out = self.net(board)
        time.sleep(max(0.0, self.ms / 1000 - (time.perf_counter() - start)))
        return out


def make_policy(weights: Path | None, forward_ms: float = 0.0) -> Any:
    env = example.ConnectFourEnv()
    policy = example.make_policy(env, seed=0)
    if weights is not None:
        policy.module.load_state_dict(torch.load(weights))
    if forward_ms:
        policy.module = FixedCost(policy.module, forward_ms)
    return policy


def searcher(env: Any, policy: Any, searchers: int, virtual_loss: float, seed: int) -> TreeSearch:
    return TreeSearch(
        env,
        policy,
        searchers=searchers,
        virtual_loss=virtual_loss,
        state_keys=list(example.STATE_KEYS),
        seed=seed,
    )


def throughput(
    games: int,
    searchers: int,
    seconds: float,
    simulations: int,
    weights: Path | None,
    forward_ms: float,
    tasks: bool = False,
) -> dict:
    """Self-play moves for ``seconds``: ``games`` game threads, ``searchers`` walks per tree.

    ``tasks``: the walks are asyncio tasks (``arun``, an event loop per game thread), not threads (``run``).
    """
    env = example.ConnectFourEnv()
    rows = example.Counter()
    with BatchedPolicyServer(make_policy(weights, forward_ms), max_batch_size=1024, timeout=0.002) as server:
        remote = server.remote_policy()
        deadline = time.perf_counter() + seconds
        moves = example.Counter()

        def play(i: int) -> None:
            evaluator = example.Evaluator(remote, rows)
            with torch.no_grad(), searcher(env, evaluator, searchers, 1.0, seed=i) as search:
                while time.perf_counter() < deadline:
                    tree = search.tree(env.reset())
                    while tree.root.terminal is None and time.perf_counter() < deadline:
                        if tasks:
                            out = asyncio.run(search.arun(tree, simulations, noise=True))
                        else:
                            out = search.run(tree, simulations, noise=True)
                        moves.add()
                        tree = search.advance(tree, int(out["action"]))

        start = time.perf_counter()
        threads = [threading.Thread(target=play, args=(i,)) for i in range(games)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
        stats = server.statistics()
    return {
        "forward_ms": forward_ms,
        "games": games,
        "searchers": searchers,
        "evaluations_per_s": rows.value / elapsed,
        "moves_per_s": moves.value / elapsed,
        "mean_batch": stats.mean_batch_size,
    }


def strength(searchers: int, virtual_loss: float, games: int, simulations: int, weights: Path | None) -> dict:
    """The net-guided search (``searchers`` walks per tree) against plain MCTS, one game at a time."""
    env = example.ConnectFourEnv()
    score = 0.0
    with BatchedPolicyServer(make_policy(weights), max_batch_size=max(1, searchers), timeout=0.005) as server:
        remote = server.remote_policy()
        for g in range(games):
            rng = random.Random(1000 + g)
            net_turn = g % 2
            with (
                torch.no_grad(),
                searcher(env, remote, searchers, virtual_loss, seed=g) as net,
                searcher(env, example.rollout_policy(env, rng), 1, 0.0, seed=g) as plain,
            ):
                game = net.tree(env.reset())
                while game.root.terminal is None:
                    turn = int(game.root.state["turn"])
                    search = net if turn == net_turn else plain
                    action = int(search.run(search.tree(game.root.state), simulations, temperature=0)["action"])
                    game = net.advance(game, action)
                    game.root.children.clear()
            score += 0.5 if game.root.terminal == 0 else float(turn == net_turn)
    return {"searchers": searchers, "virtual_loss": virtual_loss, "games": games, "score": score / games}


def plot(grid: list[dict], matches: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for (cost, games), style in zip(sorted({(r["forward_ms"], r["games"]) for r in grid}), ("-", "--", "-", "--")):
        rows = [r for r in grid if (r["forward_ms"], r["games"]) == (cost, games)]
        xs = [r["searchers"] for r in rows]
        forward = f"{cost:g} ms forward" if cost else "small net"
        label = f"{games} game{'s' if games > 1 else ''}, {forward}"
        color = "tab:orange" if cost else "tab:blue"
        axes[0].plot(xs, [r["evaluations_per_s"] for r in rows], style, color=color, marker="o", label=label)
        axes[1].plot(xs, [r["mean_batch"] for r in rows], style, color=color, marker="o", label=label)
    for ax, ylabel in ((axes[0], "leaf evaluations / s"), (axes[1], "mean batch rows")):
        ax.set(xscale="log", yscale="log", xlabel="searchers per tree", ylabel=ylabel)
        ax.set_xticks([1, 4, 16, 64], labels=["1", "4", "16", "64"])
        ax.legend(fontsize=8)
    labels = [f"{m['searchers']}s vl={m['virtual_loss']:g}" if m["searchers"] > 1 else "1 searcher" for m in matches]
    axes[2].bar(range(len(matches)), [m["score"] for m in matches], color="tab:green")
    axes[2].set_xticks(range(len(matches)), labels=labels, rotation=30, ha="right")
    axes[2].axhline(0.5, color="grey", lw=0.8, ls="--")
    axes[2].set(ylabel="score vs plain MCTS", ylim=(0, 1), title="equal simulations per move")
    fig.suptitle("Connect Four: tree-parallel search through one server")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_curves(runs: list[Path], path: Path) -> None:
    """Score against plain MCTS over learning time (self-play and training) of ``mcts_selfplay.py`` runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for run in runs:
        result = json.loads(run.read_text())
        rows = result["history"]
        n = result["searchers_per_tree"]
        label = f"{result['games_at_once']} games at once, {n} searcher{'s' if n > 1 else ''} per tree"
        ax.plot([r["seconds"] for r in rows], [r["vs_mcts"] for r in rows], marker="o", label=label)
    ax.axhline(0.5, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="learning time, s (self-play + training)", ylabel="score vs plain MCTS", ylim=(0, 1.02))
    ax.set_title("Connect Four self-play: learning per wall-clock second")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny settings: a smoke test")
    parser.add_argument("--seconds", type=float, default=20.0, help="per throughput setting")
    parser.add_argument("--games", type=int, default=16, help="strength games per setting (0: no strength games)")
    parser.add_argument("--tasks", action="store_true", help="walks as asyncio tasks (arun), not threads (run)")
    parser.add_argument("--simulations", type=int, default=64, help="per move, both measurements")
    parser.add_argument("--forward-ms", type=float, default=5.0, help="the fixed forward cost of the second grid")
    parser.add_argument("--weights", type=Path, default=DEFAULT_WEIGHTS)
    parser.add_argument("--out", type=Path, default=ROOT / "docs", help="where the report and plot go")
    parser.add_argument("--curves", type=Path, nargs="+", help="plot these example results instead, and stop")
    args = parser.parse_args(argv)
    if args.curves:
        plot_curves(args.curves, args.out / "mcts_learning.png")
        return {}
    if args.quick:
        args.seconds, args.games, args.simulations = 0.5, 1, 8
    torch.set_num_threads(1)
    grid = []
    for forward_ms in (0.0, args.forward_ms):
        for games in (1, 16):
            for searchers in (1, 4, 16, 64):
                grid.append(
                    throughput(games, searchers, args.seconds, args.simulations, args.weights, forward_ms, args.tasks)
                )
                print(json.dumps(grid[-1]))
    matches = []
    settings = ((1, 0.0), (4, 0.0), (4, 1.0), (4, 3.0), (16, 0.0), (16, 1.0), (16, 3.0))
    for searchers, vl in settings if args.games else ():
        matches.append(strength(searchers, vl, args.games, args.simulations, args.weights))
        print(json.dumps(matches[-1]))
    stem = "benchmarks_mcts_quick" if args.quick else "benchmarks_mcts"
    args.out.mkdir(parents=True, exist_ok=True)
    plot(grid, matches, args.out / f"{stem}.png")
    weights = args.weights.name if args.weights is not None else "the untrained network"

    def forward(ms: float) -> str:
        return f"{ms:g} ms a batch" if ms else "the small net"

    lines = [
        "# Tree-parallel MCTS: throughput and strength",
        "",
        provenance("mcts.py", args) + f" Weights: {weights}; {args.simulations} simulations per move.",
        "",
        f"## Throughput ({args.seconds:g} s of self-play moves per setting, virtual loss 1, no cache, "
        + ("walks as asyncio tasks, `arun`)" if args.tasks else "walks as threads, `run`)"),
        "",
        "| forward | games at once | searchers per tree | leaf evaluations/s | moves/s | mean batch rows |",
        "|---|---:|---:|---:|---:|---:|",
        *(
            f"| {forward(r['forward_ms'])} | {r['games']} "
            f"| {r['searchers']} | {r['evaluations_per_s']:.0f} | {r['moves_per_s']:.1f} | {r['mean_batch']:.1f} |"
            for r in grid
        ),
        "",
    ]
    if matches:
        lines += [
            f"## Strength against plain MCTS ({args.games} games per setting, colours alternating)",
            "",
            "| searchers per tree | virtual loss | score (wins + ½ draws) |",
            "|---:|---:|---:|",
            *(f"| {m['searchers']} | {m['virtual_loss']:g} | {m['score']:.0%} |" for m in matches),
            "",
        ]
    lines.append(f"![throughput and strength]({stem}.png)")
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return {"throughput": grid, "strength": matches}


if __name__ == "__main__":
    main()
