"""Compact Llama-family decoder: RMSNorm, RoPE, GQA attention with a static KV cache, SwiGLU.

Every projection of a block is a `Linear` (fused qkv, o, fused gate_up, down), whether it holds dense
weights (a source checkpoint) or low-bit weights with QDEC residuals (a quantized model).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import kvquant, ops, qdec
from .config import ModelConfig, rope_inv_freq
from .errors import Cancelled
from .progress import progress
from .quant import TILE_N, QuantLUT, QuantResidual, QuantWeight, Unpacked, _row_blocks

KINDS = ("qkv", "o", "gate_up", "down")
DEQUANT_ELEMS = 1 << 26  # a prompt's GPU matmul dequantizes at most this many weights at once (128 MB of fp16)
QDEC_MODES = ("off", "exact", "approx", "static", "random")


@dataclass
class QdecSettings:
    """How QDEC runs, shared by every Linear of a model. k_chunk: channels compensated per 1024 inputs. blocks: per
    kind, the blocks compensated where not all are (a tuning profile whose budget does not cover every block)."""
    mode: str = "off"
    k_chunk: dict = field(default_factory=lambda: {k: 0 for k in KINDS})
    blocks: dict = field(default_factory=dict)  # kind -> frozenset of block indices; a kind not here: every block
    generator: torch.Generator | None = None  # random mode's picks (approx's boundary order hashes the input)
    # observer(linear, x [T, K], idx [T, k]): called with each CPU compensation's input and selected channels
    # (measurements such as the recall of the selection; localllm.outliers)
    observer: Callable[["Linear", torch.Tensor, torch.Tensor], None] | None = None
    # prompts (2+ tokens) with 8-bit activations, per token, into the quantized layers (ops.quantize_tokens; on a
    # GPU the int8 GEMM of kernels/prefill_a8.cu): not QDEC, but read by every Linear like it
    act8: bool = False

    def k_for(self, kind: str, block: int | None = None) -> int:
        """k_chunk of `kind`'s layers, or of its layer in `block` (0 where that block is not compensated)."""
        return 0 if self.mode == "off" or not in_blocks(self.blocks, kind, block) else self.k_chunk.get(kind, 0)


def in_blocks(blocks: dict, kind: str, block: int | None) -> bool:
    """Whether the `kind` layer of `block` is among `blocks` (as QdecSettings.blocks: a kind not there, every block)."""
    return block is None or kind not in blocks or block in blocks[kind]


class Linear(nn.Module):
    """y = W x (+ b), W either dense or dequantized from `quant`; plus R_hat[:, S] x[S] when QDEC is on."""

    def __init__(self, kind: str, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 quant: QuantWeight | QuantLUT | None = None, residual: QuantResidual | None = None,
                 stats: qdec.ActStats | None = None, settings: QdecSettings | None = None):
        super().__init__()
        assert (weight is None) != (quant is None), "give dense weights or quantized weights"
        self.kind = kind
        self.block: int | None = None  # the block it belongs to (build_block), for QdecSettings.blocks
        self.quant = quant  # on the CPU; on a GPU it becomes `packed` (place())
        self.packed = None
        self.residual = residual
        self.host_residual = None  # on a GPU with QDEC on: the residual pinned in host memory (kernels.qdec)
        self.comp = None  # on a GPU with QDEC on: the QDEC GEMV's launch (kernels.qdec.Call)
        self.hold_next = False  # this GEMV and decode's next are both large (kernels.gemv.HOLD_BYTES; Transformer.place)
        self.held = False  # decode's GEMV before this one holds its launch (hold_next)
        self.stats = stats
        self.settings = settings or QdecSettings()
        # dense source weights [N, K]; a quantized Linear dequantizes on the CPU when first run there
        self.weight = None if weight is None else nn.Parameter(weight.float(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self._dequantized: torch.Tensor | None = None  # the CPU's float32 W_hat, made when first run
        self.unpacked = False  # on the CPU: run from the codes unpacked instead (unpack())
        self._codes: Unpacked | None = None  # those, unpacked when first run

    @property
    def in_features(self) -> int:
        w = self.quant or self.packed
        return w.in_features if w is not None else self.weight.shape[1]

    @property
    def out_features(self) -> int:
        w = self.quant or self.packed
        return w.out_features if w is not None else self.weight.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of weights (and bias) this layer reads per token."""
        w = self.quant or self.packed
        n = w.nbytes if w is not None else self.weight.numel() * self.weight.element_size()
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def cpu_bytes(self, unpacked: bool = False) -> int:
        """Bytes of weights (and bias) this layer holds on the CPU once run: its packed form and float32 W_hat, or
        (unpacked) its packed form and unpacked codes (unpack())."""
        w = self.out_features * self.in_features
        extra = 0 if self.bias is None else 4 * self.out_features
        q = self.quant
        if q is None:
            return 4 * w + extra
        return q.nbytes + (q.unpacked_nbytes if unpacked else 4 * w) + extra

    def dense(self) -> torch.Tensor:
        """The weights this layer computes with, as a dense [N, K] tensor (W_hat for a quantized layer)."""
        if self.weight is not None:
            return self.weight
        if self.unpacked:  # made anew, not kept
            return self._unpacked_codes().rows()
        if self._dequantized is None:
            self._dequantized = self.quant.dequantize()
        return self._dequantized

    def unpack(self) -> None:
        """On the CPU, run from the codes unpacked (quant.Unpacked: ~1 byte a weight), dequantizing a slice of rows
        per matmul, instead of from float32 weights dequantized once (4 bytes a weight): the same results, a decode
        step ~2x slower. runtime.fit_cpu_memory does this where the float32 weights would not fit the host."""
        if self.quant is not None:
            self.unpacked, self._dequantized = True, None

    def _unpacked_codes(self) -> Unpacked:
        if self._codes is None:
            self._codes = self.quant.unpacked()
        return self._codes

    @property
    def ready(self) -> bool:
        """Whether the CPU's form of the weights (float32 W_hat, or the unpacked codes) is made; dense weights and a
        GPU's packed ones always are."""
        return self.quant is None or (self._codes if self.unpacked else self._dequantized) is not None

    def make_ready(self) -> None:
        """Make the CPU's form of the weights now rather than at the first forward."""
        if not self.ready:
            self._unpacked_codes() if self.unpacked else self.dense()

    def weighted_energy(self, v: torch.Tensor, rows: slice | None = None) -> float:
        """sum_n sum_c v[c] W_hat[n, c]^2 over the output rows n in `rows` (None: all; v [K]: the inputs' mean
        squares, so the output energy E|W_hat x|^2 of uncorrelated inputs); on a GPU dequantized a slice of rows at a
        time, as prompts are."""
        first, last = (0, self.out_features) if rows is None else rows.indices(self.out_features)[:2]
        total = 0.0
        for r, w in self._slices():
            a, b = max(first - r.start, 0), min(last - r.start, w.shape[0])
            if a < b:
                total += float(w[a:b].float().square().sum(0) @ v.to(w.device, torch.float32))
        return total

    def place(self, device: torch.device, dtype: torch.dtype) -> None:
        """Move to `device`; dense weights and bias take `dtype`. Packed weights stay packed: on a GPU they become
        the kernels' Packed form (the CPU QuantWeight is dropped)."""
        if self.weight is not None:
            self.weight = nn.Parameter(self.weight.to(device, dtype), requires_grad=False)
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.to(device, dtype), requires_grad=False)
        if self.quant is not None and device.type == "cuda":
            from .kernels.gemv import Packed, PackedLUT
            q = self.quant
            self.packed = (PackedLUT if isinstance(q, QuantLUT) else Packed).from_quant(q, device)
            self.quant, self._dequantized, self.unpacked, self._codes = None, None, False, None

    @property
    def takes_runs(self) -> bool:
        """Whether decode's fused attention may leave its runs unmerged to this layer (o), whose GEMV merges them
        (kernels.attention.Runs): GPU weights without a bias, and no hook that would read the input."""
        return self.packed is not None and self.bias is None and not self._forward_pre_hooks

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, norm: "RMSNorm | None" = None,
                glu: bool = False) -> torch.Tensor:
        """y = W f(x) (+ residual, same shape as y): f = `norm` (an RMSNorm), silu(gate) * up when `glu` (x =
        [gate | up]), or nothing. x: [..., K] (or [..., 2K] with glu) -> [..., N], or one token's attention runs
        (kernels.attention.Runs; residual [1, 1, N]). On a GPU, one token at a time, the GEMV kernel applies f (or
        merges the runs) and adds the residual itself."""
        k = self.settings.k_for(self.kind, self.block)
        compensate = k > 0 and self.residual is not None
        if self.packed is not None:
            if not isinstance(x, torch.Tensor) or x.shape[:-1].numel() == 1:  # decode (Runs: takes_runs asked)
                if compensate and self.comp is None:
                    raise RuntimeError("QDEC is on but this layer has no GPU launch; turn it on with "
                                       "LocalModel.set_qdec")
                return self._gemv(x, residual, norm, glu, self.comp if compensate else None)
            compensate = False  # prompts on the GPU run uncompensated (as in the paper)
        x = self.input_of(x, norm, glu)
        # 8-bit activations for the blocks' uniform quantized weights only (table weights have no int8 GEMM: their
        # prompts stay fp16 on both devices; the head is outside the blocks)
        act8 = self.settings.act8 and self.weight is None and self.kind != "head" and x.shape[:-1].numel() > 1 and \
            not hasattr(self.quant if self.quant is not None else self.packed, "lut")  # QuantLUT / PackedLUT
        if self.packed is not None and act8:  # a prompt on the GPU: the int8 GEMM
            from .kernels import prefill_a8
            y = prefill_a8.linear(x.reshape(-1, x.shape[-1]), self.packed).view(*x.shape[:-1], -1)
            y = y if self.bias is None else y + self.bias
        else:
            y = self._matmul(ops.quantize_tokens(x) if act8 else x)
        if residual is not None:
            y = y + residual
        if compensate:
            x2 = x.reshape(-1, x.shape[-1])
            idx = select_channels(self, x2, k)
            if self.settings.observer is not None:
                self.settings.observer(self, x2, idx)
            y = y + qdec.compensate(x2, idx, self.residual).to(y.dtype).reshape(y.shape)
        return y

    def _slices(self):
        """(rows, W_hat[rows]) covering the weights: dense weights whole; on a GPU fp16 slices of at most
        DEQUANT_ELEMS weights (an 8B model's output head would be 1 GB whole); on the CPU float32 slices of a few MB,
        of W_hat dequantized once or, unpacked (unpack()), dequantized anew."""
        n = self.out_features
        if self.packed is not None:
            from .kernels.gemv import dequantize
            w = self.packed
            step = max(1, DEQUANT_ELEMS // (16 * w.in_features))
            for t in range(0, n // 16, step):
                t1 = min(n // 16, t + step)
                yield slice(16 * t, 16 * t1), dequantize(w if t1 - t == n // 16 else w.tiles(t, t1))
        elif self.weight is None:  # the same slices either way, so that both give the same bits
            w = self._unpacked_codes() if self.unpacked else self.dense()
            for r in _row_blocks(n, self.in_features, TILE_N):
                yield r, w.rows(r) if self.unpacked else w[r]
        else:
            yield slice(0, n), self.weight

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x W_hat^T (+ bias), a slice of W_hat's rows at a time (_slices); on a GPU the bias is added after."""
        bias = None if self.bias is None or self.packed is not None else self.bias.to(x.dtype)
        ys = [F.linear(x, w.to(x.dtype), None if bias is None else bias[r]) for r, w in self._slices()]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        return y + self.bias if self.packed is not None and self.bias is not None else y

    @staticmethod
    def input_of(x: torch.Tensor, norm: "RMSNorm | None" = None, glu: bool = False) -> torch.Tensor:
        """f(x) of forward(): what the weights multiply."""
        return norm(x) if norm is not None else ops.silu_mul(x) if glu else x

    def hook_input(self, fn: Callable[["Linear", torch.Tensor], None]):
        """Call fn(self, f(x)) before every forward (f(x): input_of, what the weights multiply); returns the hook's
        handle, whose remove() ends it."""
        return self.register_forward_pre_hook(
            lambda m, args, kw: fn(m, self.input_of(args[0], kw.get("norm"), kw.get("glu", False))), with_kwargs=True)

    def _gemv(self, x: torch.Tensor, residual: torch.Tensor | None, norm: "RMSNorm | None", glu: bool,
              comp=None) -> torch.Tensor:
        """One token on the GPU: the low-bit GEMV kernel, with the input transform, (without a bias) the residual
        add and QDEC (comp: kernels.qdec.Call) fused."""
        fuse = residual is not None and self.bias is None
        from .kernels.gemv import gemv
        runs = not isinstance(x, torch.Tensor)  # kernels.attention.Runs, merged by the kernel; one token's
        y = gemv(x if runs else x.reshape(-1), self.packed,
                 residual=residual.reshape(-1).contiguous() if fuse else None,
                 norm=None if norm is None else (norm.weight, norm.eps), glu=glu, hold_next=self.hold_next,
                 held=self.held, comp=comp).view(*(residual.shape if runs else x.shape)[:-1], -1)
        if self.bias is not None:
            y = y + self.bias
        return y if residual is None or fuse else y + residual


def select_channels(lin: Linear, x: torch.Tensor, k_chunk: int) -> torch.Tensor:
    """The salient input channels of each row of x [T, K] under the model's QDEC mode -> idx [T, k]."""
    s = lin.settings
    if s.mode == "exact":
        return qdec.select_exact(x, k_chunk)
    if s.mode == "random":
        return qdec.select_random(x.shape[0], x.shape[1], k_chunk, s.generator)
    if lin.stats is None:
        raise RuntimeError(f"QDEC mode '{s.mode}' needs calibration statistics, which this model lacks")
    if s.mode == "static":
        return qdec.select_static(lin.stats.sq_mean, k_chunk, x.shape[0])
    return qdec.select_approx(x, k_chunk, lin.stats.b0, lin.stats.b15(k_chunk))


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rmsnorm(x, self.weight, self.eps)


def rope_tables(inv_freq: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D/2] for positions pos [T]."""
    ang = pos.float()[:, None] * inv_freq[None, :]
    return ang.cos(), ang.sin()


# Not cuDNN's attention: it builds a plan for every new prompt length, which on the H100 cost a chat turn 0.1-0.9 s
# before its first token (scratch measurement: 107-133 ms vs 40-46 ms per new length on a demo-shaped model).
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_mask(pos: torch.Tensor, kv_len: int | None) -> torch.Tensor:
    """[T, keys]: query at position pos[t] sees keys at positions <= pos[t]; keys are cache entries 0..kv_len-1,
    or, without a cache, the queries themselves. Made once per forward, shared by every block."""
    keys = pos if kv_len is None else torch.arange(kv_len, device=pos.device)
    return keys[None, :] <= pos[:, None]


class KVCache(nn.Module):
    """Static KV cache, filled in place; per layer [B, kv_heads, max_len, ...]. bits 16: k and v in `dtype`
    ([..., head_dim]); bits 8 or 4: k and v hold kvquant codes (int32 words) and k_sz, v_sz their fp16 scale and
    zero per (token, head). Attention always reads what the cache holds (dequantized), prompts included."""

    def __init__(self, cfg: ModelConfig, max_len: int, batch: int = 1, dtype=torch.float32, device=None,
                 bits: int = 16):
        super().__init__()
        self.bits, self.dtype = kvquant.check_bits(bits), dtype
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len)
        if bits == 16:
            self.register_buffer("k", torch.zeros(shape + (cfg.head_dim,), dtype=dtype, device=device))
            self.register_buffer("v", torch.zeros(shape + (cfg.head_dim,), dtype=dtype, device=device))
            self.k_sz = self.v_sz = None
            return
        words = kvquant.words_per_head(cfg.head_dim, bits)
        for n in ("k", "v"):
            self.register_buffer(n, torch.zeros(shape + (words,), dtype=torch.int32, device=device))
            self.register_buffer(n + "_sz", torch.zeros(shape + (2,), dtype=torch.float16, device=device))

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def append(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [B, kv_heads, T, head_dim] (after RoPE) at positions pos [T] (quantized at 8 or 4 bits)."""
        B = k.shape[0]
        for name, x in (("k", k), ("v", v)):
            if self.bits == 16:
                getattr(self, name)[layer, :B].index_copy_(2, pos, x.to(self.dtype))
                continue
            codes, sz = kvquant.quantize(x, self.bits)
            getattr(self, name)[layer, :B].index_copy_(2, pos, codes)
            getattr(self, name + "_sz")[layer, :B].index_copy_(2, pos, sz)

    def read(self, layer: int, kv_len: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first kv_len positions, [B, kv_heads, kv_len, head_dim] in `dtype`."""
        if self.bits == 16:
            return self.k[layer, :batch, :, :kv_len], self.v[layer, :batch, :, :kv_len]
        return tuple(kvquant.dequantize(getattr(self, n)[layer, :batch, :, :kv_len],
                                        getattr(self, n + "_sz")[layer, :batch, :, :kv_len], self.bits, self.dtype)
                     for n in ("k", "v"))

    def layer(self, i: int) -> tuple:
        """What the fused decode kernel takes for layer i of sequence 0: (k, v, k_sz, v_sz); the last two None at 16
        bits."""
        sz = (None, None) if self.bits == 16 else (self.k_sz[i, 0], self.v_sz[i, 0])
        return (self.k[i, 0], self.v[i, 0]) + sz


class FusedDecode(NamedTuple):
    """A step that Transformer.step sends through the fused decode attention (ops.attend_decode): RoPE's frequencies,
    from which the kernel makes its own angles, and the keys the step may see (its graph's span)."""
    inv_freq: torch.Tensor
    span: int


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, attn_norm: RMSNorm, qkv: Linear, o: Linear,
                 mlp_norm: RMSNorm, gate_up: Linear, down: Linear):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.attn_norm, self.qkv, self.o = attn_norm, qkv, o
        self.mlp_norm, self.gate_up, self.down = mlp_norm, gate_up, down

    def forward(self, h: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, pos: torch.Tensor,
                cache: KVCache | None, mask: torch.Tensor | None, fused: FusedDecode | None = None,
                keys: int | None = None) -> torch.Tensor:
        """h: [B, T, D] at positions pos [T]; with a cache, attention reads its first `keys` entries (the new ones
        appended first). mask [T, keys] from attention_mask(), or a lower-right CausalBias (the queries are the last
        T keys); or mask None: the T queries are positions 0..T-1 and attend causally. fused: the fused decode
        attention serves this step (cos, sin and mask are then None)."""
        c = self.cfg
        B, T, _ = h.shape
        qkv = self.qkv(h, norm=self.attn_norm)  # [B, T, q + k + v]
        if fused is not None:  # (its runs may be left for o's GEMV to merge: a kernels.attention.Runs)
            a = ops.attend_decode(qkv, fused.inv_freq, cache.layer(self.layer), pos, c.num_heads, c.num_kv_heads,
                                  fused.span, leave_runs=self.o.takes_runs)
            a = a.view(B, T, c.q_size) if isinstance(a, torch.Tensor) else a
        else:
            a = self._attend(qkv, cos, sin, pos, cache, mask, keys)
        h = self.o(a, residual=h)
        return self.down(self.gate_up(h, norm=self.mlp_norm), residual=h, glu=True)

    def _attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                cache: KVCache | None, mask: torch.Tensor | None, keys: int | None) -> torch.Tensor:
        """RoPE, cache append and attention with torch ops: qkv [B, T, q + k + v] -> [B, T, q]."""
        c = self.cfg
        B, T, _ = qkv.shape
        ops.rope_(qkv.view(B * T, -1), cos, sin, c.num_heads + c.num_kv_heads, c.head_dim)
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(B, T, c.num_heads, c.head_dim).transpose(1, 2)
        k = k.view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = v.view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        if cache is not None:
            if keys is None:  # read(None) would take every entry, the unwritten ones too
                raise ValueError("Block.forward with a cache needs keys, the number of cache entries to read")
            cache.append(self.layer, pos, k, v)
            k, v = cache.read(self.layer, keys, B)
        with sdpa_kernel(_SDPA_BACKENDS):
            a = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                               is_causal=mask is None, enable_gqa=c.num_kv_heads != c.num_heads)
        return a.transpose(1, 2).reshape(B, T, c.q_size)


BLOCKS_BAR_DELAY = 1.0  # seconds before forward(desc=...) shows its bar: most prompts are read sooner


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, blocks: list[Block], norm: RMSNorm,
                 lm_head: torch.Tensor | QuantWeight | None, settings: QdecSettings):
        """lm_head: the output head's weights [V, D], dense or quantized (8 bits, quant.HEAD_BITS); None: tied to
        the embeddings (the same tensor)."""
        super().__init__()
        self.cfg = cfg
        # [V, D]: float32 where the CPU's head multiplies by it (tied); else as given, each token's row cast to the
        # activations' dtype: a model file's fp16 stays mapped from the file (an 8B model's is 1 GB, 2 as float32)
        self.embed = nn.Parameter(embed.float() if lm_head is None else embed, requires_grad=False)
        self.blocks = nn.ModuleList(blocks)
        self.norm = norm
        self.tied = lm_head is None
        if isinstance(lm_head, QuantWeight):
            self.head = Linear("head", quant=lm_head, settings=settings)
        else:
            self.head = Linear("head", weight=self.embed if self.tied else lm_head, settings=settings)
            if self.tied:
                self.head.weight = self.embed
        self.settings = settings
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self._ready = False  # make_ready() done

    def make_ready(self) -> None:
        """On the CPU: every quantized layer's weights in the form they run in (float32, or the codes unpacked), with
        a progress bar: an 8B model's take tens of seconds, which the first token would otherwise wait through
        silently. The first forward calls it; LocalModel.warm_up too."""
        if self._ready:
            return
        todo = [lin for lin in (*self.linears(), self.head) if not lin.ready]
        if todo:
            what = "unpacking" if todo[0].unpacked else "dequantizing"
            for lin in progress(todo, f"{what} the weights for the CPU", unit="layer"):
                lin.make_ready()
        self._ready = True  # (a layer unpacked later makes its new form at its next forward)

    def forward(self, tokens: torch.Tensor, start: int = 0, cache: KVCache | None = None,
                last: bool = False, cancel=None, desc: str | None = None) -> torch.Tensor:
        """tokens: [B, T] at positions start..start+T-1 -> logits [B, T, V] (float32); last: of the last position
        only, [B, 1, V]. cancel: an Event; once set, raises errors.Cancelled before the next block (a long prompt
        on the CPU takes seconds a block; a GPU's blocks are queued faster than they run). desc: a progress bar over
        the blocks, shown once they have taken BLOCKS_BAR_DELAY seconds (a long prompt on the CPU)."""
        T = tokens.shape[1]
        if cache is not None and start + T > cache.max_len:
            raise ValueError(f"sequence of {start + T} tokens exceeds the KV cache ({cache.max_len})")
        pos = torch.arange(start, start + T, device=tokens.device)
        return self.step(tokens, pos, cache, start + T, causal=start == 0, last=last, cancel=cancel, desc=desc)

    def step(self, tokens: torch.Tensor, pos: torch.Tensor, cache: KVCache | None, kv_len: int,
             causal: bool = False, last: bool = False, cancel=None, desc: str | None = None) -> torch.Tensor:
        """forward() with positions as a tensor: with a fixed kv_len it can be captured in a CUDA graph. causal: the
        queries are positions 0..T-1 and see only each other (a prompt from the start), so attention needs no mask
        and can take the flash kernel, which takes no explicit mask."""
        c = self.cfg
        if self.device.type == "cpu":
            self.make_ready()
        h = ops.embedding(tokens, self.embed).to(self.act_dtype)
        if cache is not None and ops.fused_decode_attention(h, cache, c.num_heads, c.num_kv_heads, c.head_dim):
            # the kernels make their own angles and need no mask: no kernels for them ahead of the first layer
            fused, cos, sin, mask = FusedDecode(self.inv_freq, kv_len), None, None, None
        else:
            fused, (cos, sin) = None, rope_tables(self.inv_freq, pos)
            if causal:
                mask = None
            elif cache is not None and tokens.shape[1] > 1:
                # a prompt read after what the cache holds (Decoder.prefill's reuse): its T queries are the last of the
                # kv_len keys, which the flash-style kernels take as a lower-right causal bias (an H200 with GQA: ~4x
                # faster than a bool mask, which goes to the math kernel). Imported here: it imports torch._dynamo,
                # ~0.9 s of every command's start
                from torch.nn.attention.bias import causal_lower_right
                mask = causal_lower_right(tokens.shape[1], kv_len)
            else:
                mask = attention_mask(pos, kv_len if cache is not None else None)
        blocks = self.blocks if desc is None else progress(self.blocks, desc, unit="layer", delay=BLOCKS_BAR_DELAY)
        for blk in blocks:
            if cancel is not None and cancel.is_set():
                raise Cancelled()
            h = blk(h, cos, sin, pos, cache, mask, fused, keys=kv_len)
        return self.head(h[:, -1:] if last else h, norm=self.norm).float()

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def act_dtype(self) -> torch.dtype:
        """The activations' (and KV cache's) dtype: fp16 on a GPU, float32 on the CPU."""
        return torch.float16 if self.device.type == "cuda" else torch.float32

    def place(self, device: str | torch.device) -> "Transformer":
        """Move to `device`: fp16 activations and small tensors on a GPU, float32 on the CPU."""
        device = torch.device(device)
        dtype = torch.float16 if device.type == "cuda" else torch.float32
        # on a GPU, embeddings the head does not share stay in pinned host memory (one row per token is read)
        host = ops.host_embedding(self.embed) if device.type == "cuda" and not self.tied else None
        embed = self.embed.to(device, dtype) if device.type == "cuda" else self.embed.to(device)  # (see __init__)
        self.embed = nn.Parameter(embed if host is None else host, requires_grad=False)
        for n in [self.norm] + [m for b in self.blocks for m in (b.attn_norm, b.mlp_norm)]:
            n.weight = nn.Parameter(n.weight.to(device), requires_grad=False)  # norms compute in float32
        lins = list(self.linears())
        for lin in progress(lins, "moving the weights to the GPU", unit="layer") if device.type == "cuda" else lins:
            lin.place(device, dtype)
        if self.tied:
            self.head.weight = self.embed
        else:
            self.head.place(device, dtype)
        self.inv_freq = self.inv_freq.to(device)
        if device.type == "cuda":
            order = [*self.linears(), self.head]  # decode's GEMVs in launch order
            for lin, nxt in zip(order, order[1:]):
                lin.hold_next = nxt.held = holds(lin.kind, lin.nbytes, nxt.nbytes)
        return self

    def linears(self):
        for blk in self.blocks:
            yield from (blk.qkv, blk.o, blk.gate_up, blk.down)


def holds(kind: str, nbytes: int, next_nbytes: int) -> bool:
    """Whether decode's GEMV of `kind` (nbytes of weights) holds the launch of the next one (next_nbytes): where both
    are large (kernels.gemv.HOLD_BYTES), except after qkv, whose next kernel is the attention."""
    from .kernels.gemv import HOLD_BYTES
    return kind != "qkv" and min(nbytes, next_nbytes) >= HOLD_BYTES


def build_block(cfg: ModelConfig, layer: int, t: dict, settings: QdecSettings) -> Block:
    """A block from its tensors: norms + per-kind dicts of Linear arguments (see Linear.__init__)."""
    lins = {k: Linear(k, settings=settings, **t[k]) for k in KINDS}
    for lin in lins.values():
        lin.block = layer
    return Block(cfg, layer, RMSNorm(t["attn_norm"], cfg.rms_norm_eps), lins["qkv"], lins["o"],
                 RMSNorm(t["mlp_norm"], cfg.rms_norm_eps), lins["gate_up"], lins["down"])
