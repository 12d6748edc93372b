"""Scoped, exactly-restored replacements of module forwards, and GroupNorm with frozen statistics.

A staged decode runs the model's own ``decode`` and changes what some modules return:
stem modules pass their input through (their work was done once, whole), the boundary
module returns a crop of the stored stem output, and the tail's GroupNorms normalise with
statistics that belong to the whole image instead of the tile. Everything is an instance
attribute ``forward`` set inside a ``with`` block and deleted again on exit, so the module
is byte-for-byte what it was before (its class ``forward`` was never touched).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

_MARK = "_levers_tiling_override"


@contextlib.contextmanager
def override_forwards(replacements: dict[nn.Module, Callable]) -> Iterator[None]:
    """Replace ``module.forward`` for each module while the block runs; restore on exit."""
    installed: list[tuple[nn.Module, object]] = []
    try:
        for module, fn in replacements.items():
            if getattr(module, _MARK, False):
                raise RuntimeError(f"{type(module).__name__} already has a Levers tiling override; "
                                   "overrides do not nest")
            previous = module.__dict__.get("forward", None)     # an instance-level forward someone else set
            installed.append((module, previous))
            module.forward = fn
            setattr(module, _MARK, True)
        yield
    finally:
        for module, previous in reversed(installed):
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
            module.__dict__.pop(_MARK, None)


def pass_through(x, *args, **kwargs):
    """A stem module's stand-in during tile runs: its output is provided later by the boundary."""
    return x


class StopDecode(Exception):
    """Raised by a capture hook to end a decode early once the needed tensor is in hand."""


@dataclass
class GroupNormStats:
    """Per-(sample, group) mean and variance of every tail GroupNorm call, keyed by call order.

    ``mean[k]`` / ``var[k]`` are float64 ``[batch, groups]`` for the k-th GroupNorm call of one run.
    """

    mean: list[torch.Tensor] = field(default_factory=list)
    var: list[torch.Tensor] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.mean)

    def select(self, batch: slice) -> "GroupNormStats":
        return GroupNormStats([m[batch] for m in self.mean], [v[batch] for v in self.var])


def _normalize(module: nn.GroupNorm, x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """GroupNorm of x with given per-(sample, group) stats, affine included, in one kernel.

    x: [B, C, *spatial]; mean/var: [B, G]. ``batch_norm`` in eval mode normalises each channel with given
    statistics and applies a per-channel affine: viewing x as [1, B*C, spatial] and giving every channel its
    group's statistics and its own weight and bias is exactly GroupNorm with those statistics, in one pass over
    x (statistics stay float32 whatever x's dtype).
    """
    b, c = x.shape[:2]
    rep = c // module.num_groups
    m = mean.to(device=x.device, dtype=torch.float32).reshape(b, -1).repeat_interleave(rep, 1).reshape(-1)
    v = var.to(device=x.device, dtype=torch.float32).reshape(b, -1).repeat_interleave(rep, 1).reshape(-1)
    w = bias = None
    if module.weight is not None:
        w = module.weight.to(device=x.device, dtype=torch.float32).reshape(-1).repeat(b)
        if module.bias is not None:
            bias = module.bias.to(device=x.device, dtype=torch.float32).reshape(-1).repeat(b)
    xv = x.reshape(1, b * c, -1)
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        xv = xv.float()
    y = torch.nn.functional.batch_norm(xv, m, v, w, bias, training=False, eps=module.eps)
    return y.reshape(x.shape).to(x.dtype)


def _own_normalize(module: nn.GroupNorm, x: torch.Tensor) -> torch.Tensor:
    """GroupNorm with x's own statistics: the native kernel (the weights cast as ComfyUI's ops cast them)."""
    w = None if module.weight is None else module.weight.to(device=x.device, dtype=x.dtype)
    b = None if module.bias is None else module.bias.to(device=x.device, dtype=x.dtype)
    return torch.nn.functional.group_norm(x, module.num_groups, w, b, module.eps)


def _group_sums(x: torch.Tensor, groups: int, w: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """Weighted sums per (sample, group): (sum w*x, sum w*x^2, sum w), float64 [B, G].

    x: [B, C, *spatial]; w: [B or 1, 1, *spatial] or None (all ones). Works through the channels a
    slice at a time so the temporaries stay a fraction of x (a tile can be hundreds of MiB).
    """
    b, c = x.shape[:2]
    p = x[0, 0].numel()
    cg = c // groups
    s1 = torch.zeros(b, c, dtype=torch.float64, device=x.device)
    s2 = torch.zeros(b, c, dtype=torch.float64, device=x.device)
    wv = None
    if w is not None:
        wv = w.to(device=x.device, dtype=torch.float32).expand(b, 1, *x.shape[2:]).reshape(b, p, 1)
    step = max(cg, (c // 8) // cg * cg)
    for c0 in range(0, c, step):
        xc = x[:, c0:c0 + step].reshape(b, -1, p).float()             # [B, step, P]
        if wv is None:
            s1[:, c0:c0 + step] = xc.sum(-1, dtype=torch.float64)
            s2[:, c0:c0 + step] = (xc * xc).sum(-1, dtype=torch.float64)
        else:
            s1[:, c0:c0 + step] = torch.bmm(xc, wv)[..., 0].double()
            s2[:, c0:c0 + step] = torch.bmm(xc * xc, wv)[..., 0].double()
    n = torch.full((b, groups), float(cg * p), dtype=torch.float64, device=x.device) if wv is None else \
        (wv.double().sum((1, 2)) * cg)[:, None].expand(b, groups).clone()
    return s1.reshape(b, groups, cg).sum(-1), s2.reshape(b, groups, cg).sum(-1), n


def _mean_var(s1: torch.Tensor, s2: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = n.clamp_min(1e-12)
    mean = s1 / n
    return mean, (s2 / n - mean * mean).clamp_min(0.0)


class GroupNormPatch:
    """Makes a set of GroupNorm modules use statistics that are not the tile's own.

    Modes:
      * ``frozen(stats)``: normalise with ``stats`` (collected earlier for the whole image).
      * ``pooled(n_windows, masks)``: the batch holds ``n_windows`` windows per sample; pool the
        sums over the windows' valid (mask=1) pixels per sample, normalise every window with the
        pooled stats, and record them. Running all windows in one batch makes this
        layer-synchronous, so each layer's stats already use the pooled stats of the layers before.
    Calls are keyed by their order within one run (``reset()`` before each run), so a module
    called twice gets two entries.
    """

    def __init__(self, modules: list[nn.GroupNorm]):
        self.modules = list(modules)
        self._mode = "frozen"
        self._stats = GroupNormStats()
        self._record = GroupNormStats()
        self._n_windows = 1
        self._masks: torch.Tensor | None = None
        self._calls = 0

    # -- modes -------------------------------------------------------------------------
    def frozen(self, stats: GroupNormStats) -> "GroupNormPatch":
        self._mode, self._stats, self._calls = "frozen", stats, 0
        return self

    def pooled(self, n_windows: int, masks: torch.Tensor | None) -> "GroupNormPatch":
        """masks: [B * n_windows, 1, *spatial] at the stem resolution (1 = count this pixel)."""
        self._mode, self._n_windows, self._masks, self._calls = "pooled", n_windows, masks, 0
        self._record = GroupNormStats()
        return self

    def accumulate(self, base: GroupNormStats | None) -> "GroupNormPatch":
        """Start a pass over tiles run one at a time: normalise with ``base`` (or, when None, with
        each call's own statistics) and add weighted sums to running totals; ``weights(w)`` sets the
        weight map of the next tile. ``totals()`` gives the pooled statistics after the pass."""
        self._mode, self._base, self._calls = "accumulate", base, 0
        self._sums: list[list[torch.Tensor]] = []
        self._weights = None
        return self

    def weights(self, w: torch.Tensor) -> None:
        """w: [B or 1, 1, H, W] non-negative weights of the coming tile at the output resolution."""
        self._weights, self._calls = w, 0

    def totals(self) -> GroupNormStats:
        out = GroupNormStats()
        for s1, s2, n in self._sums:
            mean, var = _mean_var(s1, s2, n)
            out.mean.append(mean)
            out.var.append(var)
        return out

    def reset(self) -> None:
        self._calls = 0

    @property
    def recorded(self) -> GroupNormStats:
        return self._record

    # -- the replacement forward -------------------------------------------------------
    def _forward_for(self, module: nn.GroupNorm) -> Callable:
        def forward(x: torch.Tensor) -> torch.Tensor:
            k = self._calls
            self._calls += 1
            if self._mode == "frozen":
                if k >= len(self._stats):
                    raise RuntimeError(f"tail GroupNorm call {k} has no frozen statistics (only "
                                       f"{len(self._stats)} were collected); the decoder ran a different path")
                return _normalize(module, x, self._stats.mean[k], self._stats.var[k])
            if self._mode == "accumulate":
                self._add_weighted(k, module, x)
                if self._base is None:
                    return _own_normalize(module, x)
                return _normalize(module, x, self._base.mean[k], self._base.var[k])
            mean, var = self._pooled_stats(module, x)
            self._record.mean.append(mean)
            self._record.var.append(var)
            return _normalize(module, x, mean.repeat_interleave(self._n_windows, 0),
                              var.repeat_interleave(self._n_windows, 0))
        return forward

    def _add_weighted(self, k: int, module: nn.GroupNorm, x: torch.Tensor) -> None:
        w = self._weights.to(device=x.device, dtype=torch.float32)
        if tuple(w.shape[-2:]) != tuple(x.shape[-2:]):
            w = torch.nn.functional.interpolate(w, size=tuple(x.shape[-2:]), mode="area")
        sums = _group_sums(x, module.num_groups, w)
        if k == len(self._sums):
            self._sums.append(list(sums))
        else:
            for acc, v in zip(self._sums[k], sums):
                acc += v

    def _pooled_stats(self, module: nn.GroupNorm, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bw, g = x.shape[0], module.num_groups
        mask = None
        if self._masks is not None:
            mask = torch.nn.functional.interpolate(self._masks.to(device=x.device, dtype=torch.float32),
                                                   size=tuple(x.shape[2:]), mode="nearest")
        s1, s2, n = _group_sums(x, g, mask)
        b = bw // self._n_windows
        return _mean_var(*(v.reshape(b, self._n_windows, g).sum(1) for v in (s1, s2, n)))

    def replacements(self) -> dict[nn.Module, Callable]:
        return {m: self._forward_for(m) for m in self.modules}


def find_group_norms(modules: list[nn.Module]) -> list[nn.GroupNorm]:
    """Every GroupNorm inside the given modules (each once, in registration order)."""
    seen, out = set(), []
    for root in modules:
        for m in root.modules():
            if isinstance(m, nn.GroupNorm) and id(m) not in seen:
                seen.add(id(m))
                out.append(m)
    return out


@contextlib.contextmanager
def persistent_cache(module: nn.Module, kwarg: str, cache: list, first_kwarg: str | None = None) -> Iterator[list]:
    """Make every call of ``module`` use ``cache`` for keyword ``kwarg`` (a causal feature cache).

    A causal video decoder's ``decode`` builds a fresh cache per call; substituting one list that
    outlives the call lets consecutive chunks continue exactly where the previous chunk stopped.
    ``first_kwarg`` names a flag the model's ``decode`` sets on its own first call (Wan 2.2's
    ``first_chunk``); it is set here only while the cache is still empty, i.e. on the first call
    of the whole video, not on the first call of every chunk.
    """
    original = module.forward

    def forward(*args, **kwargs):
        kwargs[kwarg] = cache
        if first_kwarg is not None:
            kwargs[first_kwarg] = all(entry is None for entry in cache)
        return original(*args, **kwargs)

    with override_forwards({module: forward}):
        yield cache
