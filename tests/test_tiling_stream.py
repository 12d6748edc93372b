"""Streaming a non-causal video decoder through its frames (core/tiling/stream.py), on a toy shaped like
ComfyUI 0.8's LTX-Video decoder: time convolutions padded at both ends by repeating the edge frame,
residual blocks, a depth-to-space upsampler that doubles the frames and drops the first, per-frame glue."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from comfyui_levers.core.errors import ConfigError
from comfyui_levers.core.tiling import measure_peak_bytes, override_forwards
from comfyui_levers.core.tiling.stream import TimeStream, measure_units


class TimeConv(nn.Module):
    """A 3x3x3 convolution padded in time by repeating the first and last frames (LTX's non-causal conv)."""

    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Conv3d(cin, cout, 3, padding=(0, 1, 1))

    def forward(self, x):
        x = torch.cat([x[:, :, :1], x, x[:, :, -1:]], 2)
        return self.conv(x)


def pixel_norm(x):
    return x / torch.sqrt((x * x).mean(1, keepdim=True) + 1e-6)


class Res(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.conv2 = TimeConv(c, c), TimeConv(c, c)

    def forward(self, x, timestep=None):
        h = F.silu(pixel_norm(x))
        if timestep is not None:
            h = h * (1 + timestep)
        return x + self.conv2(F.silu(pixel_norm(self.conv1(h))))


class Up(nn.Module):
    """Depth-to-space x2 in time and space; the first output frame is dropped (LTX's DepthToSpaceUpsample)."""

    def __init__(self, c):
        super().__init__()
        self.conv = TimeConv(c, c * 8 // 2)

    def forward(self, x):
        y = self.conv(x)                                           # [B, (C/2)*8, T, H, W]
        b, c8, t, h, w = y.shape
        c = c8 // 8
        y = y.reshape(b, c, 2, 2, 2, t, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4).reshape(b, c, 2 * t, 2 * h, 2 * w)
        return y[:, :, 1:]


class Mid(nn.Module):
    def __init__(self, c, n):
        super().__init__()
        self.blocks = nn.ModuleList([Res(c) for _ in range(n)])

    def forward(self, x, timestep=None):
        for b in self.blocks:
            x = b(x, timestep=timestep)
        return x


class ToyDecoder(nn.Module):
    def __init__(self, z=4, c=16, global_op=False):
        super().__init__()
        self.conv_in = TimeConv(z, c)
        self.mid = Mid(c, 2)
        self.up1 = Up(c)
        self.res1 = Mid(c // 2, 1)
        self.up2 = Up(c // 2)
        self.conv_out = TimeConv(c // 4, 3)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, c // 4))
        self.global_op = global_op

    def forward(self, x, timestep=None):
        h = self.conv_in(x)
        if self.global_op:
            h = h - h.mean(2, keepdim=True)                        # a norm over time: cannot stream
        h = self.mid(h, timestep=timestep)
        h = self.res1(self.up1(h))
        h = F.silu(pixel_norm(self.up2(h)) * self.scale[None, :, None, None, None])
        return self.conv_out(h)

    def units(self):
        return [self.conv_in, *self.mid.blocks, self.up1, *self.res1.blocks, self.up2, self.conv_out]


def _toy(global_op=False):
    torch.manual_seed(0)
    return ToyDecoder(global_op=global_op).eval()


def _stream(dec, z, chunk, **kw):
    units = measure_units(lambda p: dec(p, timestep=torch.tensor(0.3)), dec.units(), z[:, :, :2, :2, :2])
    stream = TimeStream(dec, units, chunk, **kw)
    with torch.inference_mode(), override_forwards(stream.replacements()):
        out = dec(z, timestep=torch.tensor(0.3))
    return out, stream, units


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_units_are_measured_in_call_order_with_radius_and_frame_map(dtype):
    dec = _toy().to(dtype)
    _, _, units = _stream(dec, torch.randn(1, 4, 3, 4, 4, dtype=dtype), 1)
    assert [u.module for u in units] == dec.units()
    assert [u.radius for u in units] == [1, 2, 2, 1, 2, 1, 1]       # one conv: 1 frame; a residual block: 2
    assert [(u.up, u.drop) for u in units if u.up > 1] == [(2, 1), (2, 1)]
    assert [u.rate for u in units] == [1, 1, 1, 2, 2, 4, 4]
    assert [u.scale for u in units] == [1, 1, 1, 2, 1, 2, 1]


@pytest.mark.parametrize("t,chunk", [(1, 1), (2, 1), (5, 1), (5, 2), (7, 3), (9, 4), (6, 6), (4, 10)])
def test_streamed_decode_equals_the_whole_decode(t, chunk):
    dec = _toy()
    z = torch.randn(1, 4, t, 3, 5)
    with torch.inference_mode():
        ref = dec(z, timestep=torch.tensor(0.3))
    out, stream, _ = _stream(dec, z, chunk)
    assert out.shape == ref.shape == (1, 3, 4 * t - 3, 12, 20)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert stream.stats.calls >= -(-t // chunk)


def test_plain_chunks_are_a_different_function():
    """The premise: without the units' context, chunks in time differ from the whole decode."""
    dec = _toy()
    z = torch.randn(1, 4, 6, 3, 5)
    with torch.inference_mode():
        ref = dec(z)
        plain = torch.cat([dec(z[:, :, :3]), dec(z[:, :, 3:])], 2)
    assert plain.shape != ref.shape or (plain - ref).abs().max() > 1e-2


def test_longer_chunks_recompute_less_and_stay_below_the_whole_decode():
    dec = _toy()
    z = torch.randn(1, 4, 16, 6, 6)
    work, peaks = [], []
    for chunk in (1, 4):
        (out, stream, _), peak = measure_peak_bytes(lambda: _stream(dec, z, chunk), "cpu")
        work.append(stream.stats.work)
        peaks.append(peak.peak_bytes)
    assert work[0] > work[1] > 1.0
    with torch.inference_mode():
        _, whole = measure_peak_bytes(lambda: dec(z, timestep=torch.tensor(0.3)), "cpu")
    assert max(peaks) < 0.75 * whole.peak_bytes


def test_cheap_stages_batch_more_frames_and_recompute_less():
    """One chunk per call at the costliest stage bounds the memory; the low-resolution stages, whose context is
    several latent frames, batch more (up to half the costliest chunk's weight). Same output, less work than
    batching every stage by the chunk."""
    from comfyui_levers.core.tiling.stream import batch_frames

    dec = _toy()
    z = torch.randn(1, 4, 16, 6, 6)
    units = measure_units(lambda p: dec(p, timestep=torch.tensor(0.3)), dec.units(), z[:, :, :2, :2, :2])
    batches = batch_frames(units, 1)
    assert batches == [8, 8, 8, 2, 2, 1, 1]       # costliest stage (256 elements per latent frame): 1 frame
    with torch.inference_mode():
        ref = dec(z, timestep=torch.tensor(0.3))
    work = {}
    for name, b in (("batched", None), ("uniform", [1] * len(units))):
        stream = TimeStream(dec, units, 1, batches=b)
        with torch.inference_mode(), override_forwards(stream.replacements()):
            out = dec(z, timestep=torch.tensor(0.3))
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
        work[name] = stream.stats.work
    assert work["batched"] < 0.8 * work["uniform"], work


def test_each_chunk_leaves_for_the_output_device_and_counts_progress():
    dec = _toy()
    z = torch.randn(1, 4, 6, 2, 2)
    seen = []
    out, stream, _ = _stream(dec, z, 2, output_device="meta", progress=lambda d, n: seen.append((d, n)),
                             total_frames=21)
    assert out.device.type == "meta"
    assert seen[-1] == (21, 21) and [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_a_norm_over_time_cannot_stream():
    dec = _toy(global_op=True)
    with pytest.raises(ConfigError, match="depends on every frame"):
        # conv_in's own output is local; the mean over time sits between units, so the check is end to end:
        # wrap the global op's neighbourhood as one unit (what a bridge would do) and measure it
        units = [dec]
        measure_units(lambda p: dec(p), units, torch.randn(1, 4, 2, 2, 2))


def test_interrupt_restores_every_forward():
    dec = _toy()
    z = torch.randn(1, 4, 6, 2, 2)
    units = measure_units(lambda p: dec(p), dec.units(), z[:, :, :2])

    def stop():
        raise KeyboardInterrupt

    stream = TimeStream(dec, units, 1, interrupt=stop)
    with pytest.raises(KeyboardInterrupt), torch.inference_mode(), override_forwards(stream.replacements()):
        dec(z)
    assert all("forward" not in m.__dict__ for m in [dec, *dec.units()])


def test_bad_chunk_is_refused():
    dec = _toy()
    units = measure_units(lambda p: dec(p), dec.units(), torch.randn(1, 4, 2, 2, 2))
    for bad in (0, 1.5, True):
        with pytest.raises(ConfigError, match="chunk_frames"):
            TimeStream(dec, units, bad)
    for bad in ([1] * (len(units) - 1), [1] * (len(units) - 1) + [0]):
        with pytest.raises(ConfigError, match="batches"):
            TimeStream(dec, units, 1, batches=bad)


def test_decode_time_streamed_runs_each_sample_and_sums_the_work():
    from comfyui_levers.core.tiling.stream import StreamStats, decode_time_streamed, stream_latency
    dec = _toy()
    z = torch.randn(2, 4, 5, 3, 3)
    with torch.inference_mode():
        ref = dec(z)
    units = measure_units(dec, dec.units(), z[:1, :, :2, :2, :2])
    stats, seen = StreamStats(), []
    out = decode_time_streamed(dec, dec, units, z, 2, progress=lambda d, n: seen.append((d, n)),
                               total_frames=17, stats=stats)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    assert seen[-1] == (34, 34) and stats.whole_input_frames == 2 * (5 * 4 + 9 * 2 + 17)
    assert stats.work > 1.0
    # conv_in 1 + two blocks 2 + 2 at latent rate, up1 1 at latent rate, a block 2 at 2x, up2 1 at 2x, conv_out 1 at 4x
    assert stream_latency(units) == pytest.approx(1 + 2 + 2 + 1 + 1 + 0.5 + 0.25)


def _toy_vae(dec):
    """The fields of ComfyUI's VAE and Levers' StagedDecoder that ``bridge.vae.measure_stream`` reads."""
    import types
    vae = types.SimpleNamespace(device="cpu", vae_dtype=torch.float32, upscale_ratio=(lambda t: 4 * t - 3, 4, 4))
    staged = types.SimpleNamespace(run=lambda z: dec(z, timestep=torch.tensor(0.3)), time_units=dec.units(),
                                   time_decoder=dec)
    return vae, staged


def test_measured_chunk_cost_bounds_the_streamed_peak():
    """The bridge's probe: one chunk costs base + per latent frame (frames leave the device per chunk), and that
    prediction bounds the measured peak of a longer video at every chunk length."""
    from comfyui_levers.bridge.vae import measure_stream
    from comfyui_levers.core.tiling.stream import decode_time_streamed

    dec = _toy()
    z = torch.randn(1, 4, 40, 8, 8)
    vae, staged = _toy_vae(dec)
    units, base, per_frame, problem = measure_stream(vae, staged, z)
    assert problem == "" and per_frame > 0 and base > 0
    for chunk in (1, 2, 4, 8):
        _, got = measure_peak_bytes(lambda: decode_time_streamed(staged.run, dec, units, z.clone(), chunk,
                                                                 output_device="meta"), "cpu")
        assert got.peak_bytes <= (base + per_frame * chunk) * 8 * 8 * 16, chunk


def test_glue_that_mixes_frames_across_units_refuses_streaming():
    """A mean over time between two units (outside every unit) passes the per-unit measurement but changes the
    streamed result; the bridge compares a streamed probe with the whole decode and refuses with the reason."""
    from comfyui_levers.bridge.vae import measure_stream

    dec = _toy(global_op=True)
    vae, staged = _toy_vae(dec)
    units, _, _, problem = measure_stream(vae, staged, torch.randn(1, 4, 12, 4, 4))
    assert units == [] and "differs from the whole decode" in problem


class _RepeatDrop(nn.Module):
    """Every frame twice in time, the first 4 dropped: radius 0, up 2, drop 4 (a window steps back 2 frames)."""

    def forward(self, x):
        return x.repeat_interleave(2, 2)[:, :, 4:]


class _Plus(nn.Module):
    def forward(self, x):
        return x + 0


def test_a_frame_map_that_drops_more_than_it_doubles_keeps_the_frames_its_next_window_needs():
    a, up, b = _Plus(), _RepeatDrop(), _Plus()
    chain = nn.Sequential(a, up, b)
    units = measure_units(chain, [a, up, b], torch.randn(1, 1, 4, 2, 2))
    assert [(u.radius, u.up, u.drop) for u in units] == [(0, 1, 0), (0, 2, 4), (0, 1, 0)]
    z = torch.arange(6.).reshape(1, 1, 6, 1, 1).expand(1, 1, 6, 2, 2).contiguous()
    ref = chain(z)
    for chunk in (1, 2, 6):
        stream = TimeStream(chain, units, chunk)
        with torch.inference_mode(), override_forwards(stream.replacements()):
            assert torch.equal(chain(z), ref), chunk


def test_the_decode_keeps_loaded_a_model_whose_offload_device_is_its_gpu():
    """Found in review: under --highvram (the diffusion model) or --gpu-only ComfyUI's offload device is the GPU, so
    unloading a model before the decode frees nothing there; it only unpatched its LoRA, patched again at every
    prompt. Such a model stays loaded, named in the node's line; a model that offloads to the host is still
    unloaded."""
    from types import SimpleNamespace

    from comfyui_levers.bridge.vae import _kept_resident

    gpu = torch.device("cuda", 0)

    def loaded(offload):
        return SimpleNamespace(device=gpu, model=SimpleNamespace(model=torch.nn.Linear(2, 2), offload_device=offload,
                                                                 attachments={}))
    stays, goes = loaded(gpu), loaded(torch.device("cpu"))
    keep, why = _kept_resident(SimpleNamespace(current_loaded_models=[stays, goes]), None)
    assert keep == [stays] and len(why) == 1 and "--highvram or --gpu-only" in why[0]


def test_the_auto_budget_keeps_comfyuis_reserve_vram_free(monkeypatch):
    """Found in review: the decode's auto budget was 90 % of the free memory whatever --reserve-vram said: with 4 GiB
    reserved for other programs and 20 GiB free it left 2 GiB. The reserve stays free; without the flag, 90 %."""
    import sys
    import types
    from types import SimpleNamespace

    from comfyui_levers.bridge.vae import TiledDecodeSettings, budget_bytes

    gib = 1024 ** 3
    mm = types.ModuleType("comfy.model_management")
    mm.get_free_memory = lambda dev=None: 20 * gib
    mm.extra_reserved_memory = lambda: 4 * gib
    cli = types.ModuleType("comfy.cli_args")
    cli.args = SimpleNamespace(reserve_vram=4.0)
    monkeypatch.setitem(sys.modules, "comfy", types.ModuleType("comfy"))
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    monkeypatch.setitem(sys.modules, "comfy.cli_args", cli)
    vae = SimpleNamespace(device=torch.device("cuda", 0))
    budget, line = budget_bytes(vae, TiledDecodeSettings())
    assert budget == 16 * gib and "--reserve-vram" in line
    cli.args.reserve_vram = None                    # ComfyUI's default reserve is within the 10 % margin
    assert budget_bytes(vae, TiledDecodeSettings())[0] == int(20 * gib * 0.9)
