from __future__ import annotations

import contextlib
import copy
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule, TensorDictModuleBase

ROOT = Path(__file__).resolve().parents[1]


def load_script(folder: str, name: str):
    """Import a script of ``examples/`` or ``benchmarks/`` (its folder stays on the path: spawned workers import it)."""
    path = str(ROOT / folder)
    if path not in sys.path:
        sys.path.append(path)
    return __import__(name)


def obs(*batch, n: int = 8) -> TensorDict:
    """A request of ``batch`` rows of ``n`` features (a fresh TensorDict, as an env step makes)."""
    return TensorDict(observation=torch.randn(*batch, n), batch_size=list(batch))


def make_mlp(obs: int = 8, act: int = 3, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(obs, 32), torch.nn.Tanh(), torch.nn.Linear(32, act))


def wait_for(condition, what: str, timeout: float = 20.0) -> None:
    """Wait for a state another thread or process changes where no event signals it (a queue's length, a hub's clients)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@contextlib.contextmanager
def no_thread_named(name: str):
    """Inside the block, starting a thread called ``name`` raises, as under a container's process limit."""
    start = threading.Thread.start

    def refuse(thread):
        if thread.name == name:
            raise RuntimeError("can't start new thread")
        start(thread)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(threading.Thread, "start", refuse)
        yield


@pytest.fixture
def net():
    return make_mlp()


@pytest.fixture
def policy(net):
    return TensorDictModule(net, in_keys=["observation"], out_keys=["logits"])


class BigOutputs(torch.nn.Module):
    """A row of 2**23 floats (32 MB) a request: a reply that no socket buffer holds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., :1] + torch.zeros(x.shape[0], 1 << 23)


class GatedPolicy(TensorDictModuleBase):
    """A policy whose forwards block until the test opens the gate.

    ``entered`` is set when a forward starts, so a test knows the serve loop is
    busy (and everything it submits next stays queued) without sleeping.
    Records the rows of every batch it sees.
    """

    def __init__(self, net: torch.nn.Module, block_first: int = 1):
        super().__init__()
        self.in_keys = ["observation"]
        self.out_keys = ["logits"]
        self.net = net
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.batches: list[int] = []
        self._block_first = block_first

    def __deepcopy__(self, memo):
        # The server serves a copy: it gets its own weights but shares the gate and the record.
        clone = type(self)(copy.deepcopy(self.net, memo), self._block_first)
        clone.gate, clone.entered, clone.batches = self.gate, self.entered, self.batches
        return clone

    def forward(self, td: TensorDictBase) -> TensorDictBase:
        self.batches.append(td.batch_size[0])
        if len(self.batches) <= self._block_first:
            self.entered.set()
            # 90 s: a test may wait this long for a spawned child, which can take a minute to start on a busy host
            assert self.gate.wait(90), "test never opened the gate"
        td.set("logits", self.net(td.get("observation")))
        return td
