"""Decode with the high-resolution stages run one module at a time, in row bands, with exact statistics.

The tiled decode (``decode.py``) runs the whole tail per tile, so a GroupNorm inside the tail can only
use an estimate of the image's statistics, and every tile pays for its overlap in every stage. Here the
decoder's own ``forward`` runs unchanged and sees whole tensors between its modules, but each tail
*unit* (a residual block, an upsampler, the output convolution) computes its output band by band:

* the unit is local once its GroupNorm statistics are fixed, so a band of output rows needs only a
  band of input rows plus a margin (the unit's receptive field, measured by perturbation);
* the statistics are the whole image's, gathered progressively: pass 0 runs every band up to the
  unit's first GroupNorm and sums that norm's input over the band's own rows; pass 1 runs every band
  through the first norm (now with exact statistics) up to the second, and so on; the last pass
  produces the output. A residual block (two norms, the first on its input) costs one extra
  convolution: its first convolution runs twice.

So the result is the untiled decode up to float rounding (the statistics are summed in float64 from
the same pixels), the device holds the unit's input, its output and one band's temporaries instead of
the unit's whole temporaries, and the recomputed margin is a few rows per band. What it cannot do is go
below two whole tensors of the largest stage; below that, spatial tiles do.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..errors import ConfigError
from .overrides import GroupNormStats, StopDecode, _group_sums, _mean_var, _normalize, find_group_norms, \
    override_forwards

Progress = Callable[[int, int], None]
Interrupt = Callable[[], None]


@dataclass
class LayeredStats:
    """What a layered decode did, for the report."""

    units: int = 0                 # tail modules run in bands
    bands: int = 0                 # bands per unit (at most; small inputs use fewer)
    passes: int = 0                # unit passes in all, statistics passes included
    halo_rows: dict[str, int] = field(default_factory=dict)   # input rows of context per unit type


# a module's rows of context depend on its layers, not on the input: measured once per module
_HALO_CACHE: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()


class _UnitNorms:
    """The GroupNorms inside one unit, controlled per call index within one run of the unit.

    Calls before ``target`` normalise with the statistics gathered so far; the call ``target`` adds the
    sums of its input's core rows and stops the run (a statistics pass); with ``target`` None every call
    is frozen (the output pass).
    """

    def __init__(self, norms: list[nn.GroupNorm]):
        self.norms = norms
        self.stats = GroupNormStats()
        self.target: int | None = None
        self.core: tuple[float, float] = (0.0, 1.0)      # the band's own rows, as fractions of its height
        self.sums: list[torch.Tensor] | None = None
        self.calls = 0

    def forward_for(self, module: nn.GroupNorm) -> Callable:
        def forward(x: torch.Tensor) -> torch.Tensor:
            k = self.calls
            self.calls += 1
            if self.target is not None and k == self.target:
                h = x.shape[-2]
                lo, hi = round(self.core[0] * h), round(self.core[1] * h)
                s = _group_sums(x[..., lo:hi, :], module.num_groups, None)
                self.sums = list(s) if self.sums is None else [a + b for a, b in zip(self.sums, s)]
                raise StopDecode
            if k >= len(self.stats):
                raise RuntimeError(f"GroupNorm call {k} of a banded module has no statistics; the module ran a "
                                   "different path from band to band")
            return _normalize(module, x, self.stats.mean[k], self.stats.var[k])
        return forward

    def replacements(self) -> dict:
        return {m: self.forward_for(m) for m in self.norms}


def _bands(rows: int, n: int) -> list[tuple[int, int]]:
    n = max(1, min(n, rows))
    edges = [round(i * rows / n) for i in range(n + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


class BandedUnit:
    """Replaces one module's forward: same inputs and output, computed in row bands with exact statistics."""

    def __init__(self, module: nn.Module, bands: int, info: LayeredStats, interrupt: Interrupt | None = None,
                 halo_rows: int | None = None, done: Callable[[], None] | None = None):
        self.module = module
        self.done = done                    # called after each whole-tensor call (progress)
        self.original = module.forward
        self.norms = _UnitNorms(find_group_norms([module]))
        self.n_bands = bands
        self.info = info
        self.interrupt = interrupt
        self.halo = halo_rows

    # one run of the unit's own forward on rows [a, b) of x plus context; returns the output rows of [a, b)
    def _run_band(self, x: torch.Tensor, a: int, b: int, args, kwargs) -> torch.Tensor | None:
        h = x.shape[-2]
        lo, hi = max(0, a - self.halo), min(h, b + self.halo)
        span = hi - lo
        self.norms.core = ((a - lo) / span, (b - lo) / span)
        self.norms.calls = 0
        try:
            with override_forwards(self.norms.replacements()):
                y = self.original(x[..., lo:hi, :], *args, **kwargs)
        except StopDecode:
            return None
        scale = y.shape[-2] / span
        if abs(scale * span - round(scale * span)) > 1e-6 or abs(round(scale * (a - lo)) - scale * (a - lo)) > 1e-6:
            raise RuntimeError(f"{type(self.module).__name__} maps {span} rows to {y.shape[-2]}: not a whole scale")
        return y[..., round(scale * (a - lo)):round(scale * (b - lo)), :]

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.ndim != 4:
            return self.original(x, *args, **kwargs)
        if self.halo is None:
            self.halo = _HALO_CACHE.get(self.module)
        if self.halo is None:
            self.halo = measure_unit_halo(self.original, self.norms, x, args, kwargs)
            _HALO_CACHE[self.module] = self.halo
        name = type(self.module).__name__
        self.info.halo_rows[name] = max(self.info.halo_rows.get(name, 0), self.halo)
        rows = x.shape[-2]
        n = min(self.n_bands, max(1, rows // max(1, 4 * self.halo + 1)))
        bands = _bands(rows, n)
        self.norms.stats = GroupNormStats()
        p = 0
        while True:
            self.norms.target = p
            self.norms.sums = None
            first = self._run_band(x, *bands[0], args, kwargs)
            self.info.passes += 1
            if first is not None:
                break                      # no norm call p: this was the output pass
            for a, b in bands[1:]:
                if self.interrupt is not None:
                    self.interrupt()
                self._run_band(x, a, b, args, kwargs)
            mean, var = _mean_var(*self.norms.sums[:2], self.norms.sums[2])
            self.norms.stats.mean.append(mean)
            self.norms.stats.var.append(var)
            p += 1
        self.norms.target = None
        out = torch.empty(first.shape[:-2] + (round(first.shape[-2] * rows / (bands[0][1] - bands[0][0])),
                                               first.shape[-1]), dtype=first.dtype, device=first.device)
        scale = out.shape[-2] / rows
        out[..., :first.shape[-2], :] = first
        del first
        for a, b in bands[1:]:
            if self.interrupt is not None:
                self.interrupt()
            out[..., round(a * scale):round(b * scale), :] = self._run_band(x, a, b, args, kwargs)
        self.info.bands = max(self.info.bands, len(bands))
        if self.done is not None:
            self.done()
        return out


def measure_unit_halo(forward: Callable, norms: _UnitNorms, x: torch.Tensor, args=(), kwargs=None,
                      probe: int = 16) -> int:
    """Input rows of context one output row of the unit needs, with its GroupNorm statistics fixed.

    Runs the unit on a crop of ``x`` (statistics from the crop itself, then frozen), adds 1 to the
    middle input row and finds the output rows that changed; the crop grows until they stay inside.
    """
    kwargs = kwargs or {}
    rows, cols = x.shape[-2:]
    size = min(probe, rows)
    while True:
        r0 = (rows - size) // 2
        c0, cw = (cols - min(cols, probe)) // 2, min(cols, probe)
        crop = x[:1, :, r0:r0 + size, c0:c0 + cw]
        norms.stats = GroupNormStats()
        norms.core = (0.0, 1.0)
        p = 0
        with override_forwards(norms.replacements()):
            while True:
                norms.target, norms.sums, norms.calls = p, None, 0
                try:
                    base = forward(crop, *args, **kwargs)
                    break
                except StopDecode:
                    mean, var = _mean_var(*norms.sums[:2], norms.sums[2])
                    norms.stats.mean.append(mean)
                    norms.stats.var.append(var)
                    p += 1
            norms.target, norms.calls = None, 0
            bumped = crop.clone()
            mid = size // 2
            bumped[..., mid, :] += 1.0
            moved = forward(bumped, *args, **kwargs)
        norms.target = None
        diff = (moved.float() - base.float()).abs().amax(dim=tuple(i for i in range(moved.ndim) if i != moved.ndim - 2))
        tol = 1e-6 * float(diff.max().clamp_min(1e-30))
        changed = torch.nonzero(diff > tol).flatten()
        if len(changed) == 0:
            return 0
        scale = moved.shape[-2] / size
        lo, hi = int(changed.min()), int(changed.max()) + 1
        reach = max(mid * scale - lo, hi - (mid + 1) * scale, 0.0)
        halo = int(math.ceil(reach / scale))
        touches = lo == 0 or hi == moved.shape[-2]
        if not touches or size >= rows:
            return halo
        size = min(2 * size, rows)


def layered_units(tail: list[nn.Module]) -> list[nn.Module]:
    """The tail modules run in bands: all but bare GroupNorms (they run natively on the whole tensor, which is
    exact and already one pass)."""
    return [m for m in tail if not isinstance(m, nn.GroupNorm)]


def decode_layered(run: Callable[[torch.Tensor], torch.Tensor], tail: list[nn.Module], latent: torch.Tensor, *,
                   bands: int = 8, output_device: torch.device | str = "cpu", progress: Progress | None = None,
                   interrupt: Interrupt | None = None, info: LayeredStats | None = None) -> torch.Tensor:
    """The model's own decode, one sample at a time, with each tail unit computed in row bands.

    run: the model's decode ([B, C, H, W] latent -> [B, C_out, H*s, W*s]). tail: the high-resolution modules
    (``StagedDecoder.tail``); each must be local given its GroupNorm statistics (no attention). Returns float32
    on ``output_device``.
    """
    if latent.ndim != 4:
        raise ConfigError("samples", tuple(latent.shape), "a 4-D image latent",
                          "Layered decoding runs image decoders; video decoders use temporal chunks or tiles.")
    if isinstance(bands, bool) or int(bands) != bands or bands < 1:
        raise ConfigError("bands", bands, "an integer >= 1")
    info = info if info is not None else LayeredStats()
    units = layered_units(tail)
    info.units = len(units)
    n = latent.shape[0]
    total, count = n * max(1, len(units)), {"done": 0}

    def unit_done() -> None:                # progress per banded module call, capped at the total
        count["done"] = min(total, count["done"] + 1)
        if progress is not None:
            progress(count["done"], total)
    banded = {m: BandedUnit(m, bands, info, interrupt, done=unit_done) for m in units}
    outs = []
    for i in range(n):
        if interrupt is not None:
            interrupt()
        with torch.inference_mode(), override_forwards(banded):
            outs.append(run(latent[i:i + 1]).to(output_device, torch.float32))
        count["done"] = (i + 1) * max(1, len(units))
        if progress is not None:
            progress(count["done"], total)
    return torch.cat(outs, 0)
