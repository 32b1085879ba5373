"""A cheap fingerprint of a model's weights: enough to tell whether a refit reached the engine."""

from __future__ import annotations

from collections.abc import Mapping

import torch

SAMPLES_PER_TENSOR = 64


@torch.no_grad()
def weight_fingerprint(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per parameter, about ``SAMPLES_PER_TENSOR`` evenly strided entries, copied to the CPU in their own dtype.

    Reads a few thousand numbers however large the model, so it is cheap to take every step,
    and compares exactly: even an update far below the threshold of a logprob check shows.
    """
    out = {}
    for name, tensor in state_dict.items():
        flat = tensor.detach().reshape(-1)
        stride = max(1, flat.numel() // SAMPLES_PER_TENSOR)
        out[name] = flat[::stride].cpu().clone()
    return out


def fingerprint_mismatches(expected: Mapping[str, torch.Tensor], actual: Mapping[str, torch.Tensor]) -> list[str]:
    """The parameter names whose fingerprints differ (missing on either side counts), sorted.

    ``expected`` is cast to ``actual``'s dtype first, as a refit casts the trainer's weights
    into the engine's, so a float32 trainer and a bfloat16 engine compare exactly.
    """
    names = set(expected) | set(actual)
    return sorted(
        name
        for name in names
        if name not in expected
        or name not in actual
        or not torch.equal(expected[name].to(actual[name].dtype), actual[name])
    )
