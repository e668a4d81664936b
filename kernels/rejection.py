"""The rejection sampler's accept-and-recover step as one Triton kernel (one program per
request), the CUDA path of worker/spec_decode.py; `accept_and_recover_reference` there is
the torch path and this kernel's reference.

Request i owns the rows start_i .. start_i + k_i of probs (its k_i proposed tokens'
positions, then the bonus position). Walking its proposals in order, proposal j (token x)
is accepted while: for a greedy request, x is the row's argmax; otherwise u_j * q_j(x) <
p_j(x) (q one-hot for deterministic proposals, so q_j(x) = 1). The first rejected position
a (or the bonus position a = k_i) gives the request's last token: the argmax for a greedy
request, else the exponential race over the weights max(0, p_a - q_a) (just p_a at the
bonus), argmin(w / log U) with the caller's log-uniform draws, the first of equal minima as
torch's argmin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.kernels.launches import count_launch


@triton.jit
def _accept_and_recover_kernel(
    probs_ptr,  # [R, V] fp32
    log_u_ptr,  # [R, V] fp32, < 0
    greedy_tokens_ptr,  # [R] int64
    greedy_ptr,  # [N] int8: the request is greedy
    draft_ptr,  # [D] int64: proposals back to back
    cu_drafts_ptr,  # [N + 1] int64
    q_ptr,  # [D, V] fp32 (HAS_Q)
    u_ptr,  # [D] fp32
    accepted_ptr,  # [N] int64 out
    token_ptr,  # [N] int64 out
    vocab,
    total_drafts,
    stride_p,
    stride_l,
    stride_q,
    HAS_Q: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    i = tl.program_id(0)
    d0 = tl.load(cu_drafts_ptr + i)
    k = tl.load(cu_drafts_ptr + i + 1) - d0
    start = d0 + i  # k + 1 rows per request before it
    greedy = tl.load(greedy_ptr + i) != 0
    num_accepted = 0
    alive = 1
    for j in range(0, k):
        row = (start + j).to(tl.int64)
        x = tl.load(draft_ptr + d0 + j)
        p_x = tl.load(probs_ptr + row * stride_p + x)
        if HAS_Q:
            q_x = tl.load(q_ptr + (d0 + j).to(tl.int64) * stride_q + x)
        else:
            q_x = 1.0
        u = tl.load(u_ptr + d0 + j)
        ok = tl.where(greedy, tl.load(greedy_tokens_ptr + row) == x, u * q_x < p_x)
        alive = alive & ok.to(tl.int32)
        num_accepted += alive
    row = (start + num_accepted).to(tl.int64)
    rejected = num_accepted < k
    x = tl.load(draft_ptr + d0 + num_accepted, mask=rejected, other=-1)
    best = float("inf")
    best_index = 0
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        inside = cols < vocab
        p = tl.load(probs_ptr + row * stride_p + cols, mask=inside, other=0.0)
        if HAS_Q:
            # (At the bonus position there is no proposal: a row in bounds, unused.)
            q_row = tl.minimum(d0 + num_accepted, total_drafts - 1).to(tl.int64)
            q = tl.load(q_ptr + q_row * stride_q + cols, mask=inside, other=0.0)
            q = tl.where(rejected, q, 0.0)
        else:
            q = tl.where(cols == x, 1.0, 0.0)
        w = tl.maximum(p - q, 0.0)
        log_u = tl.load(log_u_ptr + row * stride_l + cols, mask=inside, other=-1.0)
        value = tl.where(inside, w / log_u, float("inf"))
        low = tl.min(value, axis=0)
        at = tl.argmin(value, axis=0, tie_break_left=True)
        better = low < best  # strictly: an earlier tile keeps a tie
        best_index = tl.where(better, v0 + at, best_index)
        best = tl.where(better, low, best)
    token = tl.where(greedy, tl.load(greedy_tokens_ptr + row), best_index.to(tl.int64))
    tl.store(accepted_ptr + i, num_accepted.to(tl.int64))
    tl.store(token_ptr + i, token)


def accept_and_recover(
    probs: torch.Tensor,
    log_u: torch.Tensor,
    greedy_tokens: torch.Tensor,
    greedy: torch.Tensor,
    draft_ids: torch.Tensor,
    cu_drafts: torch.Tensor,
    q: torch.Tensor | None,
    u: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted proposals per request [N], each request's last token [N]); the arguments
    as the kernel's above (greedy: [N] bool)."""
    num_requests = len(cu_drafts) - 1
    vocab = probs.shape[1]
    accepted = torch.empty(num_requests, dtype=torch.int64, device=probs.device)
    tokens = torch.empty(num_requests, dtype=torch.int64, device=probs.device)
    if num_requests == 0:
        return accepted, tokens
    has_q = q is not None and len(q) > 0
    q_arg = q if has_q else probs  # unread
    # A draw for every proposal; a non-empty tensor where there is none (never read).
    u_arg = u if len(u) else torch.zeros(1, device=probs.device)
    drafts = draft_ids if len(draft_ids) else torch.zeros(1, dtype=torch.int64, device=probs.device)
    count_launch("accept_and_recover")
    _accept_and_recover_kernel[(num_requests,)](
        probs,
        log_u,
        greedy_tokens,
        greedy.to(torch.int8),
        drafts,
        cu_drafts,
        q_arg,
        u_arg,
        accepted,
        tokens,
        vocab,
        len(draft_ids),
        probs.stride(0),
        log_u.stride(0),
        q_arg.stride(0),
        HAS_Q=has_q,
        BLOCK_V=min(4096, triton.next_power_of_2(vocab)),
    )
    return accepted, tokens
