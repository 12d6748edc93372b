"""Tiny DiT-shaped models for the group-prefetch tests (random weights, CPU, deterministic)."""
from __future__ import annotations

import torch
from torch import nn


class Fp8Linear(nn.Module):
    """A quantized linear whose weight is a plain float8 tensor plus a float32 scale: the bytes
    that stream are the fp8 bytes; dequantization happens here, on whatever device holds them."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        w = torch.randn(d_out, d_in) * 0.1
        scale = w.abs().amax() / 448.0
        self.weight = nn.Parameter((w / scale).clamp(-448, 448).to(torch.float8_e4m3fn), requires_grad=False)
        self.register_buffer("scale", scale.reshape(()).float())
        self.bias = nn.Parameter(torch.randn(d_out) * 0.01)

    def forward(self, x):
        return nn.functional.linear(x, self.weight.to(x.dtype) * self.scale.to(x.dtype), self.bias)


class DoubleBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.img_mod = nn.Linear(d, 2 * d)
        self.img_mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.txt_mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        # a transposed (non-contiguous) weight: its strides must survive streaming
        self.proj_t = nn.Parameter(torch.randn(d, d).t() * 0.1)
        self.register_buffer("gate", torch.linspace(0.5, 1.5, d))

    def forward(self, img, txt):
        shift, scale = self.img_mod(img.mean(1, keepdim=True)).chunk(2, dim=-1)
        img = img + self.img_mlp(img * (1 + scale) + shift) * self.gate
        txt = txt + self.txt_mlp(txt) @ self.proj_t
        return img, txt


class SingleBlock(nn.Module):
    def __init__(self, d: int, fp8: bool = False):
        super().__init__()
        self.linear1 = Fp8Linear(d, 3 * d) if fp8 else nn.Linear(d, 3 * d)
        self.linear2 = nn.Linear(3 * d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return x + self.linear2(nn.functional.gelu(self.linear1(self.norm(x))))


class ToyFlux(nn.Module):
    """Flux-like: embedders, ``double_blocks`` then ``single_blocks``, final layer."""

    def __init__(self, d: int = 32, n_double: int = 3, n_single: int = 5, fp8_single: bool = False):
        super().__init__()
        self.img_in = nn.Linear(8, d)
        self.txt_in = nn.Linear(12, d)
        self.double_blocks = nn.ModuleList(DoubleBlock(d) for _ in range(n_double))
        self.single_blocks = nn.ModuleList(SingleBlock(d, fp8=fp8_single) for _ in range(n_single))
        self.final_layer = nn.Linear(d, 8)

    def forward(self, img, txt):
        img, txt = self.img_in(img), self.txt_in(txt)
        for block in self.double_blocks:
            img, txt = block(img, txt)
        x = torch.cat([txt, img], dim=1)
        for block in self.single_blocks:
            x = block(x)
        return self.final_layer(x[:, txt.shape[1]:])


class WanBlock(nn.Module):
    def __init__(self, d: int, dtype=torch.float32):
        super().__init__()
        self.modulation = nn.Parameter(torch.randn(1, 6, d, dtype=dtype) * 0.1)
        self.q = nn.Linear(d, d, dtype=dtype)
        self.k = nn.Linear(d, d, dtype=dtype)
        self.v = nn.Linear(d, d, dtype=dtype)
        self.o = nn.Linear(d, d, dtype=dtype)
        self.ffn = nn.Sequential(nn.Linear(d, 4 * d, dtype=dtype), nn.GELU(), nn.Linear(4 * d, d, dtype=dtype))

    def forward(self, x, e):
        m = (self.modulation + e).chunk(6, dim=1)
        h = x * (1 + m[1]) + m[0]
        a = torch.softmax(self.q(h) @ self.k(h).transpose(1, 2) / h.shape[-1] ** 0.5, dim=-1) @ self.v(h)
        x = x + self.o(a) * m[2]
        return x + self.ffn(x * (1 + m[4]) + m[3]) * m[5]


class ToyWan(nn.Module):
    """Wan-like: patch embedding, time embedding, ``blocks``, head. Mixed dtypes when asked."""

    def __init__(self, d: int = 32, n: int = 6, mixed: bool = False):
        super().__init__()
        self.patch_embedding = nn.Linear(16, d)
        self.time_embedding = nn.Linear(1, 6 * d)
        self.blocks = nn.ModuleList(
            WanBlock(d, dtype=torch.bfloat16 if (mixed and i % 2) else torch.float32) for i in range(n))
        self.head = nn.Linear(d, 16)
        self.skip: set[int] = set()     # blocks the forward leaves out (skip-layer guidance, Chroma's skip_mmdit)

    def forward(self, x, t):
        x = self.patch_embedding(x)
        e = self.time_embedding(t.reshape(-1, 1, 1)).reshape(x.shape[0], 6, -1)
        for i, block in enumerate(self.blocks):
            if i in self.skip:
                continue
            dt = block.q.weight.dtype
            x = block(x.to(dt), e.to(dt)).float()
        return self.head(x)


def flux_inputs(batch: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 16, 8, generator=g), torch.randn(batch, 6, 12, generator=g)


def wan_inputs(batch: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 10, 16, generator=g), torch.rand(batch, generator=g)


def make_flux(seed: int = 0, **kw) -> ToyFlux:
    torch.manual_seed(seed)
    return ToyFlux(**kw).eval()


def make_wan(seed: int = 0, **kw) -> ToyWan:
    torch.manual_seed(seed)
    return ToyWan(**kw).eval()


class PackedTensor(torch.Tensor):
    """A storage subclass shaped like ComfyUI-GGUF's GGMLTensor (written for these tests, no GGUF code): the
    storage holds a float32 weight's bytes as uint8 rows while ``shape`` reports the weight's own shape, the
    attributes travel with ``to``, and ``detach`` / ``clone`` return the tensor itself, as GGMLTensor's do."""

    @classmethod
    def pack(cls, w: torch.Tensor) -> "PackedTensor":
        t = w.contiguous().view(torch.uint8).reshape(w.shape[0], -1).as_subclass(cls)
        t.logical_shape, t.patches = torch.Size(w.shape), []
        return t

    @property
    def shape(self):
        return getattr(self, "logical_shape", self.size())

    def to(self, *args, **kwargs):
        new = super().to(*args, **kwargs)
        new.logical_shape, new.patches = getattr(self, "logical_shape", None), list(getattr(self, "patches", []))
        return new

    def detach(self, *args, **kwargs):
        return self

    def clone(self, *args, **kwargs):
        return self


class PackedLinear(nn.Module):
    """A linear layer whose weight is a PackedTensor, unpacked on whatever device holds it when it runs."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.weight = nn.Parameter(PackedTensor.pack(lin.weight.detach().float()), requires_grad=False)
        self.bias = nn.Parameter(lin.bias.detach().clone(), requires_grad=False)
        self.reads: list[int] = []            # data_ptr of the packed weight each call read

    def forward(self, x):
        self.reads.append(self.weight.data_ptr())
        w = self.weight.as_subclass(torch.Tensor).reshape(-1).view(torch.float32).reshape(self.weight.shape)
        return nn.functional.linear(x, w.to(x.dtype), self.bias)


def pack_linears(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear under ``model.blocks`` with a PackedLinear (same values)."""
    for block in model.blocks:
        for name, child in list(block.named_modules()):
            if isinstance(child, nn.Linear):
                parent = block.get_submodule(name.rpartition(".")[0]) if "." in name else block
                setattr(parent, name.rpartition(".")[2], PackedLinear(child))
    return model
