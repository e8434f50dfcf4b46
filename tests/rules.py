"""Independent per-pair readings of the mask rules (docs/design.md, section 3), for tests."""

from __future__ import annotations

import torch

from flexhstu.jagged import offsets_from_lengths


def offsets_from(lengths, dtype=torch.int64):
    return offsets_from_lengths(lengths, dtype=dtype)


def fixed_visible(i, j, L, T, c, W, F, has_targets):
    def ids(x):
        v = max(x - c + 1, 0) if c > 0 else x
        if has_targets:
            v = min(v, max_id)
        return v

    max_id = L - (c - 1 if c > 0 else 0) - (T if has_targets else 0)
    d = ids(i) - ids(j)
    valid = (i == j) or d > 0
    if W > 0:
        valid = valid and (d <= W or (F > 0 and ids(i) >= max_id - F))
    if c > 0:
        valid = valid or (ids(i) == 0 and ids(j) < max_id)
    return valid


def sla_visible(i, j, L, T, k1, k2, c):
    hb = L - T
    k2e = max(k2, c)
    if i >= hb:
        return j < hb
    return j < min(k2e, i + 1) or max(k2e, i - k1 + 1) <= j < i + 1


def onerank_visible(i, j, L, T, G):
    hb = L - T
    if i < hb:
        return j <= i
    g = hb + ((i - hb) // G) * G
    return j < hb or j in (g, i)


def dense_from_rule(lengths, n, rule):
    """bool (B, 1, N, N) from ``rule(b, i, j, L)``."""
    out = torch.zeros(len(lengths), 1, n, n, dtype=torch.bool)
    for b, L in enumerate(lengths):
        for i in range(L):
            for j in range(L):
                out[b, 0, i, j] = bool(rule(b, i, j, L))
    return out


def dense_attention_f64(q, k, v, lengths, vis, alpha, scale):
    """Per-sequence float64 HSTU attention with no padding; vis: (B, H|1, N, N) bool."""
    outs = []
    start = 0
    for b, L in enumerate(lengths):
        qb, kb, vb = (x[start : start + L].double() for x in (q, k, v))
        s = torch.einsum("ihd,jhd->hij", qb, kb) * alpha
        m = vis[b, :, :L, :L].double()
        a = s * torch.sigmoid(s) * m / scale
        outs.append(torch.einsum("hij,jhd->ihd", a, vb))
        start += L
    return torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], v.shape[2]).double()
