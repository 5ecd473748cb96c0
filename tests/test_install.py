"""The Makefile's install and serve commands on a CPU machine and on one where nvidia-smi lists a
GPU (a stand-in nvidia-smi on PATH; `make -n` prints the commands without running them)."""
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _path_with_nvidia_smi(folder: Path, script: str) -> str:
    smi = folder / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n{script}\n")
    smi.chmod(0o755)
    return f"{folder}:{os.environ['PATH']}"


@pytest.fixture
def gpu_path(tmp_path) -> str:
    return _path_with_nvidia_smi(tmp_path, 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1234)"')


@pytest.fixture
def cpu_path(tmp_path) -> str:
    """nvidia-smi as on a machine with the driver and no GPU (and as if absent where it is)."""
    return _path_with_nvidia_smi(tmp_path, 'echo "No devices were found"; exit 6')


def _make(*args: str, path: str) -> list[str]:
    # Not as a sub-make of `make test`: that one's MAKELEVEL / MAKEFLAGS would add its
    # "Entering directory" lines and flags.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")} | {"PATH": path}
    out = subprocess.run(["make", "-n", "-B", "--no-print-directory", *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True)
    return [line for line in out.stdout.splitlines() if not line.startswith("#")]


def test_cpu_install_pins_the_cpu_torch_in_every_install_call(cpu_path):
    lines = _make("install", path=cpu_path)
    installs = [line for line in lines if " install " in line]
    assert '.venv/bin/python -m pip install -q -c constraints.txt "torch==2.13.0+cpu"' in lines
    assert installs and all("-c constraints.txt" in line for line in installs)
    # uv compiles the bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set, nothing else would
    assert any(line.startswith(".venv/bin/uv pip install -q --compile-bytecode") and '-e ".[test]"' in line
               for line in installs)
    assert _make("serve", path=cpu_path)[-1] == ".venv/bin/python -m actors.serve_cli deploy.yaml"


def test_gpu_install_keeps_a_cuda_torch_and_pins_every_later_call_to_it(gpu_path):
    lines = _make("install", path=gpu_path)
    keep, pin = lines[1:3]
    assert keep.startswith('.venv/bin/python -c "import torch, sys; sys.exit(not torch.version.cuda)"')
    assert keep.endswith("|| .venv/bin/python -m pip install -q torch")  # PyPI's default: a CUDA build
    assert pin.endswith("> .venv/torch-pin.txt")
    later = [line for line in lines[3:] if " install " in line]
    assert later and all("-c .venv/torch-pin.txt" in line for line in later)
    assert not any("+cpu" in line or "constraints.txt" in line for line in lines)
    assert _make("serve", path=gpu_path)[-1] == ".venv/bin/python -m actors.serve_cli deploy-gpu.yaml"
