"""Tensor and data parallelism on 8 fake CPU devices, run in a subprocess: XLA_FLAGS must be set
before JAX starts its backend, and the rest of the suite runs on one device."""

import os
import subprocess
import sys

import pytest

from sfjax import LLM

HERE = os.path.dirname(os.path.abspath(__file__))


def test_on_eight_fake_devices():
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=flags.strip(), SFJAX_MULTIDEVICE="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          os.path.join(HERE, "multidevice")], env=env, capture_output=True,
                         text=True, cwd=os.path.dirname(HERE))
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]


def test_a_mesh_larger_than_the_devices_is_refused(tiny_folder):
    with pytest.raises(ValueError, match="tensor_parallel_size 2 x data_parallel_size 2 = 4 devices"):
        LLM(tiny_folder, tensor_parallel_size=2, data_parallel_size=2)
