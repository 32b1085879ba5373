"""oneDNN-packed weights for the engine's linear layers on CPU: the same products, 1.2-5x faster than MKL's sgemm.

A decode step multiplies a few rows by every weight of the model once. Through ``torch.nn.functional.linear``
(MKL's sgemm) that runs at 40 GFLOP/s at 10 rows on this project's 2-core AMD EPYC machines, and the LM head over
SmolLM2's 49,152-token vocabulary takes 22-27 ms where reading its weights once takes ~4 (27 GB/s). oneDNN's
inner-product kernel over a weight reordered once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``
and ``_linear_pointwise``, the pair torch.compile's CPU backend emits) runs a 10-row MLP in half the time and the LM
head in a fifth (``benchmarks/history/2026-11-28-packed-linear.md``). The result differs from MKL's only in float
rounding (the order of a dot product's sums).

:class:`PackedLinears` keeps one packed copy of every ``nn.Linear`` weight of a model and the weight's identity and
in-place version (``Tensor._version``, which ``load_state_dict`` and an optimizer step raise), so a weight changed in
any way is packed again before the next forward that uses it. The layers use the packed copies only inside
:meth:`PackedLinears.using`, on the thread that entered it, with autograd off: a trainer's forward pass on the same
model, on any thread, runs ``nn.Linear`` unchanged.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

_local = threading.local()


@dataclass
class _Packed:
    """One layer's packed weight and the weight it was packed from (its storage address and in-place version)."""

    packed: torch.Tensor
    address: int
    version: int


class PackedLinears:
    """Packed copies of a model's ``nn.Linear`` weights, used by its layers inside :meth:`using`."""

    def __init__(self, layers: dict[torch.nn.Linear, _Packed]) -> None:
        self._layers = layers

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> PackedLinears | None:
        """Pack every float32 CPU ``nn.Linear`` of ``model`` and let its forward use the copy inside :meth:`using`;
        None, changing nothing, where torch has no oneDNN or the model has no such layer."""
        if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
            return None
        modules = [m for m in model.modules() if type(m) is torch.nn.Linear and _packable(m.weight)]
        if not modules:
            return None
        for m in modules:
            m.forward = functools.partial(_forward, m)  # type: ignore[method-assign]  # picklable, unlike a bound method
        return cls({m: _pack(m) for m in modules})

    @property
    def nbytes(self) -> int:
        """Memory the packed copies hold (their elements; oneDNN may pad a little)."""
        return sum(layer.packed.numel() * layer.packed.element_size() for layer in self._layers.values())

    @contextmanager
    def using(self) -> Iterator[None]:
        """The layers use the packed weights on this thread, inside; stale copies are packed again first."""
        self.refresh()
        previous = getattr(_local, "packs", None)
        _local.packs = self
        try:
            yield
        finally:
            _local.packs = previous

    def refresh(self) -> int:
        """Pack again every weight that changed since it was packed (a weight no longer float32 on CPU is dropped:
        its layer runs ``nn.Linear``); return how many changed."""
        stale = [m for m, layer in self._layers.items() if _stamp(m.weight) != (layer.address, layer.version)]
        for m in stale:
            if _packable(m.weight):
                self._layers[m] = _pack(m)
            else:
                del self._layers[m]
        return len(stale)

    def get(self, module: torch.nn.Linear) -> torch.Tensor | None:
        """``module``'s packed weight; None for a layer these copies are not of (a deep copy of the model's)."""
        layer = self._layers.get(module)
        return None if layer is None else layer.packed


def _packable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def _stamp(weight: torch.Tensor) -> tuple[int, int]:
    return weight.data_ptr(), weight._version


def _pack(module: torch.nn.Linear) -> _Packed:
    address, version = _stamp(module.weight)
    return _Packed(torch.ops.mkldnn._reorder_linear_weight(module.weight.detach()), address, version)


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward``, or the packed product on a thread inside :meth:`PackedLinears.using` with autograd off."""
    packs: PackedLinears | None = getattr(_local, "packs", None)
    packed = None if packs is None or torch.is_grad_enabled() or x.dtype != torch.float32 else packs.get(self)
    if packed is None:
        return torch.nn.functional.linear(x, self.weight, self.bias)
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
    return out
