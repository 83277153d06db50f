"""Collection rules for the whole suite (tests/ and the package's doctests)."""

import importlib.util

# torchrl_batchserve.ray imports Ray, an optional extra ([ray]; make test installs it).
collect_ignore = [] if importlib.util.find_spec("ray") else ["torchrl_batchserve/ray.py"]


def pytest_collection_modifyitems(items):
    """Tests that start a Ray cluster in the test process (``ray_cluster``) run last, in their order.

    Ray's test cluster leaves ``atexit`` handlers that hold its gRPC clients: on Python 3.13 a child
    that ``multiprocessing`` forks later releases them and crashes (the fork tests would fail).
    """
    items.sort(key=lambda item: item.get_closest_marker("ray_cluster") is not None)
