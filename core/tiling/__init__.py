"""VAE decode in tiles sized from free memory, without seams (TiledVAEDecode's engine).

Pure torch: ``plan`` picks whole / temporal / spatial from measured costs, ``layout`` places tiles
and builds blend weights that sum to 1, ``decode`` runs them with whole-image statistics kept
global, ``layered`` runs the high-resolution stages module by module in row bands (exact statistics),
``memory`` measures peaks, ``stream`` runs a decoder that is not causal in time through its frames a chunk
at a time (each time unit keeps its own context). The ComfyUI side is ``bridge/vae.py``.
"""
from .decode import (DecodeStats, StagedDecoder, collect_tail_stats, decode_spatial, decode_streamed,
                     decode_temporal, decode_whole, measure_halo, run_stem)
from .layered import LayeredStats, decode_layered
from .layout import Span, TileGrid, axis_weights, layout_axis, make_grid
from .memory import PeakMeasurement, measure_peak_bytes
from .overrides import GroupNormPatch, GroupNormStats, override_forwards, pass_through, persistent_cache
from .plan import DecodeCost, TilePlan, plan_decode
from .stream import StreamStats, TimeStream, TimeUnit, decode_time_streamed, measure_units

__all__ = [
    "DecodeCost", "DecodeStats", "StreamStats", "TimeStream", "TimeUnit", "decode_time_streamed", "measure_units", "GroupNormPatch", "GroupNormStats", "LayeredStats", "PeakMeasurement", "Span",
    "StagedDecoder", "TileGrid", "TilePlan", "axis_weights", "collect_tail_stats", "decode_layered",
    "decode_spatial", "decode_streamed", "decode_temporal", "decode_whole", "layout_axis", "make_grid",
    "measure_halo", "measure_peak_bytes", "override_forwards", "pass_through", "persistent_cache", "plan_decode",
    "run_stem",
]
