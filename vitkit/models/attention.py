"""Multi-head self-attention of the ViT blocks: a fused (SDPA) and an explicit path that agree, and relative
position attention (paper appendix D.4) with 1-D (raster-order) or 2-D (row, column) offsets.

With a relative table each block's queries also attend to learned embeddings of the offset between patches:
``rel_pos_embed`` holds a D-wide embedding per offset (see posemb.relative_table_shape), each head reads its own
head_dim slice of it, as it does of a token's key, and these logits q_i . r_{j-i} are added to the content logits
q_i . k_j before the softmax. The class token has no position: pairs involving it get no relative term.

The explicit path in bf16 on a CPU computes its (image, head) pairs in chunks (``chunked_attention``) where their
probabilities would not fit in about a core's L2 cache: each chunk's logits, softmax and product with the values
run while its probabilities are still in cache, forward and backward, rather than each step over every pair in
turn. On 2 AMD EPYC cores (AVX512-BF16), a ViT-S/16 block's attention at batch 32 (192 pairs of 197 x 197, chunks
of 27), forward and backward, ran 1.07x and 1.14x faster than unchunked in two runs, and a bf16-autocast
training step 1.019x and 1.017x (benchmarks/attention_chunks.py); ViT-B/16 inference at batch 8 ran as fast
(0.994x, 1.000x), but holds one chunk's probabilities at a time instead of every pair's. The same bits as the
path unchunked where the scale 1/sqrt(head_dim) is a power of two (it multiplies the logits inside the product
instead of q before it); otherwise one rounding fewer. With a single query (the class-token-only last block, whose
pairs rarely fill more than one chunk) the products are one row each, which oneDNN sums in another order for
another number of pairs in a batch: a few inputs in a hundred then differ by a rounding, within 1.6 bf16 steps of
the largest value over 600 random cases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..device import cpu_autocast_is_bf16
from .linear import dense, has_hooks, linear
from .merge import size_bias
from .posemb import Grid, resample_relative
from .transforms import transformed, transformed_backward

ATTN_IMPLS = ("auto", "sdpa", "explicit")
CHUNK_BYTES = 2**21  # the probabilities of one chunk of (image, head) pairs: about a core's L2 cache


def attention_chunk(q: torch.Tensor, k: torch.Tensor, budget: int | None = CHUNK_BYTES) -> int | None:
    """(image, head) pairs a chunk of ``chunked_attention`` holds for queries q (B, nh, n, hd) and keys k (B, nh, N,
    hd), their probabilities at most ``budget`` bytes (but one pair); None where it does not run: anywhere but bf16
    on a CPU outside traced graphs and torch.func transforms, where one chunk would hold every pair (nothing to
    gain), and with no budget."""
    if budget is None or q.device.type != "cpu" or q.dtype != torch.bfloat16 or torch.compiler.is_compiling():
        return None
    if transformed():
        return None
    B, nh, n, _ = q.shape
    per_pair = n * k.shape[2] * q.element_size()
    return None if B * nh * per_pair <= budget else max(1, budget // per_pair)


def _chunked_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, chunk: int, keep: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """softmax(scale q k^T) v over (pairs, tokens, head_dim) tensors, ``chunk`` pairs at a time; with ``keep`` the
    probabilities of every pair too (for the backward pass), else only a chunk's at a time."""
    pairs, n, N = q.shape[0], q.shape[1], k.shape[1]
    logits = q.new_empty(min(chunk, pairs), n, N)
    probs = q.new_empty(pairs if keep else min(chunk, pairs), n, N)
    out = q.new_empty(pairs, n, v.shape[2])
    for s in range(0, pairs, chunk):
        e = min(s + chunk, pairs)
        z, p = logits[: e - s], probs[s:e] if keep else probs[: e - s]
        torch.baddbmm(z, q[s:e], k[s:e].transpose(1, 2), beta=0, alpha=scale, out=z)  # beta=0: z is not read
        torch.softmax(z, -1, out=p)
        torch.bmm(p, v[s:e], out=out[s:e])
    return out, probs if keep else None


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, chunk: int) -> torch.Tensor:
        out, probs = _chunked_forward(q, k, v, scale, chunk, keep=True)
        ctx.save_for_backward(q, k, v, probs)
        ctx.scale, ctx.chunk = scale, chunk
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, probs = ctx.saved_tensors
        if transformed_backward(grad):  # a transform over the backward pass (is_grads_batched): torch's ops, no out=
            dz = torch._softmax_backward_data(grad @ v.transpose(1, 2), probs, -1, probs.dtype)
            return ctx.scale * dz @ k, ctx.scale * dz.transpose(1, 2) @ q, probs.transpose(1, 2) @ grad, None, None
        grad = grad.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        pairs, chunk, scale = q.shape[0], ctx.chunk, ctx.scale
        dp = q.new_empty(min(chunk, pairs), q.shape[1], k.shape[1])
        for s in range(0, pairs, chunk):
            e = min(s + chunk, pairs)
            p, g, d = probs[s:e], grad[s:e], dp[: e - s]
            torch.bmm(p.transpose(1, 2), g, out=dv[s:e])
            torch.bmm(g, v[s:e].transpose(1, 2), out=d)
            dz = torch._softmax_backward_data(d, p, -1, p.dtype)  # the logits' gradient
            torch.baddbmm(dq[s:e], dz, k[s:e], beta=0, alpha=scale, out=dq[s:e])
            torch.baddbmm(dk[s:e], dz.transpose(1, 2), q[s:e], beta=0, alpha=scale, out=dk[s:e])
        return dq, dk, dv, None, None


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, chunk: int) -> torch.Tensor:
    """softmax(scale q k^T) v for q (B, nh, n, hd), k and v (B, nh, N, hd), ``chunk`` (image, head) pairs at a time
    (``attention_chunk``): (B, nh, n, hd), contiguous. The probabilities are kept for the backward pass only where
    autograd records it; a gradient of the gradient is refused."""
    B, nh, n, hd = q.shape
    q, k, v = (t.contiguous().view(B * nh, -1, hd) for t in (q, k, v))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out = _ChunkedAttention.apply(q, k, v, scale, chunk)
    else:
        out = _chunked_forward(q, k, v, scale, chunk, keep=False)[0]
    return out.view(B, nh, n, hd)


class _OneRowProduct(torch.autograd.Function):
    """a @ b for a with one row (B, nh, 1, K): b's gradient a^T g is a product over K = 1, which the batched gemm
    computes one pair at a time (132 us for the main job's 256 pairs of 17 x 1 by 1 x 16 on 2 AMD EPYC cores) and
    a broadcast multiply in one pass (12 us), with the same numbers: each element is one product, rounded once. The
    backward pass is torch's ops, which autograd records where it builds a graph: a gradient of the gradient is
    the product's."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a, b = ctx.saved_tensors
        da = grad @ b.transpose(-2, -1) if ctx.needs_input_grad[0] else None
        db = a.transpose(-2, -1) * grad if ctx.needs_input_grad[1] else None
        return da, db


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of the written-out attention; for a one-row a in fp32 training on a CPU (the class-token-only last
    block's query and probabilities), through _OneRowProduct, but in traced graphs and under torch.func transforms
    and forward-mode AD (``transforms.transformed``)."""
    one_row = a.shape[-2] == 1 and a.device.type == "cpu" and a.dtype == b.dtype == torch.float32
    recorded = torch.is_grad_enabled() and b.requires_grad and not torch.is_autocast_enabled("cpu")
    if one_row and recorded and not torch.compiler.is_compiling() and not transformed():
        return _OneRowProduct.apply(a, b)
    return a @ b


def attends_explicitly(attn_impl: str, x: torch.Tensor) -> bool:
    """Whether a forward with this attn_impl runs the attention written out rather than SDPA; x: its input.

    "auto" is SDPA except where attention computes in bf16 on a CPU (a bf16 input, or CPU autocast to bf16):
    there the written-out path (bf16 batched matmuls and a softmax) ran faster than SDPA's CPU kernel, ViT-B/16
    inference 1.05-1.08x at batch 1, 8 and 64, eager and compiled, and a ViT-S/16 bf16-autocast training step
    1.08-1.11x (2 AVX512-BF16 cores), with the same top-1 and a mean logit error against fp32 within 6% of SDPA's
    on trained digits models. In fp32 SDPA trained ViT-S/16 faster (the written-out path at 0.93x) and inferred
    as fast; on CUDA it is flash attention.
    """
    if attn_impl != "auto":
        return attn_impl == "explicit"
    if x.device.type != "cpu":
        return False
    return x.dtype == torch.bfloat16 or cpu_autocast_is_bf16()


@dataclass(frozen=True)
class RelativePositions:
    """One call's token layout as relative position attention reads it; encode builds it once for all blocks."""

    index: torch.Tensor  # (N, N) long: the offset-table row that query patch i and key patch j read
    table_shape: tuple[int, ...]  # offset axes for this grid: (2N - 1,) or (2 gh - 1, 2 gw - 1)
    grid: Grid  # this call's patch grid (gh, gw)
    table_grid: Grid  # the grid the model's tables were built for: another grid's table is resampled from it
    prefix: int  # tokens before the patches (the class token): pairs involving them get no relative term


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection. q, k, v and out all have biases.

    With ``rel_table`` (the offset axes of a token grid, see posemb.relative_table_shape) it is relative position
    attention, ``rel_pos_embed`` its (*offsets, D) table of learned offset embeddings.

    ``attend_dtype``, when set on an instance, is the dtype its attention computes in, written out whatever path the
    caller asks for: q, k and v are cast to it and the output back. vitkit.fast's int8 models set bf16 where bf16
    matmuls are native: there the written-out bf16 attention is the fastest on the CPU, and int8 has no kernel
    for it.

    ``chunk_bytes``: the written-out path's budget for the probabilities of one chunk (``attention_chunk``); None on
    an instance computes every pair at once.
    """

    attend_dtype: torch.dtype | None = None
    chunk_bytes: int | None = CHUNK_BYTES

    def __init__(
        self,
        dim: int,
        num_heads: int,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        rel_table: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = attn_drop
        self.proj_drop = nn.Dropout(proj_drop)
        # (*offsets, D). In a class-token model the last block's table gets no gradient from the logits (the class
        # token, the only query forward computes there, has no relative term), but it is no dead weight: every
        # patch token's output reads it, and so do the losses on them (masked patch prediction, train/mpp.py),
        # features (forward_features), attention maps and a 'gap' or 'map' head fine-tuned from the checkpoint.
        self.rel_pos_embed: nn.Parameter | None = nn.Parameter(torch.zeros(*rel_table, dim)) if rel_table else None

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # unbind along the (B, N, 3, nh, hd) layout itself: in backward the three gradients are stacked straight
        # into the qkv output's layout, where permuting first would cost an extra copy of them
        B, N, C = x.shape
        q, k, v = dense(self.qkv, x).reshape(B, N, 3, self.num_heads, self.head_dim).unbind(2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # 3 x (B, nh, N, hd)

    def _out(self, x: torch.Tensor) -> torch.Tensor:
        B, nh, N, hd = x.shape
        return self.proj_drop(dense(self.proj, x.transpose(1, 2).reshape(B, N, nh * hd)))  # (no -1: B may be 0)

    def _q_kv(self, x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries of the first n tokens, keys and values of all: the qkv matmul split by rows of its weight."""
        if type(self.qkv) is not nn.Linear or has_hooks(self.qkv):
            # a wrapped projection (LoRA, quantised, ...) or one with hooks, which its call runs: called as it is
            # (global module hooks, which FLOP counters and trackers install, do not change what is computed)
            q, k, v = self._qkv(x)
            return q[:, :, :n], k, v
        B, N, C = x.shape
        w, b = self.qkv.weight, self.qkv.bias
        q = linear(x[:, :n], w[:C], b[:C]).reshape(B, n, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = linear(x, w[C:], b[C:]).reshape(B, N, 2, self.num_heads, self.head_dim).unbind(2)
        return q, k.transpose(1, 2), v.transpose(1, 2)

    def _relative_logits(self, q: torch.Tensor, rel: RelativePositions) -> torch.Tensor | None:
        """The relative logits of queries of the first n tokens (B, nh, n, hd) against all T keys: (B, nh, n, T).

        q comes scaled by 1/sqrt(hd), so the bias is scaled as the content logits are (SDPA scales q k^T but not
        its mask). Rows and columns of the class token are zero; None when no query is a patch.
        """
        if self.rel_pos_embed is None:
            raise RuntimeError("relative positions given to an attention layer without a relative table")
        B, nh, n, hd = q.shape
        qp = q[:, :, rel.prefix :]  # (B, nh, n_p, hd): the patch queries
        n_p = qp.shape[2]
        if n_p == 0:
            return None
        # another grid than the model's: a resampled table
        table = resample_relative(self.rel_pos_embed, rel.table_shape, rel.table_grid, rel.grid)
        table = table.reshape(-1, nh, hd).transpose(0, 1).to(q.dtype)  # (nh, E, hd), E offsets
        logits = qp @ table.transpose(1, 2)  # (B, nh, n_p, E): each query against every offset's embedding
        bias = logits.gather(-1, rel.index[:n_p].expand(B, nh, -1, -1))  # (B, nh, n_p, N): q_i . r_{j-i}
        return F.pad(bias, (rel.prefix, 0, n - n_p, 0))  # (B, nh, n, T)

    def _logit_bias(
        self, q: torch.Tensor, rel: RelativePositions | None, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """What both attention paths add to the logits of queries q (scaled): the relative logits, if any, plus
        bias (proportional attention's); None when there is neither."""
        rel_bias = None if rel is None else self._relative_logits(q, rel)
        if rel_bias is None or bias is None:
            return bias if rel_bias is None else rel_bias
        return rel_bias + bias

    def forward(
        self,
        x: torch.Tensor,
        out_tokens: int | None = None,
        rel: RelativePositions | None = None,
        explicit: bool = False,
        sizes: torch.Tensor | None = None,
        keys: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """(B, N, D) -> (B, N, D), or (B, out_tokens, D): the outputs of the first out_tokens tokens only.

        ``explicit``: the attention written out (``_attend``) instead of SDPA. The same function; on a CPU it trains
        a model of few tokens faster, where the fused kernel's fixed cost per (image, head) outweighs its work.
        ``sizes`` (B, N, 1): how many patches each token stands for after token merging (vitkit.models.merge);
        each key's logits get log size added (proportional attention). ``keys``, when given, receives the keys
        averaged over heads (B, N, head_dim): token merging's similarity metric."""
        q, k, v = self._qkv(x) if out_tokens is None else self._q_kv(x, out_tokens)
        if keys is not None:
            keys.append(k.mean(1))
        if explicit or self.attend_dtype is not None:
            return self._out(self._attend(q, k, v, rel, size_bias(sizes), need_probs=False)[0])
        bias = self._logit_bias(q * self.scale, rel, size_bias(sizes)) if rel is not None else size_bias(sizes)
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=self.attn_drop if self.training else 0.0)
        return self._out(x)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rel: RelativePositions | None,
        bias: torch.Tensor | None = None,
        need_probs: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """softmax(q k^T / sqrt(d) [+ relative logits] [+ bias]) v written out: the output (B, nh, n, hd) in q's dtype
        and the probabilities (B, nh, n, N), computed in attend_dtype where it is set. ``bias``: added to the logits,
        broadcast (proportional attention's). ``need_probs=False``: the caller needs the output alone, which then runs
        in chunks where ``attention_chunk`` says so (no relative logits, bias or attention dropout), and the
        probabilities come back as None."""
        dtype = q.dtype
        if self.attend_dtype is not None:
            q, k, v = (t.to(self.attend_dtype) for t in (q, k, v))
            bias = None if bias is None else bias.to(self.attend_dtype)
        dropout = self.attn_drop and self.training
        if not need_probs and rel is None and bias is None and not dropout:
            chunk = attention_chunk(q, k, self.chunk_bytes)
            if chunk is not None:
                return chunked_attention(q, k, v, self.scale, chunk).to(dtype), None
        q = q * self.scale
        logits = _product(q, k.transpose(-2, -1))  # (B, nh, n, N)
        bias = self._logit_bias(q, rel, bias)
        probs = (logits if bias is None else logits + bias).softmax(dim=-1)
        attn = F.dropout(probs, self.attn_drop, self.training) if self.attn_drop else probs
        return _product(attn, v).to(dtype), probs

    def forward_explicit(
        self, x: torch.Tensor, rel: RelativePositions | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The explicit path for every token, also returning the attention probabilities (B, nh, N, N); with
        attend_dtype set, in the output's dtype."""
        out, probs = self._attend(*self._qkv(x), rel)
        assert probs is not None  # asked for
        return self._out(out), probs if self.attend_dtype is None else probs.to(out.dtype)
