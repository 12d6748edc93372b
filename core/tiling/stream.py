"""Stream a video decoder that is not causal in time through its frames, exactly, a chunk at a time.

A non-causal decoder (LTX-Video on ComfyUI 0.8) pads every temporal convolution at both ends of
the video, so its output frame depends on frames before *and after* it, and plain chunks in time
are a different function. But the decoder is a chain of *time units* (a convolution, a residual
block, a temporal upsampler) joined by per-frame glue (norms, activations, a timestep scale).
Each unit is shift-invariant in time with a measured radius ``r``: its output frame ``g`` depends
only on input frames ``pos(g) - r .. pos(g) + r``. So a unit can run on a window of its input and
keep the outputs whose context lies inside the window: those equal the whole-video outputs.

``TimeStream`` runs the decoder's own ``forward`` once per chunk of latent frames. Every unit keeps
a short buffer of its input (``r`` frames of left context plus what still waits for its right
context) and computes its final output frames in batches (``batch_frames``): one chunk at the costliest
full-resolution stage, which bounds the memory, and more latent frames at the cheap low-resolution
stages, where one-frame windows would mostly recompute context. No window grows with the video; after
the last chunk the decoder is called on empty input until every unit has flushed. Memory is about one
chunk's windows plus ~2r frames per unit instead of the whole video; the cost is recomputing each
window's context frames (the report gives the work ratio).

Output frame maps are affine: a unit that turns ``n`` input frames into ``up * n - drop`` (LTX's
upsampler doubles the frames and drops the first) maps window ``[s, e)`` onto the whole video's
output frames ``[up * s, up * e - drop)``: its outputs are end-aligned, which ``measure_units``
checks along with the radius, by perturbing one frame of a random input.

Nothing here imports ComfyUI; the bridge names the decoder and its units.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..errors import ConfigError
from .overrides import override_forwards

Progress = Callable[[int, int], None]
Interrupt = Callable[[], None]


@dataclass(frozen=True)
class TimeUnit:
    """One time unit of a decoder, as measured (``measure_units``)."""

    module: nn.Module
    radius: int          # input frames of context each side an output frame depends on
    up: int              # output frames per input frame
    drop: int            # n input frames give up * n - drop output frames
    out_channels: int
    scale: int           # output px per input px (each spatial axis)
    rate: float          # this unit's output frames per latent frame (the units before it included)
    px_scale: float = 1.0  # this unit's output px per latent px (each spatial axis, the units before it included)

    @property
    def latent_radius(self) -> float:
        """The radius in latent frames (input frames run at ``rate / up`` per latent frame)."""
        return self.radius * self.up / self.rate

    @property
    def elems_per_latent_frame(self) -> float:
        """Output elements one latent frame becomes here, per latent px (what a frame of this stage weighs)."""
        return self.out_channels * self.px_scale ** 2 * self.rate

    def out_frames(self, n: int) -> int:
        return max(0, self.up * n - self.drop)

    def pos(self, g: int) -> int:
        """The input frame output frame ``g`` sits on."""
        return (g + self.drop) // self.up


@dataclass
class StreamStats:
    """What a streamed decode did, for the report."""

    calls: int = 0
    unit_input_frames: int = 0      # input frames the units computed on, context included
    whole_input_frames: int = 0     # input frames the units see in one whole-video call

    @property
    def work(self) -> float:
        return self.unit_input_frames / max(1, self.whole_input_frames)


class _UnitStream:
    """A unit's stand-in while a video streams: buffers its input and returns the final output frames."""

    def __init__(self, unit: TimeUnit, stream: "TimeStream", original: Callable):
        self.unit = unit
        self.stream = stream
        self.original = original
        self.buf: torch.Tensor | None = None
        self.start = 0        # global index of buf's first frame
        self.n_in = 0
        self.n_out = 0
        self.done = False

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        u = self.unit
        complete = self.stream.upstream_done                  # no more input will come
        # a fresh buffer on every call, even with no new frames: the trimmed buffer below is a view, and this copy
        # is what frees the frames it dropped (skipping it for empty input raised the toy decoder's peak by half)
        self.buf = x if self.buf is None else torch.cat([self.buf, x], 2)
        self.n_in += x.shape[2]
        total = u.out_frames(self.n_in)
        last = total - 1 if complete else u.up * (self.n_in - 1 - u.radius) + u.up - 1 - u.drop
        cap = self.stream.caps[id(u.module)]
        end = min(last + 1, total, self.n_out + cap)          # emit output frames [n_out, end)
        out = None
        # wait for a full batch unless the input is complete: a short batch recomputes the same context
        if end > self.n_out and (complete or end - self.n_out >= cap):
            s = self._window_start()
            e = self.n_in if (complete and end == total) else min(self.n_in, u.pos(end - 1) + u.radius + 1)
            window = self.buf[:, :, s - self.start:e - self.start]      # [B, C, e - s, H, W]
            y = self.original(window, *args, **kwargs)
            self.stream.stats.unit_input_frames += e - s
            out = y[:, :, self.n_out - u.up * s:end - u.up * s]
            self.n_out = end
        self.done = complete and self.n_out == total
        keep = self.n_in if self.done else self._window_start()
        if keep > self.start:
            self.buf = self.buf[:, :, keep - self.start:]
            self.start = keep
        self.stream.upstream_done = self.done
        if out is None:
            b, h, w = x.shape[0], x.shape[-2] * u.scale, x.shape[-1] * u.scale
            out = x.new_empty(b, u.out_channels, 0, h, w)
        return out

    def _window_start(self) -> int:
        """The first input frame the next window needs: ``radius`` frames before the next output's, and early
        enough that the window's own first outputs (dropped by the frame map) come before it."""
        u = self.unit
        s = max(0, u.pos(self.n_out) - u.radius)
        while s > 0 and u.up * s > self.n_out:
            s -= 1
        return s


class TimeStream:
    """Runs ``decoder``'s own forward on chunks of ``chunk_frames`` latent frames with ``units`` streaming.

    Use ``replacements()`` with ``override_forwards``; the decoder's forward then takes the whole latent
    and returns the whole video, computed a chunk at a time. Each chunk's frames go to ``output_device``
    as the decoder returns them. ``batches``: latent frames each unit computes per call (default
    ``batch_frames``).
    """

    def __init__(self, decoder: nn.Module, units: list[TimeUnit], chunk_frames: int,
                 output_device: torch.device | str = "cpu", progress: Progress | None = None,
                 interrupt: Interrupt | None = None, total_frames: int = 0, batches: list[int] | None = None):
        if isinstance(chunk_frames, bool) or int(chunk_frames) != chunk_frames or chunk_frames < 1:
            raise ConfigError("chunk_frames", chunk_frames, "an integer >= 1")
        if not units:
            raise ConfigError("units", "[]", "the decoder's time units (measure_units)")
        self.decoder = decoder
        self.units = units
        self.chunk_frames = int(chunk_frames)
        self.output_device = output_device
        self.progress = progress
        self.interrupt = interrupt
        self.total_frames = total_frames
        self.stats = StreamStats()
        self.upstream_done = False
        self.streams: dict[int, _UnitStream] = {}
        batches = batch_frames(units, self.chunk_frames) if batches is None else batches
        if len(batches) != len(units) or any(isinstance(f, bool) or int(f) != f or f < 1 for f in batches):
            raise ConfigError("batches", batches, f"{len(units)} integers >= 1 (latent frames per call, one per unit)")
        self.caps = {id(u.module): max(1, math.ceil(f * u.rate)) for u, f in zip(units, batches)}

    def replacements(self) -> dict:
        """The forwards to install (read before they are: each stand-in calls the forward it replaces)."""
        self.original = self.decoder.forward
        self.originals = {id(u.module): u.module.forward for u in self.units}
        return {self.decoder: self.forward, **{u.module: self._unit(u) for u in self.units}}

    def _unit(self, unit: TimeUnit) -> Callable:
        def call(x, *args, **kwargs):
            return self.streams[id(unit.module)](x, *args, **kwargs)
        return call

    def forward(self, sample: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """The decoder's forward on the whole latent [B, C, T, H, W], one chunk of frames at a time."""
        t = sample.shape[2]
        self.streams = {id(u.module): _UnitStream(u, self, self.originals[id(u.module)]) for u in self.units}
        self.stats.whole_input_frames += sum(self._whole_inputs(t))
        pieces: list[torch.Tensor] = []
        frames = 0
        starts = list(range(0, t, self.chunk_frames))
        calls = 0
        while True:
            if self.interrupt is not None:
                self.interrupt()
            fed = starts[calls] if calls < len(starts) else t
            chunk = sample[:, :, fed:fed + self.chunk_frames] if calls < len(starts) else sample[:, :, :0]
            self.upstream_done = fed + self.chunk_frames >= t
            before = [s.n_out for s in self.streams.values()]
            out = self.original(chunk, *args, **kwargs)
            calls += 1
            if out.shape[2]:
                pieces.append(out.to(self.output_device))
                frames += out.shape[2]
                if self.progress is not None and self.total_frames:
                    self.progress(min(frames, self.total_frames), self.total_frames)
            if all(s.done for s in self.streams.values()):
                break
            if calls > len(starts) and before == [s.n_out for s in self.streams.values()]:
                raise RuntimeError("streamed decode made no progress: a time unit never completed "
                                   "(the decoder does not call its units in the measured order)")
        self.stats.calls += calls
        return torch.cat(pieces, 2)

    def _whole_inputs(self, t: int) -> list[int]:
        """Input frames of each unit in a whole-video call (for the work ratio)."""
        n, out = t, []
        for u in self.units:
            out.append(n)
            n = u.out_frames(n)
        return out


def batch_frames(units: list[TimeUnit], chunk_frames: int) -> list[int]:
    """Latent frames each unit computes per call.

    The costliest stage (most elements per latent frame, the full-resolution one) computes one chunk per call;
    that bounds the memory. Cheaper stages batch more: enough that the 2 x radius frames of context a window
    recomputes stay within 25% of it, as long as the batch weighs at most half of the costliest stage's chunk.
    At the low-resolution stages the context is several latent frames and the weights are the widest, so
    one-frame batches there would recompute most of the work and re-read the weights for a few pixels.
    """
    top = max(u.elems_per_latent_frame for u in units)
    out = []
    for u in units:
        want = max(chunk_frames, math.ceil(8 * u.latent_radius))
        room = max(chunk_frames, int(chunk_frames * top / (2 * u.elems_per_latent_frame)))
        out.append(min(want, room))
    return out


def measure_units(run: Callable[[torch.Tensor], object], modules: list[nn.Module], probe: torch.Tensor,
                  max_frames: int = 129) -> list[TimeUnit]:
    """Measure each module's temporal radius and frame map, in the order ``run(probe)`` calls them.

    Each module's first input during ``run(probe)`` gives its channels, spatial size and call arguments; a
    random input of ``n`` frames with one middle frame perturbed shows which output frames depend on it. ``n``
    doubles until the change stays clear of the ends. The frame map comes from ``n`` and ``n - 1`` frames and
    must be end-aligned (window outputs at ``up * s``). Raises ConfigError for a module whose output depends on
    every frame (attention in time, a norm over time): that decoder cannot stream.
    """
    calls: dict[int, tuple] = {}
    order: list[nn.Module] = []

    def capture(m):
        original = m.forward

        def call(x, *args, **kwargs):
            if id(m) not in calls:
                calls[id(m)] = (x, args, kwargs)
                order.append(m)
            return original(x, *args, **kwargs)
        return call

    with torch.inference_mode(), override_forwards({m: capture(m) for m in modules}):
        run(probe)
    missing = [type(m).__name__ for m in modules if id(m) not in calls]
    if missing:
        raise ConfigError("units", ", ".join(missing), "modules the decoder calls on every chunk")
    units = []
    rate = 1.0
    latent_w = probe.shape[-1]
    gen = torch.Generator().manual_seed(0)
    for m in order:
        x, args, kwargs = calls[id(m)]
        # heuristic algorithm choice, not autotuned: an FFT convolution would smear rounding over all frames
        with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled, benchmark=False):
            radius, up, drop, y = _radius(m, x, args, kwargs, gen, max_frames)
        rate *= up
        units.append(TimeUnit(m, radius, up, drop, out_channels=y.shape[1], scale=y.shape[-1] // x.shape[-1],
                              rate=rate, px_scale=y.shape[-1] / latent_w))
    return units


def _radius(m: nn.Module, x: torch.Tensor, args, kwargs, gen: torch.Generator, max_frames: int):
    n = 9
    while True:
        shape = (x.shape[0], x.shape[1], n, *x.shape[3:])
        a = torch.randn(shape, generator=gen).to(x.device, x.dtype)
        with torch.inference_mode():
            y = m(a, *args, **kwargs)
            y_short = m(a[:, :, :n - 1], *args, **kwargs)
            up = y.shape[2] - y_short.shape[2]
            drop = up * n - y.shape[2]
            if up < 1 or up * (n - 1) - drop != y_short.shape[2]:
                raise ConfigError("units", type(m).__name__, "a module whose output frames are an affine map "
                                  "of its input frames")
            mid = n // 2
            b = a.clone()
            b[:, :, mid] += torch.randn(b[:, :, mid].shape, generator=gen).to(x.device, x.dtype)
            diff = (m(b, *args, **kwargs) - y).abs().float().flatten(3).amax((0, 1, 3))      # [frames]
            changed = (diff > 1e-6 * float(diff.max().clamp_min(1e-30))).nonzero().flatten()
        if changed.numel() == 0:
            return 0, up, drop, y
        pos = [(int(g) + drop) // up for g in changed]
        if min(pos) > 0 and max(pos) < n - 1:
            radius = max(abs(p - mid) for p in pos)
            _check_end_aligned(m, a, y, args, kwargs, radius, up, drop)
            return radius, up, drop, y
        if 2 * n - 1 > max_frames:
            raise ConfigError("units", type(m).__name__, "a module whose output frame depends on nearby frames only",
                              "Its output depends on every frame (attention or a norm over time), so this decoder "
                              "cannot stream in time; decode it whole or in spatial tiles.")
        n = 2 * n - 1


def _check_end_aligned(m: nn.Module, a: torch.Tensor, y: torch.Tensor, args, kwargs, radius: int, up: int,
                       drop: int) -> None:
    """The window [1, n) of input ``a`` must give the whole input's output frames from ``up`` on, wherever
    their context lies inside the window (what ``_UnitStream`` relies on to place a window's outputs)."""
    n = a.shape[2]
    with torch.inference_mode():
        w = m(a[:, :, 1:], *args, **kwargs)
    inner = [g for g in range(up, y.shape[2]) if (g + drop) // up - radius >= 1]
    if not inner:
        return
    ref = y[:, :, inner[0]:inner[-1] + 1]
    got = w[:, :, inner[0] - up:inner[-1] + 1 - up]
    # a window's shape can pick another convolution algorithm: rounding differs by a few units of the dtype's
    # precision (bf16: 2^-8), while a misaligned frame map differs by the frames' own size
    tol = (2e-2 if ref.element_size() < 4 else 1e-3) * float(ref.abs().amax()) + 1e-6
    if got.shape != ref.shape or float((got - ref).abs().amax()) > tol:
        raise ConfigError("units", type(m).__name__, "a module whose windows give the whole input's output "
                          f"frames end-aligned (window [1, {n}) -> outputs from {up})")


def decode_time_streamed(run: Callable[[torch.Tensor], torch.Tensor], decoder: nn.Module, units: list[TimeUnit],
                         latent: torch.Tensor, chunk_frames: int, output_device: torch.device | str = "cpu",
                         progress: Progress | None = None, interrupt: Interrupt | None = None,
                         total_frames: int = 0, stats: StreamStats | None = None) -> torch.Tensor:
    """The model's own decode (``run``, which calls ``decoder``), one sample at a time, streamed through time
    ``chunk_frames`` latent frames per call. Returns float32 [B, C, T_out, H, W] on ``output_device``."""
    outs = []
    b = latent.shape[0]
    done = {"frames": 0}

    def count(frames: int, _total: int) -> None:
        if progress is not None and total_frames:
            progress(done["frames"] + frames, total_frames * b)

    for bi in range(b):
        stream = TimeStream(decoder, units, chunk_frames, output_device, count, interrupt, total_frames)
        with torch.inference_mode(), override_forwards(stream.replacements()):
            outs.append(run(latent[bi:bi + 1]).to(output_device, torch.float32))
        done["frames"] += total_frames
        if stats is not None:
            stats.calls += stream.stats.calls
            stats.unit_input_frames += stream.stats.unit_input_frames
            stats.whole_input_frames += stream.stats.whole_input_frames
    return torch.cat(outs, 0)


def stream_latency(units: list[TimeUnit]) -> float:
    """Latent frames of right context the last output frame of a chunk waits for (the units' radii summed)."""
    return sum(u.latent_radius for u in units)
