"""How requests reach the server's queue and results reach their callers.

An endpoint turns a caller's TensorDict into a validated
:class:`~torchrl_batchserve.request.Request`, enqueues it and hands back the
result in the caller's style (blocking, Future, asyncio). Transports differ
only in how the request crosses to the queue; the serve loop is the same.
"""

from torchrl_batchserve.transport.local import LocalEndpoint

__all__ = ["LocalEndpoint"]
