"""Lossless packed bf16 for the host->device wire: about 12 bits per weight instead of 16, bit-exact.

Where both streamers are copy-bound (a FLUX-shaped DiT at 8-12 GiB), GroupPrefetch and ComfyUI move
the same bytes over the same bus; only fewer bytes make the step faster. A bf16 weight is a sign, an
8-bit exponent and a 7-bit mantissa. Mantissas are close to uniform (incompressible), but a trained
layer's exponents fill a narrow band: about 3.2 bits of entropy on mixtures of Gaussian/Laplace
layers with a 20x range of widths, where the 15 most common exponents cover over 99.5 % of the
values, exact zeros and norm weights included (``tests/test_prefetch_packed.py``).

Layout of one packed arena of ``n`` bf16 values (fixed rate, so any element range is a slice):
- ``sm``: n bytes, sign and mantissa (``sign << 7 | mantissa``);
- ``nib``: ceil(n / 2) bytes, a 4-bit exponent code per value (element 2i in the low nibble);
  code c < 15 means ``table[c]``; code 15 (``ESCAPE``) means "see the escapes";
- ``esc_pos`` (int64, ascending) and ``esc_val`` (int16): the raw bits of every escaped value.
That is 1.5 bytes per value plus 10 bytes per escape: about 0.76 x the bf16 bytes.

Decoding (on the device, after the copy): ``bits = (sm & 0x80) << 8 | table[code] << 7 | sm & 0x7F``,
then the escapes are written back. On CUDA a Triton kernel does it in one pass (1.5 bytes read, 2
written per value); the eager torch path is the reference, used on the CPU and when Triton fails.
Like DFloat11's idea (entropy-coded exponents), with a fixed-rate code so slices need no index.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

log = logging.getLogger("levers")

PACKABLE = (torch.bfloat16,)
ESCAPE = 15
CODES = 15                 # table entries (code 15 is the escape)
ESC_BYTES = 8 + 2          # one escape on the wire: int64 position + int16 bits
_CHUNK = 1 << 24           # values per encode step on the host (temporaries ~100 MB)
_DEVICE_CHUNK = 1 << 22    # on a GPU (~25 MB of temporaries: it packs while the GPU holds the model)
# Device staging buffer: at most this many values (96 MiB + escapes); wider ranges unpack in pieces.
# Room for one escape per 128 values (layer-like weights need 1 per 200-400); more escapes only
# mean more pieces. Known before packing, so planners can budget it exactly.
STAGING_VALUES = 1 << 26
STAGING_ESCAPE_EVERY = 128
_BROKEN: list[str] = []    # why the Triton kernel failed once (then the eager path is used for good)


def packed_nbytes(n_values: int, n_escapes: int) -> int:
    """Bytes on the wire for ``n_values`` packed values with ``n_escapes`` escapes."""
    return n_values + (n_values + 1) // 2 + n_escapes * ESC_BYTES


def staging_caps(widest_values: int) -> tuple[int, int]:
    """(values, escapes) of the staging buffer for ranges of at most ``widest_values`` values."""
    values = min(int(widest_values), STAGING_VALUES)
    values += values % 2
    return values, max(2, values // STAGING_ESCAPE_EVERY)


def staging_nbytes(widest_values: int) -> int:
    """Device bytes of that staging buffer (0 when nothing is packed)."""
    if widest_values <= 0:
        return 0
    values, escapes = staging_caps(widest_values)
    return packed_nbytes(values, escapes) + 16 * 4          # + the exponent table


@dataclass
class PackedArena:
    """One dtype arena in packed form. Positions are element offsets in the bf16 arena."""

    n: int
    table: torch.Tensor        # int32 [16]; table[15] unused (escape)
    sm: torch.Tensor           # uint8 [n]
    nib: torch.Tensor          # uint8 [ceil(n / 2)]
    esc_pos: torch.Tensor      # int64 [m], ascending
    esc_val: torch.Tensor      # int16 [m]

    def escapes(self, lo: int, hi: int) -> tuple[int, int]:
        """Index range of the escapes that fall in elements [lo, hi)."""
        i0 = int(torch.searchsorted(self.esc_pos, lo))
        i1 = int(torch.searchsorted(self.esc_pos, hi))
        return i0, i1

    def wire_bytes(self, lo: int, hi: int) -> int:
        i0, i1 = self.escapes(lo, hi)
        return packed_nbytes(hi - lo, i1 - i0)

    def planes(self) -> list[torch.Tensor]:
        return [self.sm, self.nib, self.esc_pos, self.esc_val]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.planes())

    def pieces(self, lo: int, hi: int, cap_values: int, cap_escapes: int) -> Iterator[tuple[int, int, int, int]]:
        """Split [lo, hi) into (lo, hi, i0, i1) pieces that fit a staging buffer of ``cap_values``
        values and ``cap_escapes`` escapes (both >= 2; piece starts stay even so nibbles align)."""
        if lo % 2:
            raise ValueError(f"packed ranges start at an even element (got {lo})")
        cap_values = max(2, cap_values - cap_values % 2)
        cap_escapes = max(2, cap_escapes)
        while lo < hi:
            end = min(hi, lo + cap_values)
            i0, i1 = self.escapes(lo, end)
            if i1 - i0 > cap_escapes:
                # the first escape that does not fit starts the next piece (>= lo + 2: positions are distinct)
                end = int(self.esc_pos[i0 + cap_escapes]) // 2 * 2
                i1 = i0 + int(torch.searchsorted(self.esc_pos[i0:i0 + cap_escapes + 1], end))
            yield lo, end, i0, i1
            lo = end


def bf16_patterns() -> torch.Tensor:
    """All 65 536 bf16 bit patterns (NaNs, signed zeros, subnormals, infinities), as bf16 [65536]."""
    return torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def _chunks(arena: torch.Tensor, lo: int, hi: int, device: torch.device) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(a, b, bits of arena[a:b] as int16 on ``device``) in chunks; on a GPU the arithmetic runs
    there (the host only copies), which packs a FLUX-sized arena in seconds instead of minutes."""
    step = _DEVICE_CHUNK if device.type == "cuda" else _CHUNK
    for a in range(lo, hi, step):
        b = min(hi, a + step)
        yield a, b, arena[a:b].view(torch.int16).to(device)


def choose_table(arena: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 15 most common exponents of ``arena`` (bf16, 1-D) as an int32 [16] table."""
    device = torch.device(device)
    counts = torch.zeros(256, dtype=torch.int64, device=device)
    for _, _, raw in _chunks(arena, 0, arena.numel(), device):
        counts += torch.bincount(((raw >> 7) & 0xFF).int(), minlength=256)
    top = torch.argsort(counts.cpu(), descending=True, stable=True)[:CODES]
    table = torch.zeros(16, dtype=torch.int32)
    table[:CODES] = top.sort().values.to(torch.int32)   # sorted: the same arena gives the same table
    return table


def _encode_range(arena: torch.Tensor, lut: torch.Tensor, lo: int, hi: int, sm: torch.Tensor,
                  nib: torch.Tensor, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Pack elements [lo, hi) (lo even) into ``sm`` / ``nib`` (host tensors); return that range's escapes."""
    device = torch.device(device)
    lut = lut.to(device)
    pos, val = [], []
    for a, b, raw in _chunks(arena, lo, hi, device):
        # int16 arithmetic (>> is arithmetic, so mask after shifting): sign bit 15 -> 7, mantissa bits 0-6
        sm[a:b].copy_((((raw >> 8) & 0x80) | (raw & 0x7F)).to(torch.uint8))
        code = lut[((raw >> 7) & 0xFF).int()]            # uint8 [b - a]
        esc = (code == ESCAPE).nonzero().flatten()
        pos.append((esc + a).cpu())
        val.append(raw[esc].cpu())
        if (b - a) % 2:
            code = torch.cat([code, code.new_zeros(1)])
        nib[a // 2:a // 2 + code.numel() // 2].copy_(code[0::2] | (code[1::2] << 4))
    if not pos:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int16)
    return torch.cat(pos), torch.cat(val)


def _lut(table: torch.Tensor) -> torch.Tensor:
    lut = torch.full((256,), ESCAPE, dtype=torch.uint8)
    lut[table[:CODES].long()] = torch.arange(CODES, dtype=torch.uint8)
    return lut


def pack(arena: torch.Tensor, table: torch.Tensor | None = None, device: torch.device | str = "cpu") -> PackedArena:
    """Pack a 1-D bf16 CPU tensor (an arena) into host planes. ``table``: exponent table (default: its
    15 most common). ``device``: where the arithmetic runs (a CUDA device when there is one)."""
    if arena.dtype not in PACKABLE or arena.dim() != 1 or arena.device.type != "cpu":
        raise ValueError(f"pack takes a 1-D bf16 CPU tensor, got {arena.dtype} {tuple(arena.shape)} on {arena.device}")
    table = choose_table(arena, device) if table is None else table
    n = arena.numel()
    sm = torch.empty(n, dtype=torch.uint8)
    nib = torch.empty((n + 1) // 2, dtype=torch.uint8)
    pos, val = _encode_range(arena, _lut(table), 0, n, sm, nib, device)
    return PackedArena(n, table, sm, nib, pos, val)


def repack_ranges(packed: PackedArena, arena: torch.Tensor, ranges: Sequence[tuple[int, int]],
                  device: torch.device | str = "cpu") -> None:
    """Re-encode element ranges of ``arena`` that changed (a LoRA patch re-staged them), in place.
    The table stays: values it does not cover become escapes. Ranges start even and do not overlap."""
    if not ranges:
        return
    lut = _lut(packed.table)
    ranges = sorted((lo, min(packed.n, hi + hi % 2)) for lo, hi in ranges)
    new_pos, new_val = [], []
    keep = torch.ones(packed.esc_pos.numel(), dtype=torch.bool)
    for lo, hi in ranges:
        i0, i1 = packed.escapes(lo, hi)
        keep[i0:i1] = False
        p, v = _encode_range(arena, lut, lo, hi, packed.sm, packed.nib, device)
        new_pos.append(p)
        new_val.append(v)
    pos = torch.cat([packed.esc_pos[keep], *new_pos])
    val = torch.cat([packed.esc_val[keep], *new_val])
    order = torch.argsort(pos)
    packed.esc_pos, packed.esc_val = pos[order], val[order]


# --- decode ------------------------------------------------------------------------------------

def unpack_eager(sm: torch.Tensor, nib: torch.Tensor, table: torch.Tensor, esc_pos: torch.Tensor,
                 esc_val: torch.Tensor, base: int, out: torch.Tensor) -> None:
    """Reference decode into ``out`` (bf16 [n]); ``esc_pos`` are arena positions, ``base`` the
    arena position of out[0]."""
    n = out.numel()
    o16 = out.view(torch.int16)
    for a in range(0, n, _DEVICE_CHUNK):     # pieces of 4 M values: ~80 MB of temporaries on a GPU fallback
        b = min(n, a + _DEVICE_CHUNK)
        code = torch.stack((nib[a // 2:(b + 1) // 2] & 15, nib[a // 2:(b + 1) // 2] >> 4), dim=1).reshape(-1)[:b - a]
        s = sm[a:b].to(torch.int32)
        u = ((s & 0x80) << 8) | (table[code.long()] << 7) | (s & 0x7F)      # [b - a] in [0, 65535]
        o16[a:b].copy_(torch.where(u >= 0x8000, u - 0x10000, u).to(torch.int16))   # the same bits, signed
    if esc_pos.numel():
        o16[esc_pos - base] = esc_val


@functools.lru_cache(maxsize=1)
def _kernels():
    """(triton, unpack kernel, escape kernel), or None when Triton is missing (CPU installs)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def unpack_bf16(sm_ptr, nib_ptr, table_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        s = tl.load(sm_ptr + offs, mask=mask, other=0).to(tl.int32)
        byte = tl.load(nib_ptr + offs // 2, mask=mask, other=0).to(tl.int32)
        code = (byte >> ((offs % 2) * 4).to(tl.int32)) & 15
        e = tl.load(table_ptr + code, mask=mask, other=0)
        u = ((s & 0x80) << 8) | (e << 7) | (s & 0x7F)
        u = tl.where(u >= 32768, u - 65536, u)
        tl.store(out_ptr + offs, u.to(tl.int16), mask=mask)

    @triton.jit
    def put_escapes(pos_ptr, val_ptr, out_ptr, base, m, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < m
        p = tl.load(pos_ptr + offs, mask=mask, other=0) - base
        v = tl.load(val_ptr + offs, mask=mask, other=0)
        tl.store(out_ptr + p, v, mask=mask)

    return triton, unpack_bf16, put_escapes


def triton_unpack_available(device: torch.device) -> tuple[bool, str]:
    """Whether the one-pass kernel can decode on ``device`` (and why not). The first call per device
    runs the kernel once on every bf16 bit pattern and compares it with the eager reference: a kernel
    that builds but decodes wrong is refused before any weight goes through it."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, "not a CUDA device"
    if _BROKEN:
        return False, f"the Triton decode kernel failed: {_BROKEN[0]}"
    if _kernels() is None:
        return False, "Triton is not installed"
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _VERIFIED:
        problem = self_check(device)
        if problem:
            _BROKEN.append(problem)
            log.warning("levers: packed-bf16 Triton decode refused: %s", problem)
            return False, f"the Triton decode kernel failed: {problem}"
        _VERIFIED.add(device)
    return True, "Triton one-pass decode (self-checked on this device)"


_VERIFIED: set[torch.device] = set()


def self_check(device: torch.device, launch=None) -> str:
    """An empty string when ``launch`` (default: the Triton kernel) decodes every bf16 bit pattern, at an odd
    length and a nonzero base, exactly as ``unpack_eager`` does on ``device``; else what went wrong. One-time
    (it syncs)."""
    launch = launch or _launch
    g = torch.Generator().manual_seed(0)
    x = torch.cat([(torch.randn(4097, generator=g) * 0.02).bfloat16(), bf16_patterns()])
    pk = pack(x)
    lo, hi = 2, x.numel()
    i0, i1 = pk.escapes(lo, hi)
    planes = [t.to(device) for t in (pk.sm[lo:hi], pk.nib[lo // 2:(hi + 1) // 2], pk.table, pk.esc_pos[i0:i1],
                                     pk.esc_val[i0:i1])]
    out = torch.empty(hi - lo, dtype=torch.bfloat16, device=device)
    try:
        launch(*planes, lo, out)
        got = out.view(torch.int16).cpu()
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use this kernel here
        return f"{type(exc).__name__}: {exc}"
    bad = int((got != x[lo:hi].view(torch.int16)).sum())
    return "" if bad == 0 else f"self-check decoded {bad} of {hi - lo} values wrong on {device}"


def packing_supported(device: torch.device) -> tuple[bool, str]:
    """Whether packed streaming pays on ``device``: on CUDA only with the one-pass kernel (eager
    torch takes ~8 kernels per piece, which would cost more than the bytes it saves)."""
    if torch.device(device).type != "cuda":
        return True, "eager unpack on the CPU"
    return triton_unpack_available(device)


def unpack(sm: torch.Tensor, nib: torch.Tensor, table: torch.Tensor, esc_pos: torch.Tensor,
           esc_val: torch.Tensor, base: int, out: torch.Tensor) -> None:
    """Decode packed values into ``out`` on its device: the Triton kernel on CUDA, else eager torch."""
    if out.is_cuda and triton_unpack_available(out.device)[0]:
        try:
            _launch(sm, nib, table, esc_pos, esc_val, base, out)
            return
        except Exception as exc:  # noqa: BLE001 - a kernel that fails to build must not break the forward
            _BROKEN.append(f"{type(exc).__name__}: {exc}")
            log.warning("levers: packed-bf16 Triton decode failed (%s); using eager torch", _BROKEN[-1])
    unpack_eager(sm, nib, table, esc_pos, esc_val, base, out)


def _launch(sm, nib, table, esc_pos, esc_val, base, out) -> None:
    triton, unpack_bf16, put_escapes = _kernels()
    n, block = out.numel(), 1024
    o16 = out.view(torch.int16)
    unpack_bf16[(triton.cdiv(n, block),)](sm, nib, table, o16, n, BLOCK=block)
    m = esc_pos.numel()
    if m:
        put_escapes[(triton.cdiv(m, block),)](esc_pos, esc_val, o16, base, m, BLOCK=block)
