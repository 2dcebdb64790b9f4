"""The built-in demo (README's first command) runs end to end on the CPU."""

import numpy as np
import pytest

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("demo", Path(__file__).parent.parent / "scripts" / "demo.py")
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)


def test_demo_denoises_to_finite_latents_of_the_asked_size():
    result = demo.run_demo(steps=2, size=64)
    assert result["latents"].shape == (1, 16, demo.DEMO_CONFIG.in_channels)
    assert np.isfinite(result["latents"]).all()
    assert set(result["times"]) >= {"compile denoising loop", "denoise (2 steps)"}


def test_demo_rejects_a_size_that_is_not_a_multiple_of_16():
    with pytest.raises(ValueError, match="multiple of 16"):
        demo.run_demo(size=100)
