"""``python benchmarks/ray.py``: actors on other nodes, ours vs TorchRL's RayTransport vs Ray Serve.

The benchmark is :mod:`ray_cluster` (see its docstring); this file only runs it.

A script of this folder runs with the folder first on ``sys.path``, where this
file would stand for Ray itself (TorchRL imports ``ray``). Imported under that
name, it puts the real Ray in its place and defines nothing.
"""

import os
import sys

if __name__ == "ray":
    import importlib

    _here = os.path.dirname(os.path.abspath(__file__))
    _path = sys.path[:]
    del sys.modules["ray"]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    try:
        importlib.import_module("ray")  # the import that found this file returns what sys.modules holds now
    finally:
        sys.path[:] = _path
elif __name__ == "__main__":
    import ray_cluster

    ray_cluster.run_in_loopback_namespace()
    ray_cluster.main()
