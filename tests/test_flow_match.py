"""The flow-matching Euler schedule equals diffusers' FlowMatchEulerDiscreteScheduler with Krea 2's settings."""

import json

import numpy as np
import pytest

from conftest import FIXTURES
from mxdit.model.flow_match import KREA2_TURBO_MU, calculate_shift, euler_step, flow_match_schedule

REF = FIXTURES / "scheduler"
CASES = [tuple(c) for c in json.loads((REF / "scheduler_cases.json").read_text())]


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(REF / "scheduler_reference.npz"))


@pytest.mark.parametrize("steps,seq_len,distilled", CASES)
def test_sigmas_and_timesteps_match_diffusers(reference, steps, seq_len, distilled):
    tag = f"{steps}_{seq_len}_{int(distilled)}"
    kwargs = {"mu": KREA2_TURBO_MU} if distilled else {"image_seq_len": seq_len}
    sigmas, timesteps = flow_match_schedule(steps, **kwargs)
    assert sigmas.shape == (steps + 1,) and timesteps.shape == (steps,)
    np.testing.assert_allclose(sigmas, reference[f"sigmas_{tag}"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(timesteps, reference[f"timesteps_{tag}"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("steps,seq_len,distilled", CASES)
def test_euler_step_matches_diffusers(reference, steps, seq_len, distilled):
    tag = f"{steps}_{seq_len}_{int(distilled)}"
    sigmas, _ = flow_match_schedule(steps, **({"mu": KREA2_TURBO_MU} if distilled else {"image_seq_len": seq_len}))
    out = euler_step(reference[f"euler_in_{tag}"], reference[f"euler_v_{tag}"], sigmas[0], sigmas[1])
    np.testing.assert_allclose(np.asarray(out), reference[f"euler_out_{tag}"], rtol=1e-6, atol=1e-6)


def test_shift_grows_with_resolution_between_base_and_max():
    assert calculate_shift(256) == pytest.approx(0.5)
    assert calculate_shift(6400) == pytest.approx(1.15)
    assert calculate_shift(256) < calculate_shift(4096) < calculate_shift(6400)


def test_schedule_needs_exactly_one_of_mu_or_resolution():
    with pytest.raises(ValueError, match="exactly one"):
        flow_match_schedule(8)
    with pytest.raises(ValueError, match="exactly one"):
        flow_match_schedule(8, mu=1.15, image_seq_len=4096)
    with pytest.raises(ValueError, match=">= 1"):
        flow_match_schedule(0, mu=1.15)

