"""How requests reach the server's intake and results reach their callers.

An endpoint turns a caller's TensorDict into a validated
:class:`~torchrl_batchserve.request.Request` through the server's
:class:`~torchrl_batchserve.intake.Intake` and hands back the result in the
caller's style (blocking, Future, asyncio). Transports differ only in how the
request crosses to the intake and how its completion crosses back; the serve
loop is the same.
"""

from torchrl_batchserve.transport.local import LocalEndpoint

__all__ = ["LocalEndpoint"]
