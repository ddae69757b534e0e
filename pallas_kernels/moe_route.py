"""Mixture-of-experts routing: the router product and each token's top-k experts in one op.

``moe_route(x, router, bias, top_k=k, scoring=...)`` returns ``(idx int32 [T, k], weight float32
[T, k])``: each token's ``k`` chosen experts (best first) and their gate weights, from the router
logits ``logits = x @ router`` (``x [T, d]``, ``router [d, E]``; both widened to float32: every
product exact, the sums in float32).

The rule (:func:`select_experts`, written once; every implementation computes it):

* ``scoring="softmax"`` (Mixtral, Granite): the ``k`` largest logits; the weights are the softmax
  over those ``k`` logits.
* ``scoring="sigmoid"`` (DeepSeek-V3, Nemotron-H): ``scores = sigmoid(logits)``; the
  choice is made on ``scores + bias`` (``bias [E]``, optional), restricted to the ``topk_group``
  best of ``n_group`` equal groups of consecutive experts (at least 2 each), a group scored by
  the sum of its two best choice values; the weights are the chosen
  experts' ``scores``, divided by their sum (plus 1e-20) if ``renormalize``, times ``scale``.
* Ties go to the lower expert (and the lower group), as ``jax.lax.top_k`` orders them.
* Non-finite values: a -inf choice value ranks below every finite one (ties among them to the
  lower expert, as above). A NaN in a token's logits or ``bias`` leaves that token's choice
  and weights unspecified (implementations differ), but every implementation still names
  ``k`` distinct experts in ``[0, E)``.

Implementations (:mod:`pallas_kernels.backend`; a TPU choice runs the reference):

* reference (jnp): the product (:func:`_logits`: IEEE float32 with ``Precision.HIGHEST``; on a
  GPU, ``x`` and ``router`` of one half-precision dtype on the tensor cores, the same exact
  products summed in float32), then :func:`select_experts`.
* GPU (Pallas Triton), for calls of at most ``gpu_max_tokens`` tokens (larger ones, and a
  ``d`` of 0, run the reference): with ``split`` 1, program ``i`` accumulates the ``[BLOCK_T, E]`` logits
  of :data:`BLOCK_T` tokens over ``d`` and routes them; with ``split`` ``S > 1`` a first launch of
  ``S`` programs per token block writes ``S`` partial products over slices of ``d`` (a decode
  step's one token then reads the router with ``S`` programs, not one) and a routing program
  (one warp, as few tokens as the call has, up to :data:`BLOCK_T`) adds them in order. Every
  product is exact (:func:`_product_terms`: a float32 ``x`` meets a bfloat16 router as three
  bfloat16 parts on the tensor cores), summed in float32. The selection is ``k`` rounds of a row maximum over the ``E`` lanes (a
  lane mask for the groups). The sums over ``d`` run in another order and the exponential is
  Triton's, so the weights agree with the reference to float32 rounding, not bitwise; a choice
  differs only where two candidates tie to that rounding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import backend as _backend
from pallas_kernels import contract as validation
from pallas_kernels import gpu_tiling

__all__ = ["MoERouteConfig", "SCORINGS", "check_rule", "moe_route", "select_experts"]

OP_MOE_ROUTE = "moe_route"

#: ``scoring`` names.
SCORINGS = ("softmax", "sigmoid")

#: Added to the sum of the chosen scores before ``renormalize`` divides by it.
RENORM_EPS = 1e-20


#: Tokens of a product program (Triton products need >= 16 rows), depth of one product step
#: over ``d``, and the warps of a product program and of a routing program.
BLOCK_T, BLOCK_K, PRODUCT_WARPS, SELECT_WARPS = 16, 128, 4, 1


@dataclasses.dataclass(frozen=True)
class MoERouteConfig:
    """Tuning knobs of the GPU kernel (a static argument).

    Attributes:
      gpu_split: programs that share one token block's product over ``d`` (a power of two; 1:
        the routing program computes it itself). None: ``cdiv(d, 128)``, at most 16.
      gpu_max_tokens: the most tokens the kernel takes; a larger call runs the reference's XLA
        product and top-k. On an H200 (DeepSeek-V2-Lite's router) the kernel took 6.0-7.2 us at
        1-4 tokens against XLA's 9.6-9.8, the same at 8, and more at 16 and 64 (BENCHMARKS.md's
        H200 notes, item 47).
    """

    gpu_split: int | None = None
    gpu_max_tokens: int = 4

    def __post_init__(self):
        validation.check_config_ints(self, ("gpu_split",))


def check_rule(num_experts: int, top_k, scoring, n_group=1, topk_group=1, renormalize=True, scale=1.0,
               *, where: str = "", names: dict | None = None) -> dict:
    """The routing rule's parameters (one owner; the loaders call it with their config field
    names): ``top_k``, ``n_group``, ``topk_group`` ints >= 1; ``num_experts`` split into
    ``n_group`` groups, each of at least 2 experts when there are groups (a group's score is the
    sum of its two best, as transformers' DeepSeek-V3 and Nemotron-H routers take it);
    ``topk_group <= n_group``; ``top_k`` at most the experts of ``topk_group`` groups;
    softmax has no groups, no renormalising choice and no scale; ``renormalize`` a bool;
    ``scale`` a finite number > 0 (a routed-scaling factor). ``ValueError``
    prefixed by ``where``, each parameter called ``names.get(name, name)``. Returns the rule as
    :func:`moe_route`'s static keywords (plain ints, a float scale)."""
    n = {"num_experts": "num_experts", "top_k": "top_k", "n_group": "n_group",
         "topk_group": "topk_group", "renormalize": "renormalize", "scale": "scale", **(names or {})}
    at = f"{where}: " if where else ""
    if scoring not in SCORINGS:
        raise ValueError(f"{at}scoring must be one of {SCORINGS}, got {scoring!r}")
    top_k, n_group, topk_group = (validation.static_int(f"{at}{n[name]}", v) for name, v in
                                  (("top_k", top_k), ("n_group", n_group), ("topk_group", topk_group)))
    E, G = num_experts, n_group
    if top_k > E:
        raise ValueError(f"{at}{n['top_k']}={top_k} must be <= {n['num_experts']}={E}")
    if E % G or (G > 1 and E // G < 2):
        raise ValueError(f"{at}{n['num_experts']}={E} must split into {n['n_group']}={G} groups of at least "
                         f"2 experts (a group's score is its top-2 sum)")
    if topk_group > G:
        raise ValueError(f"{at}{n['topk_group']}={topk_group} must be <= {n['n_group']}={G}")
    if top_k > topk_group * (E // G):
        raise ValueError(f"{at}{n['top_k']}={top_k} exceeds the {topk_group * (E // G)} experts of "
                         f"{n['topk_group']}={topk_group} groups")
    if scoring == "softmax" and (G != 1 or topk_group != 1):
        raise ValueError(f"{at}softmax scoring has no expert groups: {n['n_group']} and {n['topk_group']} "
                         f"must be 1, got {G} and {topk_group}")
    if not isinstance(renormalize, bool):
        raise ValueError(f"{at}{n['renormalize']} must be a bool, got {renormalize!r}")
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)) \
            or not np.isfinite(float(scale)) or scale <= 0:
        raise ValueError(f"{at}{n['scale']} must be a finite number > 0, got {scale!r}")
    if scoring == "softmax" and (not renormalize or float(scale) != 1.0):
        raise ValueError(f"{at}softmax scoring's weights are the softmax over the top_k logits: "
                         f"{n['renormalize']} must be True and {n['scale']} 1, got {renormalize} and {scale!r}")
    return dict(top_k=top_k, scoring=scoring, n_group=n_group, topk_group=topk_group,
                renormalize=renormalize, scale=float(scale))


def _check_bias(bias, scoring: str, E: int) -> None:
    if bias is None:
        return
    if scoring != "sigmoid":
        raise ValueError(f"bias is for scoring='sigmoid', got it with scoring={scoring!r}")
    validation.check_rank("bias", bias, 1)
    validation.check_shape("bias", bias, (E,))
    validation.check_dtype("bias", bias, (np.float32, jnp.bfloat16, np.float16))


def select_experts(logits: jax.Array, bias: jax.Array | None = None, *, top_k: int,
                   scoring: str, n_group: int = 1, topk_group: int = 1, renormalize: bool = True,
                   scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """``(idx int32 [T, k], weight float32 [T, k])`` from router ``logits [T, E]``: the routing
    rule of the module docstring (the owner of that rule; jnp, any backend)."""
    validation.check_rank("logits", logits, 2)
    T, E = logits.shape
    check_rule(E, top_k, scoring, n_group, topk_group, renormalize, scale)
    _check_bias(bias, scoring, E)
    logits = logits.astype(jnp.float32)
    if scoring == "softmax":
        vals, idx = jax.lax.top_k(logits, top_k)
        return idx.astype(jnp.int32), jax.nn.softmax(vals, axis=-1)
    scores = jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    if n_group > 1:
        per = E // n_group
        grouped = choice.reshape(T, n_group, per)
        group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, n_group]
        _, best = jax.lax.top_k(group_score, topk_group)
        keep = jnp.any(best[:, :, None] == jnp.arange(n_group)[None, None, :], axis=1)  # [T, n_group]
        choice = jnp.where(jnp.repeat(keep, per, axis=1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, top_k)
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if renormalize:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + RENORM_EPS)
    return idx.astype(jnp.int32), w * jnp.float32(scale)


# --------------------------------------------------------------------------
# Implementations
# --------------------------------------------------------------------------


def _logits(x, router):
    """``x @ router`` in float32 with every product exact. Two operands of one half-precision
    dtype multiply as the kernel's :func:`_product_terms` has them (on a GPU the tensor cores'
    product into float32 sums: a few us where IEEE float32 over an 8k-token prefill's ``[T, d]``
    took ~70 us a layer; on the CPU widened to IEEE float32). Otherwise both widened to IEEE
    float32."""
    if x.dtype == router.dtype and x.dtype in (jnp.bfloat16, jnp.float16):
        return _product_terms(x, router, interpret=jax.default_backend() == "cpu")
    return jnp.matmul(x.astype(jnp.float32), router.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


@_backend.register(OP_MOE_ROUTE, "reference")
def _reference(x, router, bias, *, config, interpret, **rule):
    return select_experts(_logits(x, router), bias, **rule)


def _top_rounds(values, lane, k: int, width: int, valid: int):
    """``k`` rounds of a row maximum over ``values [BT, width]`` (float32, -inf where not a
    candidate; lanes ``>= valid`` are not experts): ``[(max [BT], position int32 [BT]), ...]``,
    best first; a tie goes to the lower lane. Each round names a lane below ``valid`` that no
    earlier round named (``k <= valid``): the lowest untaken one equal to the maximum, else (a
    maximum no untaken lane equals: -inf left after the finite candidates, as ``top_k`` then
    takes the lowest -inf lanes, or a NaN) the lowest untaken lane. Taken lanes become -inf."""
    out = []
    free = lane < valid
    for _ in range(k):
        m = jnp.max(values, axis=1)
        # one reduction: an untaken lane equal to m, else any untaken lane (offset by width)
        key = jnp.where(free, jnp.where(values == m[:, None], lane, lane + width), 2 * width)
        pos = jnp.min(key, axis=1)
        pos = jnp.where(pos >= width, pos - width, pos)
        out.append((m, pos))
        hit = lane == pos[:, None]
        free = free & ~hit
        values = jnp.where(hit, -jnp.inf, values)
    return out


def _select_block(logits, bias_row, lane, *, E, Ep, Kp, top_k, scoring, n_group, topk_group,
                  renormalize, scale):
    """The rule on one program's ``[BT, Ep]`` float32 logits (lanes >= E are not experts):
    ``(idx int32 [BT, Kp], weight float32 [BT, Kp])``, columns >= top_k 0."""
    is_expert = lane < E
    col = jax.lax.broadcasted_iota(jnp.int32, (logits.shape[0], Kp), 1)
    idx = jnp.zeros(col.shape, jnp.int32)
    w = jnp.zeros(col.shape, jnp.float32)
    if scoring == "softmax":
        rounds = _top_rounds(jnp.where(is_expert, logits, -jnp.inf), lane, top_k, Ep, E)
        top = rounds[0][0]
        exps = [jnp.exp(m - top) for m, _ in rounds]
        total = exps[0]
        for e in exps[1:]:
            total = total + e
        for j, ((_, pos), e) in enumerate(zip(rounds, exps)):
            idx = jnp.where(col == j, pos[:, None], idx)
            w = jnp.where(col == j, (e / total)[:, None], w)
        return idx, w
    scores = jax.nn.sigmoid(logits)
    choice = scores if bias_row is None else scores + bias_row
    choice = jnp.where(is_expert, choice, -jnp.inf)
    if n_group > 1:
        per = E // n_group
        group = lane // per
        keep = jnp.zeros(choice.shape, jnp.bool_)
        gscores = []
        for g in range(n_group):
            in_g = group == g
            vals = jnp.where(in_g, choice, -jnp.inf)
            (m1, _), (m2, _) = _top_rounds(vals, lane, 2, Ep, E)
            gscores.append(m1 + m2)
        # topk_group rounds over the groups: a group wins over a later one on a tie
        taken = [jnp.zeros(choice.shape[:1], jnp.bool_) for _ in range(n_group)]
        for _ in range(topk_group):
            best = jnp.full(choice.shape[:1], -jnp.inf, jnp.float32)
            for g in range(n_group):
                best = jnp.maximum(best, jnp.where(taken[g], -jnp.inf, gscores[g]))
            found = jnp.zeros(choice.shape[:1], jnp.bool_)
            for g in range(n_group):
                hit = ~taken[g] & ~found & (gscores[g] == best)
                taken[g] = taken[g] | hit
                found = found | hit
        for g in range(n_group):
            keep = keep | ((group == g) & taken[g][:, None])
        choice = jnp.where(keep, choice, -jnp.inf)
    rounds = _top_rounds(choice, lane, top_k, Ep, E)
    picked = [jnp.sum(jnp.where(lane == pos[:, None], scores, 0.0), axis=1) for _, pos in rounds]
    if renormalize:
        total = picked[0]
        for p in picked[1:]:
            total = total + p
        total = total + RENORM_EPS
        picked = [p / total for p in picked]
    for j, ((_, pos), p) in enumerate(zip(rounds, picked)):
        idx = jnp.where(col == j, pos[:, None], idx)
        w = jnp.where(col == j, (p * jnp.float32(scale))[:, None], w)
    return idx, w


def _split3(a):
    """float32 ``a`` as three bfloat16 parts whose float32 sum is ``a`` (8 significant bits
    each; float32 has 24)."""
    hi = a.astype(jnp.bfloat16)
    r = a - hi.astype(jnp.float32)
    mid = r.astype(jnp.bfloat16)
    return hi, mid, (r - mid.astype(jnp.float32)).astype(jnp.bfloat16)


def _product_terms(a, b, interpret: bool):
    """``a [M, BK] @ b [BK, N]`` in float32 with every product exact: half-precision operands
    multiply on the tensor cores into float32; a float32 ``a`` beside a half-precision ``b``
    is three bfloat16 parts (three exact products each); two float32 operands take IEEE
    float32 (CUDA cores)."""
    def dot(u, v, prec=None):
        if interpret:
            u, v, prec = u.astype(jnp.float32), v.astype(jnp.float32), jax.lax.Precision.HIGHEST
        return jax.lax.dot_general(u, v, (((1,), (0,)), ((), ())), precision=prec,
                                   preferred_element_type=jnp.float32)

    half = (jnp.bfloat16, jnp.float16)
    if a.dtype in half and b.dtype == a.dtype:
        return dot(a, b)
    if a.dtype == jnp.float32 and b.dtype == jnp.bfloat16:
        hi, mid, lo = _split3(a)
        return dot(hi, b) + dot(mid, b) + dot(lo, b)
    return dot(a.astype(jnp.float32), b.astype(jnp.float32), jax.lax.Precision.HIGHEST)


@_backend.register(OP_MOE_ROUTE, "gpu")
def _gpu(x, router, bias, *, config, interpret, **rule):
    T, K = x.shape
    E = router.shape[1]
    BT, BK = BLOCK_T, min(BLOCK_K, max(16, pl.next_power_of_2(K)))
    S = min(config.gpu_split or 16, -(-K // BK))
    Ep = max(16, pl.next_power_of_2(E))
    Kp = max(2, pl.next_power_of_2(rule["top_k"]))
    nT = -(-T // BT)
    # a routing program's tokens: the product's block, or (split products) as few as the call has
    BS = BT if S == 1 else min(BT, pl.next_power_of_2(T))
    nS = -(-T // BS)
    for name, shape in (("x", x.shape), ("router", router.shape), ("the partial products", (S * nT * BT, Ep))):
        gpu_tiling.check_int32_offsets(name, shape)
    load, store = _backend.triton.load, _backend.triton.store
    chunk = pl.cdiv(pl.cdiv(K, S), BK) * BK  # d columns of one split, a multiple of BK
    steps = chunk // BK
    # the widened form of half-precision operands meeting a float32 one (see _product_terms)
    if x.dtype == jnp.float16 and router.dtype != jnp.float16:
        x = x.astype(jnp.float32)
    if router.dtype == jnp.float16 and x.dtype != jnp.float16:
        router = router.astype(jnp.float32)
    if x.dtype == jnp.bfloat16 and router.dtype == jnp.float32:
        x = x.astype(jnp.float32)

    def product(x_ref, r_ref, i, s):
        """float32 ``[BT, Ep]``: tokens ``i * BT ..`` times the router over split ``s``'s slice."""
        rows = i * BT + jnp.arange(BT, dtype=jnp.int32)
        lanes = jnp.arange(Ep, dtype=jnp.int32)
        row_ok, lane_ok = rows < T, lanes < E
        rows, lanes = jnp.minimum(rows, T - 1), jnp.minimum(lanes, E - 1)

        def step(kb, acc):
            kk = s * chunk + kb * BK + jnp.arange(BK, dtype=jnp.int32)
            k_ok = kk < K
            kk = jnp.minimum(kk, K - 1)
            a = load(x_ref.at[rows[:, None] * K + kk[None, :]],
                     mask=row_ok[:, None] & k_ok[None, :], other=0)
            b = load(r_ref.at[kk[:, None] * E + lanes[None, :]],
                     mask=k_ok[:, None] & lane_ok[None, :], other=0)
            return acc + _product_terms(a, b, interpret)

        return jax.lax.fori_loop(0, steps, step, jnp.zeros((BT, Ep), jnp.float32))

    xf, rf = x.reshape(-1), router.reshape(-1)
    args = (xf, rf) if S == 1 else ()
    if S > 1:
        def partial_kernel(x_ref, r_ref, p_ref):
            i, s = pl.program_id(0), pl.program_id(1)
            rows = (s * nT + i) * BT + jnp.arange(BT, dtype=jnp.int32)
            lanes = jnp.arange(Ep, dtype=jnp.int32)
            store(p_ref.at[rows[:, None] * Ep + lanes[None, :]], product(x_ref, r_ref, i, s))

        partials = pl.pallas_call(
            partial_kernel, out_shape=jax.ShapeDtypeStruct((S * nT * BT * Ep,), jnp.float32),
            grid=(nT, S), interpret=interpret, name="moe_route_product_gpu",
            compiler_params=_backend.triton.CompilerParams(num_warps=PRODUCT_WARPS,
                                                           num_stages=2))(xf, rf)
        args = (partials,)
    has_bias = bias is not None
    if has_bias:
        args = args + (bias.astype(jnp.float32),)

    def kernel(*refs):
        if S == 1:
            x_ref, r_ref, *refs = refs
        else:
            p_ref, *refs = refs
        b_ref, idx_ref, w_ref = refs if has_bias else (None, *refs)
        i = pl.program_id(0)
        lanes = jnp.arange(Ep, dtype=jnp.int32)
        if S == 1:
            logits = product(x_ref, r_ref, i, 0)
        else:
            logits = None
            for s in range(S):  # in split order: the same sums at every call
                rows = jnp.minimum(i * BS + jnp.arange(BS, dtype=jnp.int32), T - 1) + s * nT * BT
                part = load(p_ref.at[rows[:, None] * Ep + lanes[None, :]])
                logits = part if logits is None else logits + part
        bias_row = None
        if has_bias:
            bias_row = load(b_ref.at[jnp.minimum(lanes, E - 1)], mask=lanes < E, other=0)[None, :]
        lane = jnp.broadcast_to(lanes[None, :], (BS, Ep))
        idx, w = _select_block(logits, bias_row, lane, E=E, Ep=Ep, Kp=Kp, **rule)
        rows = i * BS + jnp.arange(BS, dtype=jnp.int32)
        cols = jnp.arange(Kp, dtype=jnp.int32)
        at = rows[:, None] * Kp + cols[None, :]
        store(idx_ref.at[at], idx)
        store(w_ref.at[at], w)

    warps = PRODUCT_WARPS if S == 1 else SELECT_WARPS
    idx, w = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((nS * BS * Kp,), jnp.int32),
                   jax.ShapeDtypeStruct((nS * BS * Kp,), jnp.float32)),
        grid=(nS,), interpret=interpret, name="moe_route_gpu",
        compiler_params=_backend.triton.CompilerParams(num_warps=warps, num_stages=1))(*args)
    k = rule["top_k"]
    return idx.reshape(nS * BS, Kp)[:T, :k], w.reshape(nS * BS, Kp)[:T, :k]


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def moe_route(x, router, bias=None, *, top_k: int, scoring: str, n_group: int = 1,
              topk_group: int = 1, renormalize: bool = True, scale: float = 1.0,
              backend: str = "auto", interpret: bool | None = None,
              config: MoERouteConfig = MoERouteConfig()):
    """Each token's ``top_k`` experts and gate weights from its router logits ``x @ router``.

    Args:
      x: ``[T, d]`` float32, bfloat16 or float16 (widened to float32).
      router: ``[d, E]`` float32, bfloat16 or float16 (widened to float32).
      bias: optional ``[E]`` (``scoring="sigmoid"`` only): added to the scores for the choice.
      top_k, scoring, n_group, topk_group, renormalize, scale: the rule of the module docstring
        (static).
      backend, interpret: see :mod:`pallas_kernels.backend` (TPU: the reference).
      config: :class:`MoERouteConfig` (static).

    Returns:
      ``(idx int32 [T, top_k], weight float32 [T, top_k])``, best first.

    Raises:
      ValueError: bad ranks, shapes, dtypes or rule parameters.
    """
    choice = _backend.choose(OP_MOE_ROUTE, backend, interpret)
    if not isinstance(config, MoERouteConfig):
        raise ValueError(f"config must be a MoERouteConfig, got {config!r}")
    validation.check_rank("x", x, 2)
    validation.check_rank("router", router, 2)
    floats = (np.float32, jnp.bfloat16, np.float16)
    validation.check_dtype("x", x, floats)
    validation.check_dtype("router", router, floats)
    T, d = np.shape(x)
    validation.check_shape("router", router, (d, np.shape(router)[1]))
    E = int(np.shape(router)[1])
    if E == 0:
        raise ValueError("router must have at least one expert column, got shape "
                         f"{list(np.shape(router))}")
    rule = check_rule(E, top_k, scoring, n_group, topk_group, renormalize, scale)
    _check_bias(bias, scoring, E)
    if T == 0:
        return jnp.zeros((0, top_k), jnp.int32), jnp.zeros((0, top_k), jnp.float32)
    if choice.flavor == "gpu" and (T > config.gpu_max_tokens or d == 0):
        # the kernel takes calls of up to gpu_max_tokens tokens with a product to compute; the
        # rest run the reference's XLA product and top-k
        choice = _backend.Choice("reference", False)
    return _backend.run(OP_MOE_ROUTE, choice, x, router, bias, config=config, **rule)
