"""A cheap fingerprint of a model's weights: enough to tell whether a refit reached the engine."""

from __future__ import annotations

from collections.abc import Mapping

import torch

SAMPLES_PER_TENSOR = 64


@torch.no_grad()
def weight_fingerprint(state_dict: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter, the float64 sum of about ``SAMPLES_PER_TENSOR`` evenly strided entries.

    Reads a few thousand numbers however large the model, so it is cheap to take every
    step; one optimizer step moves the sums of every trained tensor far beyond float noise.
    """
    out = {}
    for name, tensor in state_dict.items():
        flat = tensor.detach().reshape(-1)
        stride = max(1, flat.numel() // SAMPLES_PER_TENSOR)
        out[name] = float(flat[::stride].double().sum())
    return out


def fingerprint_mismatches(
    expected: Mapping[str, float], actual: Mapping[str, float], *, rtol: float = 1e-6
) -> list[str]:
    """The parameter names whose fingerprints differ (missing on either side counts), sorted."""
    names = set(expected) | set(actual)
    return sorted(
        name
        for name in names
        if name not in expected
        or name not in actual
        or abs(expected[name] - actual[name]) > rtol * max(1.0, abs(expected[name]))
    )
