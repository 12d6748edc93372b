"""Layered decode: the tail's modules one at a time, each in row bands with exact whole-image GroupNorm
statistics (pure torch, CPU, the toy KL decoder of test_tiling_decode)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from comfyui_levers.core.errors import ConfigError
from comfyui_levers.core.tiling import LayeredStats, decode_layered, decode_whole, measure_peak_bytes
from comfyui_levers.core.tiling.layered import BandedUnit, measure_unit_halo, _UnitNorms
from comfyui_levers.core.tiling.overrides import find_group_norms
from test_tiling_decode import Res, ToyKL, Up, _init, toy_kl_case


@pytest.fixture(scope="module")
def kl():
    return toy_kl_case((2, 4, 24, 32))


def test_layered_matches_untiled_to_float_rounding(kl):
    m, z, ref = kl
    info = LayeredStats()
    out = decode_layered(m.decode, m.staged().tail, z, bands=6, info=info)
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-5)
    # bands really happened: up to 6 where the rows allow (at the 24-row stem resolution a 2-row residual
    # halo allows 24 // 9 = 2 bands; at 96 rows all 6)
    assert info.bands == 6 and info.units == 6          # res_a, up_a, res_b, up_b, res_c, conv_out (norm_out native)
    # per sample: 3 residual blocks x (2 statistics passes + 1 output pass) + 2 upsamplers + conv_out
    assert info.passes == 2 * (3 * 3 + 3)


def test_per_band_statistics_would_be_wrong(kl):
    """The same bands with each band's own GroupNorm statistics (no global pass) differ: the test can see
    what the statistics passes buy."""
    m, z, ref = kl
    units = [m.res_a, m.res_b, m.res_c]

    def own_stats(unit):
        orig = unit.forward

        def fwd(x, *a):
            rows = x.shape[-2]
            out = [orig(x[..., r:r + rows // 4, :]) for r in range(0, rows, rows // 4)]
            return torch.cat(out, -2)
        return fwd
    from comfyui_levers.core.tiling import override_forwards
    with torch.no_grad(), override_forwards({u: own_stats(u) for u in units}):
        naive = m.decode(z)
    assert (naive - ref).abs().max() > 1e-2


def test_unit_halo_is_measured_per_module():
    torch.manual_seed(0)
    res, up = _init(Res(8, 8), 1), _init(Up(8), 2)
    conv = _init(nn.Conv2d(8, 3, 3, padding=1), 3)
    x = torch.randn(1, 8, 40, 40)
    with torch.no_grad():
        assert measure_unit_halo(res.forward, _UnitNorms(find_group_norms([res])), x) == 2   # two 3x3 convs
        assert measure_unit_halo(up.forward, _UnitNorms([]), x) == 1                          # 3x3 conv after x2
        assert measure_unit_halo(conv.forward, _UnitNorms([]), x) == 1


def test_a_global_module_degrades_to_one_band():
    """A module whose output rows depend on every input row (attention) measures a halo as large as its input,
    so it runs as one band: still exact, never silently wrong."""
    from test_tiling_decode import Attn
    torch.manual_seed(0)
    attn = _init(Attn(8), 4)
    x = torch.randn(1, 8, 12, 12)
    with torch.no_grad():
        ref = attn(x)
        info = LayeredStats()
        unit = BandedUnit(attn, 4, info)
        out = unit(x)
    assert unit.halo >= 6 and info.bands == 1
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_layered_peak_is_below_untiled_peak():
    m = _init(ToyKL(attn=False), 7)
    z = torch.randn(1, 4, 32, 32)
    _, whole = measure_peak_bytes(lambda: decode_whole(m.decode, z, 1), "cpu")
    _, layered = measure_peak_bytes(lambda: decode_layered(m.decode, m.staged().tail, z, bands=8), "cpu")
    assert layered.peak_bytes < 0.8 * whole.peak_bytes, (layered.peak_bytes, whole.peak_bytes)


def test_modules_are_restored_after_an_interrupt(kl):
    m, z, _ = kl
    calls = {"n": 0}

    def interrupt():
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt("stop")
    with pytest.raises(KeyboardInterrupt):
        decode_layered(m.decode, m.staged().tail, z, bands=4, interrupt=interrupt)
    assert all("forward" not in mod.__dict__ for mod in m.modules())
    with torch.no_grad():
        torch.testing.assert_close(m.decode(z), kl[2], rtol=0, atol=0)


def test_progress_counts_every_banded_module_of_every_sample(kl):
    """One step per module call (6 per sample here), so a single large image moves the bar as it decodes."""
    m, z, _ = kl
    seen = []
    decode_layered(m.decode, m.staged().tail, z, progress=lambda d, t: seen.append((d, t)))
    done = [d for d, _ in seen]
    assert all(t == 12 for _, t in seen) and done == sorted(done)
    assert set(done) == set(range(1, 13)) and seen[-1] == (12, 12)


@pytest.mark.parametrize("kw, latent", [({"bands": 0}, (1, 4, 8, 8)), ({"bands": 2.5}, (1, 4, 8, 8)),
                                        ({}, (1, 4, 2, 8, 8))])
def test_bad_input_is_refused(kl, kw, latent):
    m = kl[0]
    with pytest.raises(ConfigError):
        decode_layered(m.decode, m.staged().tail, torch.zeros(latent), **kw)


def test_report_names_each_modules_context_on_every_decode(kl):
    """The margins are measured once per module and cached; every decode's stats still list them."""
    m, z, _ = kl
    for _ in range(2):
        info = LayeredStats()
        decode_layered(m.decode, m.staged().tail, z[:1], info=info)
        assert info.halo_rows == {"Res": 2, "Up": 1, "Conv2d": 1}

