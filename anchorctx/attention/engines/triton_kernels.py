"""Triton kernels of the ``triton`` attention engine (see :mod:`.triton_doc` for the method).

Imported on first use: Triton decides at definition time whether a kernel runs compiled or
in its interpreter (``TRITON_INTERPRET=1``), and a machine without Triton still imports the
engine module.

Names: ``NQ``/``NK`` count query/key tiles; ``W`` is a tile list's row stride (its largest
count); ``FC``/``FI`` and ``PC``/``PI`` are the counts and indices of full and partial tiles;
``list_b`` is 0 when every row of the batch shares one layout (one set of lists).
"""

import triton
import triton.language as tl


@triton.jit
def anchor_key(q, kp, vp, docs_b, doc_q, row_ok, anchor_flag, qk_scale, D: tl.constexpr):
    """(foreign [BM]: the query sees the anchor key from outside its document; k0, v0 [D] in
    float32; s0 [BM]: the anchor key's scores in log2 units)."""
    offs_d = tl.arange(0, D)
    foreign = row_ok & (doc_q != tl.load(docs_b)) & (tl.load(anchor_flag) != 0)
    k0 = tl.load(kp + offs_d).to(tl.float32)
    v0 = tl.load(vp + offs_d).to(tl.float32)
    s0 = tl.sum(q.to(tl.float32) * k0[None, :], 1) * qk_scale
    return foreign, k0, v0, s0


@triton.jit
def fwd_tile(
    q,
    acc,
    l_i,
    m_i,
    kp,
    vp,
    skt,
    svt,
    docs_b,
    doc_q,
    offs_m,
    kt,
    T,
    qk_scale,
    BN: tl.constexpr,
    D: tl.constexpr,
    MASKED: tl.constexpr,
):
    offs_n = kt * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    if MASKED:
        col_ok = offs_n < T
        k = tl.load(kp + offs_n[None, :] * skt + offs_d[:, None], mask=col_ok[None, :], other=0.0)
        v = tl.load(vp + offs_n[:, None] * svt + offs_d[None, :], mask=col_ok[:, None], other=0.0)
    else:
        k = tl.load(kp + offs_n[None, :] * skt + offs_d[:, None])  # [D, BN]
        v = tl.load(vp + offs_n[:, None] * svt + offs_d[None, :])  # [BN, D]
    s = tl.dot(q, k)  # [BM, BN]; scaled to log2 units inside the exponent (one FMA)
    if MASKED:
        doc_k = tl.load(docs_b + offs_n, mask=col_ok, other=-2)
        keep = (offs_n[None, :] <= offs_m[:, None]) & (doc_k[None, :] == doc_q[:, None])
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.math.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def fwd_kernel(
    Q,
    K,
    V,
    OUT,
    LSE,
    DOCS,
    ANCHOR,
    FC,
    FI,
    PC,
    PI,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    svb,
    svh,
    svt,
    sob,
    soh,
    sot,
    list_b,
    T,
    NQ,
    W,
    qk_scale,
    H: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    HAS_ANCHOR: tl.constexpr,
):
    # Tiles in reverse (the grid's first axis runs fastest: one head's tiles, then the next
    # head's): within a document the last query tiles have the most keys, so the long programs
    # start first and the launch ends on short ones, while neighbouring programs still share
    # their document's keys in L2.
    qt = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // G
    offs_m = qt * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    row_ok = offs_m < T
    q = tl.load(
        Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    docs_b = DOCS + b * T
    doc_q = tl.load(docs_b + offs_m, mask=row_ok, other=-1)
    kp = K + b * skb + hk * skh
    vp = V + b * svb + hk * svh
    # Running max starts finite, so an all-masked tile rescales by exp2(0) = 1, not NaN.
    m_i = tl.full([BM], -1.0e30, tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    if HAS_ANCHOR:
        # Queries outside the anchor's document start from the anchor key: m = s0, l = 1,
        # acc = v0 (queries inside it meet key 0 in their own tiles).
        foreign, _k0, v0, s0 = anchor_key(q, kp, vp, docs_b, doc_q, row_ok, ANCHOR + b, qk_scale, D)
        m_i = tl.where(foreign, s0, m_i)
        l_i = tl.where(foreign, 1.0, l_i)
        acc = tl.where(foreign[:, None], v0[None, :] + acc, acc)
    lrow = (b * list_b) * NQ + qt
    for i in range(0, tl.load(FC + lrow)):
        kt = tl.load(FI + lrow * W + i)
        acc, l_i, m_i = fwd_tile(
            q, acc, l_i, m_i, kp, vp, skt, svt, docs_b, doc_q, offs_m, kt, T, qk_scale, BN, D, False
        )
    for i in range(0, tl.load(PC + lrow)):
        kt = tl.load(PI + lrow * W + i)
        acc, l_i, m_i = fwd_tile(
            q, acc, l_i, m_i, kp, vp, skt, svt, docs_b, doc_q, offs_m, kt, T, qk_scale, BN, D, True
        )
    l_safe = tl.where(l_i > 0, l_i, 1.0)  # padding rows only
    out = acc / l_safe[:, None]
    tl.store(
        OUT + b * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :],
        out.to(OUT.dtype.element_ty),
        mask=row_ok[:, None],
    )
    tl.store(LSE + bh * T + offs_m, m_i + tl.math.log2(l_safe), mask=row_ok)


@triton.jit
def dkdv_tile(
    dk,
    dv,
    k,
    v,
    qp,
    dop,
    lsep,
    deltap,
    sqt,
    sdt,
    docs_b,
    doc_k,
    offs_n,
    qt,
    T,
    qk_scale,
    BM: tl.constexpr,
    D: tl.constexpr,
    MASKED: tl.constexpr,
):
    offs_m = qt * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    if MASKED:
        row_ok = offs_m < T
        q = tl.load(qp + offs_m[:, None] * sqt + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        do = tl.load(dop + offs_m[:, None] * sdt + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        lse = tl.load(lsep + offs_m, mask=row_ok, other=0.0)
        delta = tl.load(deltap + offs_m, mask=row_ok, other=0.0)
    else:
        q = tl.load(qp + offs_m[:, None] * sqt + offs_d[None, :])
        do = tl.load(dop + offs_m[:, None] * sdt + offs_d[None, :])
        lse = tl.load(lsep + offs_m)
        delta = tl.load(deltap + offs_m)
    s_t = tl.dot(k, tl.trans(q)) * qk_scale  # [BN, BM]: keys × queries
    p_t = tl.math.exp2(s_t - lse[None, :])
    if MASKED:
        doc_q = tl.load(docs_b + offs_m, mask=row_ok, other=-1)
        keep = (offs_m[None, :] >= offs_n[:, None]) & (doc_q[None, :] == doc_k[:, None])
        p_t = tl.where(keep, p_t, 0.0)
    dv += tl.dot(p_t.to(do.dtype), do)
    dp_t = tl.dot(v, tl.trans(do))
    ds_t = p_t * (dp_t - delta[None, :])
    dk += tl.dot(ds_t.to(q.dtype), q)
    return dk, dv


@triton.jit
def dkdv_program(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    DOCS,
    FC,
    FI,
    PC,
    PI,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    svb,
    svh,
    svt,
    sdb,
    sdh,
    sdt,
    sdkb,
    sdkh,
    sdkt,
    sdvb,
    sdvh,
    sdvt,
    list_b,
    T,
    W,
    NK,
    qk_scale,
    sm_scale,
    kt,
    bhk,
    H: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    """dK, dV of key tile ``kt`` of KV head ``bhk`` (over the query heads of its group)."""
    HK: tl.constexpr = H // G
    b = bhk // HK
    hk = bhk % HK
    offs_n = kt * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    col_ok = offs_n < T
    k = tl.load(
        K + b * skb + hk * skh + offs_n[:, None] * skt + offs_d[None, :],
        mask=col_ok[:, None],
        other=0.0,
    )
    v = tl.load(
        V + b * svb + hk * svh + offs_n[:, None] * svt + offs_d[None, :],
        mask=col_ok[:, None],
        other=0.0,
    )
    docs_b = DOCS + b * T
    doc_k = tl.load(docs_b + offs_n, mask=col_ok, other=-2)
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    lrow = (b * list_b) * NK + kt
    n_full = tl.load(FC + lrow)
    n_part = tl.load(PC + lrow)
    # The group's query heads in one program: dK/dV accumulate in registers, no atomics.
    for g in range(0, G):
        h = hk * G + g
        qp = Q + b * sqb + h * sqh
        dop = DO + b * sdb + h * sdh
        lsep = LSE + (b * H + h) * T
        deltap = DELTA + (b * H + h) * T
        for i in range(0, n_full):
            qt = tl.load(FI + lrow * W + i)
            dk, dv = dkdv_tile(
                dk,
                dv,
                k,
                v,
                qp,
                dop,
                lsep,
                deltap,
                sqt,
                sdt,
                docs_b,
                doc_k,
                offs_n,
                qt,
                T,
                qk_scale,
                BM,
                D,
                False,
            )
        for i in range(0, n_part):
            qt = tl.load(PI + lrow * W + i)
            dk, dv = dkdv_tile(
                dk,
                dv,
                k,
                v,
                qp,
                dop,
                lsep,
                deltap,
                sqt,
                sdt,
                docs_b,
                doc_k,
                offs_n,
                qt,
                T,
                qk_scale,
                BM,
                D,
                True,
            )
    tl.store(
        DK + b * sdkb + hk * sdkh + offs_n[:, None] * sdkt + offs_d[None, :],
        (dk * sm_scale).to(DK.dtype.element_ty),
        mask=col_ok[:, None],
    )
    tl.store(
        DV + b * sdvb + hk * sdvh + offs_n[:, None] * sdvt + offs_d[None, :],
        dv.to(DV.dtype.element_ty),
        mask=col_ok[:, None],
    )


@triton.jit
def dq_tile(
    dq,
    q,
    do,
    lse,
    delta,
    kp,
    vp,
    skt,
    svt,
    docs_b,
    doc_q,
    offs_m,
    kt,
    T,
    qk_scale,
    BN: tl.constexpr,
    D: tl.constexpr,
    MASKED: tl.constexpr,
):
    offs_n = kt * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    if MASKED:
        col_ok = offs_n < T
        k = tl.load(kp + offs_n[:, None] * skt + offs_d[None, :], mask=col_ok[:, None], other=0.0)
        v = tl.load(vp + offs_n[:, None] * svt + offs_d[None, :], mask=col_ok[:, None], other=0.0)
    else:
        k = tl.load(kp + offs_n[:, None] * skt + offs_d[None, :])  # [BN, D]
        v = tl.load(vp + offs_n[:, None] * svt + offs_d[None, :])
    s = tl.dot(q, tl.trans(k)) * qk_scale
    p = tl.math.exp2(s - lse[:, None])
    if MASKED:
        doc_k = tl.load(docs_b + offs_n, mask=col_ok, other=-2)
        keep = (offs_n[None, :] <= offs_m[:, None]) & (doc_k[None, :] == doc_q[:, None])
        p = tl.where(keep, p, 0.0)
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq)


@triton.jit
def dq_program(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    DOCS,
    ANCHOR,
    DK0,
    DV0,
    FC,
    FI,
    PC,
    PI,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    svb,
    svh,
    svt,
    sdb,
    sdh,
    sdt,
    sdqb,
    sdqh,
    sdqt,
    list_b,
    T,
    NQ,
    W,
    qk_scale,
    sm_scale,
    qt,
    bh,
    H: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    HAS_ANCHOR: tl.constexpr,
):
    """dQ of query tile ``qt`` of head ``bh``, and its share of the anchor key's dK/dV."""
    b = bh // H
    h = bh % H
    hk = h // G
    offs_m = qt * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    row_ok = offs_m < T
    q = tl.load(
        Q + b * sqb + h * sqh + offs_m[:, None] * sqt + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    do = tl.load(
        DO + b * sdb + h * sdh + offs_m[:, None] * sdt + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    lse = tl.load(LSE + bh * T + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + bh * T + offs_m, mask=row_ok, other=0.0)
    docs_b = DOCS + b * T
    doc_q = tl.load(docs_b + offs_m, mask=row_ok, other=-1)
    kp = K + b * skb + hk * skh
    vp = V + b * svb + hk * svh
    dq = tl.zeros([BM, D], tl.float32)
    lrow = (b * list_b) * NQ + qt
    for i in range(0, tl.load(FC + lrow)):
        kt = tl.load(FI + lrow * W + i)
        dq = dq_tile(
            dq,
            q,
            do,
            lse,
            delta,
            kp,
            vp,
            skt,
            svt,
            docs_b,
            doc_q,
            offs_m,
            kt,
            T,
            qk_scale,
            BN,
            D,
            False,
        )
    for i in range(0, tl.load(PC + lrow)):
        kt = tl.load(PI + lrow * W + i)
        dq = dq_tile(
            dq,
            q,
            do,
            lse,
            delta,
            kp,
            vp,
            skt,
            svt,
            docs_b,
            doc_q,
            offs_m,
            kt,
            T,
            qk_scale,
            BN,
            D,
            True,
        )
    if HAS_ANCHOR:
        # The anchor key's share: p0 = exp2(s0 - lse), ds0 = p0·(dO·v0 - Δ) (zero for queries
        # of the anchor's own document, which met key 0 in their tiles above).
        foreign, k0, v0, s0 = anchor_key(q, kp, vp, docs_b, doc_q, row_ok, ANCHOR + b, qk_scale, D)
        qf = q.to(tl.float32)
        dof = do.to(tl.float32)
        p0 = tl.where(foreign, tl.math.exp2(s0 - lse), 0.0)
        ds0 = p0 * (tl.sum(dof * v0[None, :], 1) - delta)
        dq += ds0[:, None] * k0[None, :]
        # This tile's share of dk0 / dv0 ([B, H, NQ, D] float32, summed by the caller).
        part = (bh * NQ + qt) * D + offs_d
        tl.store(DK0 + part, tl.sum(ds0[:, None] * qf, 0))
        tl.store(DV0 + part, tl.sum(p0[:, None] * dof, 0))
    tl.store(
        DQ + b * sdqb + h * sdqh + offs_m[:, None] * sdqt + offs_d[None, :],
        (dq * sm_scale).to(DQ.dtype.element_ty),
        mask=row_ok[:, None],
    )


@triton.jit
def delta_kernel(
    OUT,
    DO,
    DELTA,
    sob,
    soh,
    sot,
    sdb,
    sdh,
    sdt,
    T,
    H: tl.constexpr,
    D: tl.constexpr,
    BM: tl.constexpr,
):
    """Δ = rowsum(dO ∘ O): the softmax backward's per-query correction (float32 [B, H, T])."""
    qt = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_m = qt * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    ok = offs_m[:, None] < T
    o = tl.load(
        OUT + b * sob + h * soh + offs_m[:, None] * sot + offs_d[None, :], mask=ok, other=0.0
    )
    do = tl.load(
        DO + b * sdb + h * sdh + offs_m[:, None] * sdt + offs_d[None, :], mask=ok, other=0.0
    )
    tl.store(
        DELTA + bh * T + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=offs_m < T
    )


@triton.jit
def bwd_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    DK,
    DV,
    DOCS,
    ANCHOR,
    DK0,
    DV0,
    QFC,
    QFI,
    QPC,
    QPI,
    KFC,
    KFI,
    KPC,
    KPI,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    svb,
    svh,
    svt,
    sdb,
    sdh,
    sdt,
    sdqb,
    sdqh,
    sdqt,
    sdkb,
    sdkh,
    sdkt,
    sdvb,
    sdvh,
    sdvt,
    qlist_b,
    klist_b,
    T,
    NQ,
    W_DQ,
    NK1,
    W_KV,
    N_DKDV,
    qk_scale,
    sm_scale,
    H: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BM_DQ: tl.constexpr,
    BN_DQ: tl.constexpr,
    BM_KV: tl.constexpr,
    BN_KV: tl.constexpr,
    HAS_ANCHOR: tl.constexpr,
):
    """The whole backward in one launch: programs [0, N_DKDV) compute dK/dV, the rest dQ.

    One launch instead of two lets the short programs at the end of one part overlap the
    other part, instead of each kernel draining the GPU (worth several percent at 32K, where
    each part is only ~15 waves of programs). Within each part the grid runs tile-fastest, so
    neighbouring programs share their document's keys or queries in L2: key tiles in order (a
    document's first key tiles are seen by the most queries), query tiles in reverse (its last
    query tiles see the most keys): the long programs start first.
    """
    pid = tl.program_id(0)
    if pid < N_DKDV:
        dkdv_program(
            Q,
            K,
            V,
            DO,
            LSE,
            DELTA,
            DK,
            DV,
            DOCS,
            KFC,
            KFI,
            KPC,
            KPI,
            sqb,
            sqh,
            sqt,
            skb,
            skh,
            skt,
            svb,
            svh,
            svt,
            sdb,
            sdh,
            sdt,
            sdkb,
            sdkh,
            sdkt,
            sdvb,
            sdvh,
            sdvt,
            klist_b,
            T,
            W_KV,
            NK1,
            qk_scale,
            sm_scale,
            pid % NK1,
            pid // NK1,
            H,
            G,
            D,
            BM_KV,
            BN_KV,
        )
    else:
        p = pid - N_DKDV
        dq_program(
            Q,
            K,
            V,
            DO,
            LSE,
            DELTA,
            DQ,
            DOCS,
            ANCHOR,
            DK0,
            DV0,
            QFC,
            QFI,
            QPC,
            QPI,
            sqb,
            sqh,
            sqt,
            skb,
            skh,
            skt,
            svb,
            svh,
            svt,
            sdb,
            sdh,
            sdt,
            sdqb,
            sdqh,
            sdqt,
            qlist_b,
            T,
            NQ,
            W_DQ,
            qk_scale,
            sm_scale,
            NQ - 1 - p % NQ,
            p // NQ,
            H,
            G,
            D,
            BM_DQ,
            BN_DQ,
            HAS_ANCHOR,
        )


@triton.jit
def dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    DOCS,
    KFC,
    KFI,
    KPC,
    KPI,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    svb,
    svh,
    svt,
    sdb,
    sdh,
    sdt,
    sdkb,
    sdkh,
    sdkt,
    sdvb,
    sdvh,
    sdvt,
    klist_b,
    T,
    NK1,
    W_KV,
    qk_scale,
    sm_scale,
    H: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BM_KV: tl.constexpr,
    BN_KV: tl.constexpr,
):
    """The backward's dK/dV programs as a launch of their own (``Blocks.split_backward``)."""
    dkdv_program(
        Q,
        K,
        V,
        DO,
        LSE,
        DELTA,
        DK,
        DV,
        DOCS,
        KFC,
        KFI,
        KPC,
        KPI,
        sqb,
        sqh,
        sqt,
        skb,
        skh,
        skt,
        svb,
        svh,
        svt,
        sdb,
        sdh,
        sdt,
        sdkb,
        sdkh,
        sdkt,
        sdvb,
        sdvh,
        sdvt,
        klist_b,
        T,
        W_KV,
        NK1,
        qk_scale,
        sm_scale,
        tl.program_id(0),
        tl.program_id(1),
        H,
        G,
        D,
        BM_KV,
        BN_KV,
    )


@triton.jit
def dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    DOCS,
    ANCHOR,
    DK0,
    DV0,
    QFC,
    QFI,
    QPC,
    QPI,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skt,
    svb,
    svh,
    svt,
    sdb,
    sdh,
    sdt,
    sdqb,
    sdqh,
    sdqt,
    qlist_b,
    T,
    NQ,
    W_DQ,
    qk_scale,
    sm_scale,
    H: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BM_DQ: tl.constexpr,
    BN_DQ: tl.constexpr,
    HAS_ANCHOR: tl.constexpr,
):
    """The backward's dQ programs as a launch of their own (``Blocks.split_backward``)."""
    dq_program(
        Q,
        K,
        V,
        DO,
        LSE,
        DELTA,
        DQ,
        DOCS,
        ANCHOR,
        DK0,
        DV0,
        QFC,
        QFI,
        QPC,
        QPI,
        sqb,
        sqh,
        sqt,
        skb,
        skh,
        skt,
        svb,
        svh,
        svt,
        sdb,
        sdh,
        sdt,
        sdqb,
        sdqh,
        sdqt,
        qlist_b,
        T,
        NQ,
        W_DQ,
        qk_scale,
        sm_scale,
        NQ - 1 - tl.program_id(0),
        tl.program_id(1),
        H,
        G,
        D,
        BM_DQ,
        BN_DQ,
        HAS_ANCHOR,
    )
