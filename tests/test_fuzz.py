"""Fuzzed requests on every path (#21): a bad one fails only its caller, with a typed error; odd valid ones are served."""

from __future__ import annotations

import asyncio
import pickle

import pytest
import torch
from conftest import make_mlp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import LazyStackedTensorDict, TensorDict
from tensordict.nn import TensorDictModule

from torchrl_batchserve import BadRequestError, BatchedPolicyServer

FEATURES = 8
GOOD = [
    "rows",
    "single",
    "non_contiguous",
    "expanded",
    "lazy_stack",
    "nan",
    "more_than_a_batch",
    "extra_key",
    "multi_dim",
    "requires_grad",
]
BAD = [
    "not_a_tensordict",
    "dtype",
    "feature_shape",
    "missing_key",
    "zero_rows",
    "sparse",
    "nested_tensor",
    "non_tensor",
    "locked",
    "meta_device",
]


def make_request(kind: str, rows: int) -> object:
    x = torch.randn(rows, FEATURES)
    if kind == "rows":
        return TensorDict(observation=x, batch_size=[rows])
    if kind == "single":
        return TensorDict(observation=x[0])
    if kind == "non_contiguous":
        return TensorDict(observation=torch.randn(FEATURES, rows).t(), batch_size=[rows])
    if kind == "expanded":
        return TensorDict(observation=x[:1].expand(rows, FEATURES), batch_size=[rows])
    if kind == "lazy_stack":
        return LazyStackedTensorDict(*[TensorDict(observation=row) for row in x], stack_dim=0)
    if kind == "nan":
        x[0, 0] = float("nan")
        return TensorDict(observation=x, batch_size=[rows])
    if kind == "more_than_a_batch":
        return TensorDict(observation=torch.randn(9, FEATURES), batch_size=[9])
    if kind == "extra_key":
        return TensorDict(observation=x, other=torch.zeros(rows, 2), batch_size=[rows])
    if kind == "multi_dim":
        return TensorDict(observation=torch.randn(2, rows, FEATURES), batch_size=[2, rows])
    if kind == "requires_grad":
        return TensorDict(observation=x * torch.ones(FEATURES, requires_grad=True), batch_size=[rows])
    if kind == "not_a_tensordict":
        return {"observation": x}
    if kind == "dtype":
        return TensorDict(observation=x.double(), batch_size=[rows])
    if kind == "feature_shape":
        return TensorDict(observation=torch.randn(rows, FEATURES + 1), batch_size=[rows])
    if kind == "missing_key":
        return TensorDict(obs=x, batch_size=[rows])
    if kind == "zero_rows":
        return TensorDict(observation=torch.randn(0, FEATURES), batch_size=[0])
    if kind == "sparse":
        return TensorDict(observation=x[0].to_sparse())
    if kind == "nested_tensor":
        return TensorDict(observation=torch.nested.nested_tensor([x[0]]), batch_size=[])
    if kind == "non_tensor":
        return TensorDict(observation="eight floats")
    if kind == "locked":
        return TensorDict(observation=x, batch_size=[rows]).lock_()
    if kind == "meta_device":
        return TensorDict(observation=x.to("meta"), batch_size=[rows])
    raise ValueError(kind)


def serve(path: str, remote, client, td):
    if path == "call":
        return remote(td) if isinstance(td, TensorDict) or not isinstance(td, dict) else remote.forward(td)
    if path == "submit":
        return remote.submit(td).result(30)
    if path == "acall":
        return asyncio.run(remote.acall(td))
    return client(td) if not isinstance(td, dict) else client._endpoint.call(td)


@pytest.mark.timeout(300)
def test_fuzzed_requests_on_every_path():
    net = make_mlp(FEATURES, 3)
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])
    with BatchedPolicyServer(policy, max_batch_size=4, timeout=0.001) as server:
        remote = server.remote_policy()
        client = pickle.loads(pickle.dumps(remote))  # the worker-process path, in this process
        remote(TensorDict(observation=torch.zeros(FEATURES)))  # the layout

        @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
        @given(
            kind=st.sampled_from(GOOD + BAD),
            rows=st.integers(1, 5),
            path=st.sampled_from(["call", "submit", "acall", "process"]),
        )
        def check(kind, rows, path):
            td = make_request(kind, rows)
            if kind in BAD:
                with pytest.raises(BadRequestError):
                    serve(path, remote, client, td)
            else:
                out = serve(path, remote, client, td)
                with torch.no_grad():
                    want = net(out["observation"].contiguous())
                torch.testing.assert_close(out["logits"], want, equal_nan=True)
                assert out["logits"].shape == (*out.batch_size, 3)
            # the server serves on, on every path, after whatever came before
            good = TensorDict(observation=torch.ones(FEATURES))
            torch.testing.assert_close(serve(path, remote, client, good)["logits"], net(torch.ones(FEATURES)))

        check()
        stats = server.statistics()
    assert stats.failed_batches == 0
