"""Variable-length benchmark: padding, buckets and packing vs TorchRL's server.

64 actor threads each send sequences whose lengths are drawn uniformly from
1 to 128 (16 features per token). The policy embeds every token with a small
MLP and pools the sequence into 8 logits, so its cost grows with the tokens
it computes, real or padding. Systems, in one process run, same inputs:

* ``ours-pad``: ``PadCollate(["tokens"])``, padded to each batch's longest;
* ``ours-buckets``: ``PadCollate(["tokens"], buckets=[16, 32, 64, 128])``;
* ``ours-pack``: ``PackCollate(["tokens"])``, no padding at all;
* ``torchrl-pad``: TorchRL 0.14.1's ``InferenceServer`` (ThreadingTransport)
  with a ``collate_fn`` that pads the requests' TensorDicts the same way
  (its default ``lazy_stack`` cannot feed ragged tokens to a tensor policy).

``tokens computed / real`` is the padding overhead of each strategy.

    python benchmarks/varlen.py            # writes docs/benchmarks_varlen.md
    python benchmarks/varlen.py --quick    # seconds; a smoke test
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from run import (
    ONE_INTRAOP_THREAD,
    _pct,
    common_parser,
    drive_threads,
    parse_common,
    provenance,
    restart_with,
    save_report,
)
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.modules.inference_server import InferenceServer, ThreadingTransport

from torchrl_batchserve import BatchedPolicyServer, PackCollate, PadCollate

FEATURES, MAX_LEN, BUCKETS = 16, 128, [16, 32, 64, 128]


class Tally:
    """A count that the server's copy of the policy shares with the original (deepcopy returns it)."""

    def __init__(self) -> None:
        self.value = 0

    def __deepcopy__(self, memo: dict) -> Tally:
        return self


class TokenPool(nn.Module):
    """Per-token MLP, mean-pooled per sequence, then a linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.token = nn.Sequential(nn.Linear(FEATURES, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.head = nn.Linear(64, 8)
        self.computed = Tally()  # tokens through the MLP, padding included

    def padded(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        self.computed.value += tokens.shape[0] * tokens.shape[1]
        h = self.token(tokens) * mask.unsqueeze(-1)
        return self.head(h.sum(1) / mask.sum(1, keepdim=True))

    def packed(self, tokens: torch.Tensor, segment_ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        self.computed.value += tokens.shape[0]
        h = self.token(tokens)
        sums = h.new_zeros(len(offsets) - 1, h.shape[-1]).index_add_(0, segment_ids, h)
        return self.head(sums / offsets.diff().unsqueeze(-1))


class Method(nn.Module):
    def __init__(self, net: TokenPool, name: str) -> None:
        super().__init__()
        self.net, self.name = net, name

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return getattr(self.net, self.name)(*args)


def pad_requests(tds: list[TensorDictBase]) -> TensorDict:
    """A TorchRL-style collate_fn: pad the requests' tokens and add the mask."""
    tokens = [td["tokens"] for td in tds]
    lengths = torch.tensor([len(t) for t in tokens])
    padded = nn.utils.rnn.pad_sequence(tokens, batch_first=True)
    mask = torch.arange(padded.shape[1]) < lengths.unsqueeze(1)
    return TensorDict(tokens=padded, mask=mask, batch_size=[len(tds)])


def make_inputs(actors: int, per_actor: int, seed: int) -> list[list[TensorDict]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [
            TensorDict(tokens=torch.randn(int(n), FEATURES, generator=g))
            for n in torch.randint(1, MAX_LEN + 1, (per_actor,), generator=g)
        ]
        for _ in range(actors)
    ]


def run_system(system: str, inputs: list[list[TensorDict]], args: Any) -> dict:
    net = TokenPool()
    padded = TensorDictModule(Method(net, "padded"), in_keys=["tokens", "mask"], out_keys=["logits"])
    packed = TensorDictModule(Method(net, "packed"), in_keys=["tokens", "segment_ids", "offsets"], out_keys=["logits"])
    cursor = [0] * len(inputs)

    def make(g: torch.Generator) -> int:
        return g.initial_seed()  # drive_threads seeds actor i's generator with i

    def caller(call: Any) -> Any:
        def one(i: int) -> Any:
            td = inputs[i][cursor[i] % len(inputs[i])]
            cursor[i] += 1
            return call(td.clone(False))

        return one

    kw = {"max_batch_size": args.max_batch_size, "timeout": args.timeout}
    mean_batch = 0.0
    if system.startswith("ours"):
        policy, collate = {
            "ours-pad": (padded, PadCollate(["tokens"])),
            "ours-buckets": (padded, PadCollate(["tokens"], buckets=BUCKETS)),
            "ours-pack": (packed, PackCollate(["tokens"])),
        }[system]
        with BatchedPolicyServer(policy, collate=collate, **kw) as server:
            elapsed, lat, cpu = drive_threads(caller(server.remote_policy()), make, len(inputs), len(inputs[0]))
            mean_batch = server.statistics().mean_batch_size
    else:
        with InferenceServer(padded, ThreadingTransport(), collate_fn=pad_requests, **kw) as server:
            elapsed, lat, cpu = drive_threads(caller(server.client()), make, len(inputs), len(inputs[0]))
            mean_batch = float(server.stats().get("avg_batch_size", 0.0))
    n = sum(len(x) for x in inputs)
    real = sum(td["tokens"].shape[0] for x in inputs for td in x)
    return {
        "system": system,
        "rps": n / elapsed,
        "p50_ms": _pct(lat, 0.5),
        "p99_ms": _pct(lat, 0.99),
        "mean_batch": mean_batch,
        "cpu_us": cpu / n * 1e6,
        "overhead": net.computed.value / real,
    }


SYSTEMS = ("ours-pad", "ours-buckets", "ours-pack", "torchrl-pad")


def check_outputs() -> None:
    """Each strategy returns what the policy gives the sequence alone."""
    net = TokenPool()
    policies = {
        "pad": (
            TensorDictModule(Method(net, "padded"), in_keys=["tokens", "mask"], out_keys=["logits"]),
            PadCollate(["tokens"], buckets=BUCKETS),
        ),
        "pack": (
            TensorDictModule(Method(net, "packed"), in_keys=["tokens", "segment_ids", "offsets"], out_keys=["logits"]),
            PackCollate(["tokens"]),
        ),
    }
    tds = make_inputs(1, 16, seed=99)[0]
    for policy, collate in policies.values():
        with BatchedPolicyServer(policy, collate=collate, timeout=0.05) as server:
            futures = [server.submit(td.clone(False)) for td in tds]
            for td, fut in zip(tds, futures):
                with torch.no_grad():
                    alone = net.padded(td["tokens"][None], torch.ones(1, len(td["tokens"]), dtype=torch.bool))[0]
                torch.testing.assert_close(fut.result(10)["logits"], alone, atol=1e-5, rtol=1e-4)


def main(argv: list[str] | None = None) -> dict:
    parser = common_parser(__doc__)
    parser.add_argument("--actors", type=int, default=64)
    args = parse_common(parser, argv)
    torch.set_num_threads(1)
    check_outputs()
    per_actor = 4 if args.quick else 40
    runs: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    for repeat in range(args.repeats):
        inputs = make_inputs(args.actors, per_actor, seed=repeat)
        for system in SYSTEMS:
            r = run_system(system, inputs, args)
            runs[system].append(r)
            print(
                f"[{repeat}] {system:13s} {r['rps']:8.0f} req/s p50 {r['p50_ms']:7.2f} p99 {r['p99_ms']:7.2f} ms "
                f"batch {r['mean_batch']:5.1f} tokens computed/real {r['overhead']:.2f}",
                flush=True,
            )
    rows = []
    for system in SYSTEMS:
        rs = runs[system]
        ratio = statistics.median(r["rps"] / t["rps"] for r, t in zip(rs, runs["torchrl-pad"]))
        rows.append(
            {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "system"}
            | {"system": system, "vs_torchrl": ratio}
        )
    write_report(rows, args)
    return {"rows": rows}


def write_report(rows: list[dict], args: Any) -> None:
    lines = [
        "# Variable-length benchmark",
        "",
        provenance("varlen.py", args),
        "",
        f"{args.actors} actor threads; sequence lengths uniform in 1..{MAX_LEN}, {FEATURES} features per token; "
        f"max_batch_size={args.max_batch_size}, timeout={args.timeout}; median of {args.repeats} repeat(s). "
        "Policy: per-token MLP (16→64→64), mean-pooled, linear head. Ratios are to TorchRL 0.14.1's "
        "InferenceServer with a padding `collate_fn`, measured in the same run. One intra-op thread in every "
        "thread (`OMP_NUM_THREADS=1`).",
        "",
        "| system | req/s | × TorchRL | p50 ms | p99 ms | mean batch | CPU µs/req | tokens computed / real |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['system']} | {r['rps']:.0f} | {r['vs_torchrl']:.2f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
            f"{r['mean_batch']:.1f} | {r['cpu_us']:.0f} | {r['overhead']:.2f} |"
        )
    save_report(lines, args, "benchmarks_varlen", "varlen.py")


if __name__ == "__main__":
    restart_with(ONE_INTRAOP_THREAD)
    main()
