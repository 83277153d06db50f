"""The README's code runs, every shipped YAML loads, every example runs small."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]


def test_readme_python_blocks_run():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {"__name__": "readme"})


def test_readme_has_exactly_the_two_setup_commands():
    text = (ROOT / "README.md").read_text()
    bash = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    commands = [line.split("#")[0].strip() for block in bash for line in block.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    assert "make test" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("path", sorted((ROOT / "conf").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_composes(path):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name=path.stem)
    assert OmegaConf.to_container(cfg, resolve=True)


def test_actors_demo_smoke():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import actors_demo
    finally:
        sys.path.pop(0)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="actors_demo", overrides=["threads=4", "tasks=8", "requests_per_actor=10"])
    result = actors_demo.run(cfg)
    assert result["mismatches"] == 0 and result["requests"] == 120
    assert result["statistics"].requests == 120


def test_benchmark_quick_smoke(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import run as bench
    finally:
        sys.path.pop(0)
    out = bench.main(["--quick", "--only", "vector", "--out", str(tmp_path)])
    assert (tmp_path / "benchmarks_quick.md").exists()
    row = next(r for r in out["rows"] if r["actors"] == 8 and r["mode"] == "threads")
    assert row["ours"]["rps"] > 0 and row["torchrl"]["rps"] > 0 and row["x_torchrl"] > 0
