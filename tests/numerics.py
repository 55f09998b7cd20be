"""Error bounds derived from magnitudes and reduction lengths, for tests that compare a
computation in float32 (or 16-bit) with a float64 reference.

Why not fixed tolerances: a tolerance tuned until the suite passes on one CPU encodes that
CPU's reduction order and thread count (a test at atol 2e-4 failed on an Intel Xeon after
passing on an AMD EPYC). These bounds hold for any IEEE-conforming summation order:

* a dot product of length ``k`` computed in a format with unit roundoff ``u`` errs by at
  most ``gamma_k = k*u / (1 - k*u)`` times ``sum |x_i y_i|`` (Higham, Accuracy and
  Stability of Numerical Algorithms, 3.1) — whatever order, blocking or threads;
* a network of such reductions (first order in ``u``): each output's error is at most the
  sum, along the deepest path, of the reduction lengths, times ``u``, times the output's
  natural scale (the magnitude of the values combined). ``model_error_bound`` counts that
  path for a decoder layer stack; it is a worst-case bound (observed errors sit 10-30x
  below it), loose enough for any machine and still orders of magnitude below what a real
  bug (a wrong mask, a missed block, a dropped split) does.
"""

from __future__ import annotations

import torch

UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}


def gamma(k: int, dtype: torch.dtype) -> float:
    """Higham's ``gamma_k``: relative bound of a length-``k`` dot product (w.r.t. ``sum |x y|``)."""
    ku = k * UNIT_ROUNDOFF[dtype]
    assert ku < 0.5, f"reduction of {k} terms is too long for a first-order bound in {dtype}"
    return ku / (1 - ku)


def decoder_path_length(config, num_tokens: int) -> int:
    """Sum of reduction lengths along the deepest path of a Llama-family forward.

    Per layer: RMSNorm (hidden), qkv (hidden), scores (head_dim), softmax sum and P@V
    (context, twice), o (heads * head_dim), RMSNorm, gate/up (hidden), down (intermediate);
    then the final norm and the head (hidden).
    """
    hidden, head_dim = config.hidden_size, config.head_dim
    per_layer = (4 * hidden + head_dim + 2 * num_tokens + config.num_attention_heads * head_dim
                 + config.intermediate_size)
    return config.num_hidden_layers * per_layer + 2 * hidden


def model_error_bound(config, num_tokens: int, dtype: torch.dtype, scale: float) -> float:
    """Worst-case first-order bound on one logit's (or activation's) rounding error."""
    return decoder_path_length(config, num_tokens) * UNIT_ROUNDOFF[dtype] * max(scale, 1.0)


def assert_within(actual: torch.Tensor, reference: torch.Tensor, bound, what: str) -> None:
    """``|actual - reference| <= bound`` element-wise (``bound`` a float or a tensor), NaN fails."""
    err = (actual.double() - reference.double()).abs()
    bound_t = torch.as_tensor(bound, dtype=torch.float64)
    ok = bool(torch.all(err <= bound_t))
    if not ok:
        ratio = float((err / bound_t).nan_to_num(float("inf")).max())
        raise AssertionError(f"{what}: error up to {ratio:.3g}x the derived bound "
                             f"(max |err| {float(err.nan_to_num(float('inf')).max()):.3g})")


def _moe_act64(gate, up, clamped_swiglu, activation="silu"):
    """The experts' activation in float64 and the factors its error bound needs:
    (h, |d h / d gate| bound factor, |d h / d up| factor). |silu'| <= 1.1, |gelu_tanh'| <= 1.13."""
    if clamped_swiglu is None and activation == "gelu_tanh":
        gelu = torch.nn.functional.gelu(gate, approximate="tanh")
        return gelu * up, 1.13 * up.abs(), gelu.abs()
    if clamped_swiglu is None:
        silu = torch.nn.functional.silu(gate)
        return silu * up, 1.1 * up.abs(), silu.abs()
    alpha, limit = clamped_swiglu
    g, u = gate.clamp(max=limit), up.clamp(-limit, limit)
    glu = g * torch.sigmoid(alpha * g)  # d glu / d g = s + t s (1 - s) with t = alpha g: <= 1.1
    return (u + 1) * glu, 1.1 * (u + 1).abs(), glu.abs()


def moe_dense_reference(x, ids, weights, w13, w2, b13=None, b2=None, clamped_swiglu=None,
                        activation="silu") -> torch.Tensor:
    """Every expert on every token in float64, masked by the routing: what the sparse path must equal.
    gpt-oss: expert biases and ``clamped_swiglu=(alpha, limit)``; Gemma 4: ``activation="gelu_tanh"``."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        gate, up = (x @ w13[e].T + (0 if b13 is None else b13[e].double())).split(inter, dim=-1)
        y = _moe_act64(gate, up, clamped_swiglu, activation)[0] @ w2[e].T + (0 if b2 is None else b2[e].double())
        weight = (weights.double() * (ids == e)).sum(dim=-1, keepdim=True)
        out += weight * y
    return out


def moe_rounding_bound(x, ids, weights, w13, w2, dtype, b13=None, b2=None, clamped_swiglu=None,
                       activation="silu") -> torch.Tensor:
    """First-order bound on the sparse path's rounding error, element-wise (its inputs are exact).

    Model: a matmul accumulates in float32 and rounds its output once to ``dtype`` (unit
    roundoff u), so it errs by u |result| + n u32 (|A| |B|), n its inner size. Then
    silu(g) * u errs by 1.1 dg |u| + |silu(g)| du + 2 u |h| (|silu'| <= 1.1; silu and the
    product round once each), the down projection by |W_down| dh plus its own rounding,
    the routing weight by one rounding and the top-k sum by top_k roundings of the
    weighted outputs. Doubled for the second-order terms. gpt-oss: a bias add rounds once
    more (u |result|); its clamped SwiGLU ``(u + 1) g sigmoid(alpha g)`` has the same
    derivative bound in g (clamps are 1-Lipschitz) and rounds up to 6 times (u |h| each).
    GELU-tanh (``activation="gelu_tanh"``): |gelu_tanh'| <= 1.13, and the kernel's tanh through
    ``exp`` and a division rounds up to 4 times (u |h| each).
    """
    x, w13, w2, w = x.double(), w13.double(), w2.double(), weights.double()
    u, u32 = UNIT_ROUNDOFF[dtype], UNIT_ROUNDOFF[torch.float32]
    inter, top_k, hidden = w2.shape[2], ids.shape[1], x.shape[1]
    act_roundings = 6 if clamped_swiglu is not None else 4 if activation == "gelu_tanh" else 2
    bias_roundings = 0 if b13 is None else 1
    bound = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        gate, up = (x @ w13[e].T + (0 if b13 is None else b13[e].double())).split(inter, dim=-1)
        gate_mag, up_mag = (x.abs() @ w13[e].abs().T).split(inter, dim=-1)
        d_gate = (1 + bias_roundings) * u * gate.abs() + hidden * u32 * gate_mag
        d_up = (1 + bias_roundings) * u * up.abs() + hidden * u32 * up_mag
        h, dh_dgate, dh_dup = _moe_act64(gate, up, clamped_swiglu, activation)
        d_h = dh_dgate * d_gate + dh_dup * d_up + act_roundings * u * h.abs()
        y = h @ w2[e].T + (0 if b2 is None else b2[e].double())
        d_y = d_h @ w2[e].abs().T + (1 + (b2 is not None)) * u * y.abs() + inter * u32 * (h.abs() @ w2[e].abs().T)
        weight = (w.abs() * (ids == e)).sum(dim=-1, keepdim=True)
        bound += weight * d_y + (1 + top_k) * u * weight * y.abs()
    return 2 * bound


def delta_rule_error_bound(length: int, chunk: int, dim_k: int, dim_v: int, scale: float,
                           dtype: torch.dtype = torch.float32) -> float:
    """First-order bound on a gated delta rule output's (or state's) rounding error, after
    ``length`` tokens of one sequence, computed in ``dtype`` against an exact reference.

    Path: per token the state takes a decay, a length-``dim_k`` dot (``S^T k``), a rank-one
    update and the output a length-``dim_k`` dot, ``dim_k + dim_v + 8`` in all (the q/k
    L2 norms and the gate included); the transition ``exp(g) (I - beta k k^T)`` with unit
    ``k`` and ``beta`` in ``[0, 1]`` is a contraction, so an error made at one token is not
    amplified at later ones and the paths add up over the ``length`` tokens. The chunked
    form adds, per chunk, the ``chunk``-row triangular solve and the ``chunk x (dim_k + dim_v)``
    products. ``scale``: the magnitudes combined (max of 1, |v| and the reference's |S|).
    """
    path = length * (dim_k + dim_v + 8) + chunk * (chunk + dim_k + dim_v)
    return path * UNIT_ROUNDOFF[dtype] * max(scale, 1.0)


def hybrid_path_length(config, num_tokens: int, num_layers: int | None = None) -> int:
    """``decoder_path_length`` for a hybrid model (Qwen3-Next, Qwen3.5): each layer's token
    mixer is gated attention (as a Llama layer's, plus the output gate) or a Gated DeltaNet
    (projection, conv, L2 norms, the delta rule's path as in ``delta_rule_error_bound``, the
    gated norm, ``out_proj``); the MLP is dense or routed experts plus a shared expert."""
    hidden, head_dim = config.hidden_size, config.head_dim
    la = config.linear_attention
    attention = head_dim + 2 * num_tokens + config.num_attention_heads * head_dim + 2
    chunk = min(64, num_tokens)  # the default chunk; a shorter sequence's padding adds exact zeros
    linear = (la.conv_kernel_size + la.key_head_dim + num_tokens * (la.key_head_dim + la.value_head_dim + 8)
              + chunk * (chunk + la.key_head_dim + la.value_head_dim) + la.value_head_dim + la.value_dim)
    mlp = max(config.intermediate_size, config.moe_intermediate_size + config.shared_expert_intermediate_size
              + config.num_experts + 2 * hidden)
    layers = config.num_hidden_layers if num_layers is None else num_layers
    return layers * (4 * hidden + max(attention, linear) + mlp) + 2 * hidden
