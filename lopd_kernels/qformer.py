"""QFormer latent compressor (paper 3.2, A.1): K learned queries attend to packed hidden states.

Each item ``j`` of a batch (a retrieved experience encoded to hidden states ``H_j [T_j, d]``) is
compressed into ``K`` latent tokens by ``L`` pre-norm blocks::

    x_0 = Q                                                  [K, d] learned queries (per item)
    x   = x + W_o Attn(W_q LN_q(x), W_k LN_kv(H_j), W_v LN_kv(H_j))
    x   = x + FFN(LN_f(x))                                   FFN: d -> ffn_mult*d -> d
    E_j = LN_out(x_L)                                        [K, d]

The items are packed (``hidden_states [sum_j T_j, d]`` with ``cu_seqlens``) and attended with
:func:`lopd_kernels.varlen_cross_attention`: no padding to the longest item, no mask.

**Shared layers.** The paper ties the weights of all ``L`` layers. ``H_j`` is the same input to
every layer, so ``LN_kv(H_j)``, ``K_j = LN_kv(H_j) W_k`` and ``V_j = LN_kv(H_j) W_v`` are
identical in all of them: this module computes them once per forward and passes the same tensors
to the ``L`` attention calls. Autograd then sums the ``L`` layers' ``dK``, ``dV`` into one
gradient buffer before running the ``W_k``/``W_v``/``LN_kv`` backward once, and the saved
activations of the key/value side (``LN_kv(H)``, ``K``, ``V``: ``3 * sum_j T_j * d`` values)
exist once instead of ``L`` times. Only the ``K``-row query side is per layer. With
``share_layers=False`` each layer has its own weights and projects ``H`` itself.

**Queries.** The paper initializes them "from N(0, 1/sqrt(d))". We read the second argument as the
*variance* (the usual N(mu, sigma^2) notation), i.e. ``std = d ** -0.25``: then ``|q|^2 ~ sqrt(d)``,
between unit-variance entries (``|q|^2 ~ d``) and the ``1/sqrt(d)``-std convention of BLIP-2.

**Perceiver option.** ``perceiver=True`` lets the latents also attend to themselves, as in the
Perceiver Resampler and the authors' code: keys/values over ``concat(LN_kv(H_j), LN_q(x_j))``. The
``H`` part is still projected once; the latent part (``K`` rows per item) is attended separately
and the two softmaxes are merged exactly through their log-sum-exps, so no per-layer concatenated
``[T_j + K]`` key tensor is ever built or saved.

The FFN activation is GELU (exact erf form, as BLIP-2's Q-Former) unless ``activation="silu"``; the
paper does not name one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lopd_kernels.varlen_cross_attention import varlen_cross_attention

__all__ = ["QFormerCompressor", "straightforward_qformer"]

_ACTIVATIONS = {"gelu": nn.GELU, "silu": nn.SiLU}


class QFormerLayer(nn.Module):
    """One pre-norm cross-attention + FFN block (weights of one layer; shared ones are reused).

    Args:
        hidden_size: Model width ``d``.
        num_heads: Query heads ``Hq``; head dim ``D = d // Hq``.
        num_kv_heads: Key/value heads ``Hkv`` (``Hq % Hkv == 0``).
        ffn_mult: FFN hidden width ``ffn_mult * d``.
        activation: ``"gelu"`` or ``"silu"``.
        norm_eps: LayerNorm epsilon.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        ffn_mult: int,
        activation: str,
        norm_eps: float,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = hidden_size // num_heads
        d, dq, dkv = hidden_size, num_heads * self.head_dim, num_kv_heads * self.head_dim
        self.norm_q = nn.LayerNorm(d, eps=norm_eps)
        self.norm_kv = nn.LayerNorm(d, eps=norm_eps)
        self.q_proj = nn.Linear(d, dq)
        self.k_proj = nn.Linear(d, dkv)
        self.v_proj = nn.Linear(d, dkv)
        self.o_proj = nn.Linear(dq, d)
        self.norm_ffn = nn.LayerNorm(d, eps=norm_eps)
        self.ffn = nn.Sequential(
            nn.Linear(d, ffn_mult * d), _ACTIVATIONS[activation](), nn.Linear(ffn_mult * d, d)
        )

    def project_kv(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[total, d]`` -> keys and values ``[total, Hkv, D]`` of ``LN_kv(hidden_states)``."""
        h = self.norm_kv(hidden_states)
        shape = (hidden_states.shape[0], self.num_kv_heads, self.head_dim)
        return self.k_proj(h).view(shape), self.v_proj(h).view(shape)

    def forward(
        self,
        x: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int | None,
        perceiver: bool,
        backend: str,
    ) -> torch.Tensor:
        """Latents ``x [B, K, d]``, keys/values ``[total, Hkv, D]`` -> new latents ``[B, K, d]``."""
        batch, n_lat, _ = x.shape
        h = self.norm_q(x)
        q = self.q_proj(h).view(batch, n_lat, self.num_heads, self.head_dim)
        if not perceiver:
            attn = varlen_cross_attention(
                q, k, v, cu_seqlens, max_seqlen_k=max_seqlen, backend=backend
            )
        else:
            attn_h, lse_h = varlen_cross_attention(
                q, k, v, cu_seqlens, max_seqlen_k=max_seqlen, backend=backend, return_lse=True
            )
            # The latents as extra keys: K rows per item, attended as a second varlen call.
            kv_shape = (batch * n_lat, self.num_kv_heads, self.head_dim)
            k_lat, v_lat = self.k_proj(h).view(kv_shape), self.v_proj(h).view(kv_shape)
            cu_lat = torch.arange(0, (batch + 1) * n_lat, n_lat, dtype=torch.int32, device=x.device)
            attn_l, lse_l = varlen_cross_attention(
                q, k_lat, v_lat, cu_lat, max_seqlen_k=n_lat, backend=backend, return_lse=True
            )
            # softmax over the union of both key sets = lse-weighted mix of the two softmaxes.
            # lse_l is finite, so lse is finite and an empty H_j gets weight exp(-inf) = 0.
            lse = torch.logaddexp(lse_h, lse_l)  # [B, Hq, K]
            w_h = torch.exp(lse_h - lse).transpose(1, 2).unsqueeze(-1).to(q.dtype)
            w_l = torch.exp(lse_l - lse).transpose(1, 2).unsqueeze(-1).to(q.dtype)
            attn = w_h * attn_h + w_l * attn_l
        x = x + self.o_proj(attn.reshape(batch, n_lat, self.num_heads * self.head_dim))
        return x + self.ffn(self.norm_ffn(x))


class QFormerCompressor(nn.Module):
    """Compress packed variable-length hidden states into ``K`` latent tokens per item.

    Args:
        hidden_size: Width ``d`` of the hidden states and of the latents (the backbone's).
        num_heads: Attention heads (the backbone's); head dim ``d // num_heads``.
        num_kv_heads: Key/value heads for grouped-query attention; ``num_heads`` when ``None``.
        num_queries: Latent tokens ``K`` per item.
        num_layers: Blocks ``L``.
        ffn_mult: FFN width multiplier.
        share_layers: One set of weights for all ``L`` blocks (the paper); K/V of ``H`` are then
            computed once per forward.
        perceiver: Latents also attend to themselves (keys over ``concat(H_j, latents_j)``).
        activation: FFN activation, ``"gelu"`` (default) or ``"silu"``.
        norm_eps: LayerNorm epsilon.
        backend: Attention backend passed to :func:`lopd_kernels.varlen_cross_attention`.

    Shapes:
        ``forward(hidden_states [total, d], cu_seqlens [B+1] int32) -> latents [B, K, d]``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        num_queries: int = 32,
        num_layers: int = 8,
        ffn_mult: int = 4,
        share_layers: bool = True,
        perceiver: bool = False,
        *,
        activation: str = "gelu",
        norm_eps: float = 1e-5,
        backend: str = "auto",
    ):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        for name, value in (
            ("hidden_size", hidden_size),
            ("num_heads", num_heads),
            ("num_kv_heads", num_kv_heads),
            ("num_queries", num_queries),
            ("num_layers", num_layers),
            ("ffn_mult", ffn_mult),
        ):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads")
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}"
            )
        self.hidden_size = hidden_size
        self.num_queries = num_queries
        self.num_layers = num_layers
        self.share_layers = share_layers
        self.perceiver = perceiver
        self.backend = backend
        self.queries = nn.Parameter(torch.empty(num_queries, hidden_size))
        n_blocks = 1 if share_layers else num_layers
        self.layers = nn.ModuleList(
            QFormerLayer(hidden_size, num_heads, num_kv_heads, ffn_mult, activation, norm_eps)
            for _ in range(n_blocks)
        )
        self.final_norm = nn.LayerNorm(hidden_size, eps=norm_eps)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Queries ~ N(0, var = 1/sqrt(d)); linears ~ N(0, 0.02^2) with zero bias; LN = identity."""
        nn.init.normal_(self.queries, std=self.hidden_size**-0.25)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def layer(self, i: int) -> QFormerLayer:
        """The weights used by block ``i`` (the same module for every ``i`` when shared)."""
        return self.layers[0 if self.share_layers else i]

    def forward(
        self,
        hidden_states: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int | None = None,
    ) -> torch.Tensor:
        """Compress each item's hidden states into ``K`` latents.

        Args:
            hidden_states: ``[total, d]`` hidden states of all items packed back to back; cast to
                the module's parameter dtype.
            cu_seqlens: ``[B+1]`` int32 item boundaries (an empty item yields the latents of
                attention over nothing: the FFN path of the queries alone).
            max_seqlen: Longest item, if known (saves a device sync on GPU).

        Returns:
            ``[B, K, d]`` latents.
        """
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 2:
            raise ValueError(
                f"hidden_states must be a [total, d] tensor, got "
                f"{getattr(hidden_states, 'shape', type(hidden_states))}"
            )
        if hidden_states.shape[1] != self.hidden_size:
            raise ValueError(
                f"hidden_states width {hidden_states.shape[1]} != hidden_size {self.hidden_size}"
            )
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or not len(cu_seqlens):
            raise ValueError("cu_seqlens must be a non-empty [B+1] int32 tensor")
        hidden_states = hidden_states.to(self.queries.dtype)
        batch = cu_seqlens.numel() - 1
        x = self.queries.unsqueeze(0).expand(batch, -1, -1)
        kv = None
        for i in range(self.num_layers):
            layer = self.layer(i)
            if kv is None or not self.share_layers:
                kv = layer.project_kv(hidden_states)  # once in total when shared
            x = layer(x, *kv, cu_seqlens, max_seqlen, self.perceiver, self.backend)
        return self.final_norm(x)


def straightforward_qformer(
    module: QFormerCompressor,
    hidden_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    padded: bool = True,
) -> torch.Tensor:
    """The usual QFormer computation with ``module``'s weights: the baseline and the test oracle.

    Every layer recomputes ``LN_kv(H)`` and its K/V projections (as BLIP-2, open_flamingo and
    perceiver-pytorch do), and attention is ordinary SDPA:

    * ``padded=True``: items padded to the longest one, ``[B, T_max, d]``, with a key-padding mask
      (the batched baseline of the benchmark);
    * ``padded=False``: a Python loop over items, unpadded (the test oracle; float64-capable).

    Args:
        module: Supplies the weights and the configuration.
        hidden_states: ``[total, d]``.
        cu_seqlens: ``[B+1]`` int32.
        padded: Batched with padding + mask, or looped per item.

    Returns:
        ``[B, K, d]``, equal to ``module(hidden_states, cu_seqlens)`` up to rounding.
    """
    hidden_states = hidden_states.to(module.queries.dtype)
    bounds = cu_seqlens.tolist()
    batch, d = len(bounds) - 1, module.hidden_size
    lengths = [bounds[b + 1] - bounds[b] for b in range(batch)]
    if padded:
        t_max = max(max(lengths, default=0), 1)
        items = [hidden_states[bounds[b] : bounds[b + 1]] for b in range(batch)]
        h_pad = torch.nn.utils.rnn.pad_sequence(
            [*items, hidden_states.new_zeros(t_max, d)], batch_first=True
        )[:batch]
        valid = torch.arange(t_max, device=hidden_states.device)[None, :] < torch.tensor(
            lengths, device=hidden_states.device
        ).view(-1, 1)  # [B, T_max]
    x = module.queries.unsqueeze(0).expand(batch, -1, -1)
    for i in range(module.num_layers):
        layer = module.layer(i)
        hq, hkv, hd = layer.num_heads, layer.num_kv_heads, layer.head_dim
        h = layer.norm_q(x)
        q = layer.q_proj(h).view(batch, h.shape[1], hq, hd).transpose(1, 2)  # [B, Hq, K, D]
        if padded:
            kv_in = layer.norm_kv(h_pad)
            k = layer.k_proj(kv_in).view(batch, t_max, hkv, hd).transpose(1, 2)
            v = layer.v_proj(kv_in).view(batch, t_max, hkv, hd).transpose(1, 2)
            mask = valid
            if module.perceiver:
                lat_shape = (batch, h.shape[1], hkv, hd)
                k = torch.cat([k, layer.k_proj(h).view(lat_shape).transpose(1, 2)], 2)
                v = torch.cat([v, layer.v_proj(h).view(lat_shape).transpose(1, 2)], 2)
                mask = torch.cat([valid, valid.new_ones(batch, h.shape[1])], 1)
            # An empty item's all-False mask row would make softmax 0/0: let it attend to its
            # (finite) padding and zero the result instead.
            has_keys = mask.any(1)
            safe_mask = mask | ~has_keys[:, None]
            attn = F.scaled_dot_product_attention(
                q, k, v, attn_mask=safe_mask[:, None, None, :], enable_gqa=hq != hkv
            )
            attn = attn * has_keys.view(-1, 1, 1, 1).to(attn.dtype)
        else:
            outs = []
            for b in range(batch):
                kv_in = layer.norm_kv(hidden_states[bounds[b] : bounds[b + 1]])
                if module.perceiver:
                    kv_in = torch.cat([kv_in, h[b]], 0)
                if kv_in.shape[0] == 0:
                    outs.append(torch.zeros_like(q[b]))
                    continue
                kb = layer.k_proj(kv_in).view(-1, hkv, hd).transpose(0, 1)
                vb = layer.v_proj(kv_in).view(-1, hkv, hd).transpose(0, 1)
                outs.append(F.scaled_dot_product_attention(q[b], kb, vb, enable_gqa=hq != hkv))
            attn = torch.stack(outs, 0) if outs else torch.zeros_like(q)
        x = x + layer.o_proj(attn.transpose(1, 2).reshape(batch, x.shape[1], hq * hd))
        x = x + layer.ffn(layer.norm_ffn(x))
    return module.final_norm(x)
