"""Collection rules for the whole suite (tests/ and the package's doctests)."""

import importlib.util

# torchrl_batchserve.ray imports Ray, an optional extra ([ray]; make test installs it).
collect_ignore = [] if importlib.util.find_spec("ray") else ["torchrl_batchserve/ray.py"]
