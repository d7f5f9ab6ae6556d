"""The EHR Prior networks: plain `nn.Module`s over padded visit tensors.

Shapes: B sequences, V visits (right-padded), C codes per visit, O output (diagnosis) codes,
d model width, E routed experts. A visit is embedded as the mean of its code embeddings plus the
mean of the patient's static-code embeddings (sex, …), a projection of (time gap, age) and a
visit-position embedding. Three sequence encoders share that visit encoder and the output head:

- `moe`: causal transformer whose feed-forward blocks are a sparse mixture of experts (top-k
  routing over E experts plus one always-on shared expert; load-balancing and router z-losses);
- `dense`: the same transformer with one dense feed-forward block of the same active width (ablation);
- `gru`: a GRU over visits with only the generative head (Doctor-AI style baseline).

The recurrence-aware head scores every output code from the sequence state and adds, for codes
already in the patient's history, a repeat term from the state and the code's history features
(count, recency, presence in the latest visit), so repeated and new codes share one score scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

N_NUMERIC = 2  # log1p(days since the previous visit) / 5, age in years / 100 (`data.visit_tensors`)
N_HISTORY_FEATURES = 3  # log1p(count), 1 / (1 + visits since last seen), seen in the latest visit


@dataclass
class NetConfig:
    n_input_codes: int  # input vocabulary incl. 0 = padding, 1 = unknown
    n_output_codes: int  # O: diagnosis codes the model scores
    arch: str = "moe"  # moe | dense | gru
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_experts: int = 4
    top_k: int = 2
    expert_hidden: int = 64
    dropout: float = 0.1
    max_visits: int = 24
    recurrence: bool = True  # the history repeat term (off for the Doctor-AI GRU)


class VisitEncoder(nn.Module):
    def __init__(self, cfg: NetConfig):
        super().__init__()
        # EmbeddingBag averages the non-padding codes of a visit without materialising (B, V, C, d).
        self.codes = nn.EmbeddingBag(cfg.n_input_codes, cfg.d_model, mode="mean", padding_idx=0)
        self.numeric = nn.Linear(N_NUMERIC, cfg.d_model)
        self.position = nn.Embedding(cfg.max_visits, cfg.d_model)
        self.norm = nn.LayerNorm(cfg.d_model)

    def forward(self, codes: torch.Tensor, numeric: torch.Tensor, static: torch.Tensor) -> torch.Tensor:
        """codes (B, V, C), numeric (B, V, 2), static (B, S) → (B, V, d)."""
        B, V, C = codes.shape
        mean = self.codes(codes.reshape(B * V, C)).view(B, V, -1)  # (B, V, d); an empty visit gives zeros
        # Static codes share the code embeddings (the vocabulary holds them); no static code gives zeros.
        patient = self.codes(static).unsqueeze(1)  # (B, 1, d)
        positions = torch.arange(codes.shape[1], device=codes.device)  # (V,)
        return self.norm(mean + patient + self.numeric(numeric) + self.position(positions))  # (B, V, d)


def expert_mlp(d_model: int, hidden: int, dropout: float) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(), nn.Linear(hidden, d_model), nn.Dropout(dropout))


class MoEFeedForward(nn.Module):
    """Shared expert + top-k of E routed experts; each token runs only through its chosen experts."""

    def __init__(self, cfg: NetConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.shared = expert_mlp(cfg.d_model, cfg.expert_hidden, cfg.dropout)
        self.experts = nn.ModuleList(expert_mlp(cfg.d_model, cfg.expert_hidden, cfg.dropout)
                                     for _ in range(cfg.n_experts))

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])[token_mask.reshape(-1)]  # (T, d) real visits only
        logits = self.router(tokens)  # (T, E)
        probs = logits.softmax(-1)  # (T, E)
        top_p, top_i = probs.topk(self.top_k, dim=-1)  # (T, k)
        gates = top_p / top_p.sum(-1, keepdim=True)  # (T, k), renormalised over the chosen experts
        out = self.shared(tokens)  # (T, d)
        for e, expert in enumerate(self.experts):
            token_idx, slot = (top_i == e).nonzero(as_tuple=True)
            if token_idx.numel():
                out = out.index_add(0, token_idx, expert(tokens[token_idx]) * gates[token_idx, slot, None])
        # Fraction of routing assignments per expert (sums to 1) and mean router probability.
        load = F.one_hot(top_i, self.n_experts).float().sum(1).mean(0) / self.top_k  # (E,)
        importance = probs.mean(0)  # (E,)
        aux = {
            # Switch-style balance loss: equals 1 at perfectly uniform routing, grows with imbalance.
            "balance_loss": self.n_experts * (load * importance).sum(),
            # Router z-loss keeps router logits small so the softmax stays well-conditioned.
            "z_loss": torch.logsumexp(logits, -1).pow(2).mean(),
            "load": load.detach(),
        }
        full = x.new_zeros(shape[0] * shape[1], shape[-1])  # (B*V, d)
        full[token_mask.reshape(-1)] = out
        return full.reshape(shape), aux


class DenseFeedForward(nn.Module):
    def __init__(self, cfg: NetConfig):
        super().__init__()
        # Same active width as the MoE block: shared expert + top_k routed experts.
        self.mlp = expert_mlp(cfg.d_model, cfg.expert_hidden * (cfg.top_k + 1), cfg.dropout)

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.mlp(x), {}


class Block(nn.Module):
    """Pre-norm causal self-attention over visits, then the feed-forward block."""

    def __init__(self, cfg: NetConfig):
        super().__init__()
        self.n_heads, self.dropout = cfg.n_heads, cfg.dropout
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.ffn = MoEFeedForward(cfg) if cfg.arch == "moe" else DenseFeedForward(cfg)

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor, last: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """x (B, V, d) → (B, V, d); with `last` (B,) positions, only those rows' outputs → (B, 1, d).

        Only the final block of a last-visit forecast takes `last`: nothing after it reads the other
        positions, so their queries and feed-forward passes would be wasted work.
        """
        B, V, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)  # 3 × (B, V, d)
        if last is None:
            mask, causal = None, True
        else:
            x = x[torch.arange(B), last].unsqueeze(1)  # (B, 1, d)
            q = q[torch.arange(B), last].unsqueeze(1)  # (B, 1, d)
            mask = (torch.arange(V, device=x.device)[None, :] <= last[:, None]).view(B, 1, 1, V)  # (B, 1, 1, V)
            causal = False
            token_mask = token_mask.new_ones(B, 1)
        heads = (lambda t: t.view(B, -1, self.n_heads, d // self.n_heads).transpose(1, 2))  # → (B, h, ·, d/h)
        # Right padding + causal mask: a real visit never attends to a padded (later) one.
        att = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=mask, is_causal=causal,
                                             dropout_p=self.dropout if self.training else 0.0)  # (B, h, ·, d/h)
        x = x + self.proj(att.transpose(1, 2).reshape(B, -1, d))  # (B, ·, d)
        ffn_out, aux = self.ffn(self.norm2(x), token_mask)
        return x + ffn_out, aux


@dataclass
class SparseHistory:
    """History features (F) of the codes in each sequence's history, one entry per (sequence, position,
    code) with the code seen at or before that position; at the last visit only when `last_only`."""

    rows: torch.Tensor  # (M,) sequence index
    positions: torch.Tensor  # (M,) visit position
    codes: torch.Tensor  # (M,) output code id
    features: torch.Tensor  # (M, F): log1p(count), 1 / (1 + visits since last seen), seen at this position
    last_only: bool


class RecurrenceHead(nn.Module):
    """Generative scores for every output code plus a repeat term for codes in the history."""

    def __init__(self, cfg: NetConfig):
        super().__init__()
        self.recurrence = cfg.recurrence
        self.generate = nn.Linear(cfg.d_model, cfg.n_output_codes)
        if cfg.recurrence:
            self.repeat = nn.Linear(cfg.d_model, cfg.n_output_codes)
            self.feature_weights = nn.Linear(cfg.d_model, N_HISTORY_FEATURES)

    def forward(self, h: torch.Tensor, history: SparseHistory) -> torch.Tensor:
        """h (B, V, d) per position, or (B, d) at each last visit with `history.last_only` → scores (B, [V,] O).

        The repeat term is computed only where a code is in the history, so beyond the generative
        projection the cost grows with the history entries, not with the output vocabulary.
        """
        scores = self.generate(h)  # (B, [V,] O)
        if self.recurrence and history.rows.numel():
            where = (history.rows,) if history.last_only else (history.rows, history.positions)
            state = h[where]  # (M, d)
            repeat = ((state * self.repeat.weight[history.codes]).sum(-1) + self.repeat.bias[history.codes]
                      + (history.features * self.feature_weights(state)).sum(-1))  # (M,)
            scores.index_put_((*where, history.codes), repeat, accumulate=True)
        return scores

    def unseen_code_scores(self, h: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """Scores of history codes outside the output vocabulary, as an average output code would get.

        h (N, d), history (N, F) → (N,). Such codes never occur in training, so the code-specific
        weights are replaced by their mean over the output vocabulary.
        """
        generic = h @ self.generate.weight.mean(0) + self.generate.bias.mean()  # (N,)
        if not self.recurrence:
            return generic
        repeat = h @ self.repeat.weight.mean(0) + self.repeat.bias.mean()  # (N,)
        return generic + repeat + (self.feature_weights(h) * history).sum(-1)


class PriorNet(nn.Module):
    """Visits → per-visit state → scores over the O output codes for the next visit."""

    def __init__(self, cfg: NetConfig):
        super().__init__()
        self.cfg = cfg
        self.visits = VisitEncoder(cfg)
        if cfg.arch == "gru":
            self.gru = nn.GRU(cfg.d_model, cfg.d_model, batch_first=True)
        else:
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = RecurrenceHead(cfg)

    def encode(self, codes: torch.Tensor, numeric: torch.Tensor, static: torch.Tensor, lengths: torch.Tensor,
               last_only: bool = False) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
        """codes (B, V, C), numeric (B, V, 2), static (B, S), lengths (B,) → states (B, V, d), or (B, d) at
        each last real visit with `last_only`; router stats."""
        x = self.visits(codes, numeric, static)  # (B, V, d)
        token_mask = torch.arange(codes.shape[1], device=codes.device)[None, :] < lengths[:, None]  # (B, V)
        last = lengths - 1
        aux = []
        if self.cfg.arch == "gru":
            x, _ = self.gru(x)  # (B, V, d); causal by construction
            if last_only:
                x = x[torch.arange(x.shape[0]), last]  # (B, d)
        else:
            for i, block in enumerate(self.blocks):
                final = last_only and i == len(self.blocks) - 1
                x, layer_aux = block(x, token_mask, last if final else None)
                aux.append(layer_aux)
            if last_only:
                x = x.squeeze(1)  # (B, d)
        return self.norm(x), aux

    def forward(self, codes: torch.Tensor, numeric: torch.Tensor, static: torch.Tensor, lengths: torch.Tensor,
                dx: torch.Tensor, last_only: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, list[dict[str, torch.Tensor]]]:
        """Scores for the visit after each position (B, V, O), or after the last real one (B, O).

        static (B, S) holds the static-code ids, padded with 0; dx (B, V, D) each visit's output-code
        ids, padded with O. Returns (scores, states, aux).
        """
        states, aux = self.encode(codes, numeric, static, lengths, last_only)  # (B, [V,] d)
        history = history_features(dx, lengths, self.cfg.n_output_codes, last_only)
        return self.head(states, history), states, aux


def visit_multi_hot(dx: torch.Tensor, n_output_codes: int) -> torch.Tensor:
    """dx (B, V, D) output ids padded with O → (B, V, O) 0/1 floats."""
    B, V, _ = dx.shape
    hot = torch.zeros(B, V, n_output_codes + 1, device=dx.device)
    return hot.scatter_(2, dx, 1.0)[..., :n_output_codes]


def history_features(dx: torch.Tensor, lengths: torch.Tensor, n_output_codes: int, last_only: bool = False
                     ) -> SparseHistory:
    """The history features of every (sequence, code) pair of the record, at every real position from the
    code's first visit on (or at the last visit only). A record holds a few dozen codes, the output
    vocabulary up to tens of thousands, hence sparse.

    dx (B, V, D) output ids padded with O; ids in visits beyond a sequence's length do not count, and a
    repeated id within a visit counts once.
    """
    B, V, D = dx.shape
    O = n_output_codes
    visit = torch.arange(V, device=dx.device).view(1, V, 1).expand(B, V, D)
    row = torch.arange(B, device=dx.device).view(B, 1, 1).expand(B, V, D)
    real = (dx < O) & (visit < lengths.view(B, 1, 1))
    key = torch.unique((row[real] * O + dx[real]) * V + visit[real])  # one per (row, code, visit), sorted
    pairs, pair_of_key = torch.unique_consecutive(key // V, return_inverse=True)  # (P,) row * O + code
    hot = torch.zeros(len(pairs), V, device=dx.device)
    hot[pair_of_key, key % V] = 1.0  # (P, V): the pair's code in that visit
    position = torch.arange(V, device=dx.device)
    count = hot.cumsum(1)  # (P, V)
    last_seen = torch.where(hot > 0, position.float(), -1.0).cummax(1).values  # (P, V)
    rows, codes = pairs // O, pairs % O
    end = lengths[rows].unsqueeze(1)  # (P, 1)
    valid = (count > 0) & ((position == end - 1) if last_only else (position < end))
    pair, pos = valid.nonzero(as_tuple=True)  # (M,)
    seen = last_seen[pair, pos]
    features = torch.stack([torch.log1p(count[pair, pos]), 1.0 / (1.0 + pos - seen), (seen == pos).float()], dim=-1)
    return SparseHistory(rows[pair], pos, codes[pair], features, last_only)


def coded_logit_sum(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """scores (B, V, O), ids (B, V, K) output ids padded with O → (B, V): the sum of each position's scores at
    its distinct ids (an id listed twice counts once, as in a multi-hot label)."""
    O = scores.shape[-1]
    ids = ids.sort(-1).values
    repeated = torch.cat([torch.zeros_like(ids[..., :1], dtype=torch.bool), ids[..., 1:] == ids[..., :-1]], -1)
    picked = scores.gather(-1, ids.clamp(max=O - 1))  # (B, V, K)
    return torch.where((ids < O) & ~repeated, picked, 0.0).sum(-1)


def visit_losses(scores: torch.Tensor, dx: torch.Tensor, lengths: torch.Tensor, later_visits: int,
                 targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-label BCE of each position t, summed over codes: against visit t+1's codes (the task loss, mean
    over the positions that have a visit t+1) and against the union of the codes of visits t+2 … t+1+later_visits
    (the later-visits loss, mean over the positions that have a visit t+2; zero when none has).

    `targets` (B, V) bool, when given, says which visits may be the target of the visits before them: a
    position counts in the task loss only when visit t+1 may, in the later-visits loss only when every
    visit of its window may (a visit whose predecessors hold what was coded after its cutoff may not).

    BCE(l, y) = softplus(l) − l·y. The softplus term, summed over the whole output vocabulary, is the same for
    both targets and is computed once; the label term only reads the scores of the few coded ids, so no
    (B, V, O) label tensor is built, which matters with tens of thousands of output codes.
    """
    V, O = scores.shape[1:]
    dense = F.softplus(scores).sum(-1)  # (B, V)
    position = torch.arange(V, device=scores.device)[None, :]  # (1, V)

    def mean_over(mask: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return ((dense - coded_logit_sum(scores, ids)) * mask).sum() / mask.sum().clamp(min=1)

    def ahead(n: int) -> torch.Tensor:  # (B, V, D): the ids of visit t+n at position t, padded with O
        return F.pad(dx[:, n:], (0, 0, 0, n), value=O)

    # Visits beyond a sequence's end are no target at all, so they never withhold a position.
    may = torch.ones_like(position, dtype=torch.bool) if targets is None else targets | (position >= lengths[:, None])

    def allowed(n: int) -> torch.Tensor:  # (B or 1, V): visit t+n may be a target of position t
        return F.pad(may[:, n:], (0, n), value=True)

    task = mean_over((position < (lengths - 1)[:, None]) & allowed(1), ahead(1))
    steps = range(2, min(later_visits + 1, V - 1) + 1)
    if not steps:
        return task, torch.zeros((), device=scores.device)
    window = torch.stack([allowed(n) for n in steps]).all(0)
    later = mean_over((position < (lengths - 2)[:, None]) & window, torch.cat([ahead(n) for n in steps], -1))
    return task, later


def router_losses(aux: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean balance and z-losses over MoE layers (zeros for dense/GRU encoders)."""
    if not aux or "balance_loss" not in aux[0]:
        zero = torch.zeros(())
        return zero, zero
    return (torch.stack([a["balance_loss"] for a in aux]).mean(), torch.stack([a["z_loss"] for a in aux]).mean())


def n_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def init_weights(module: nn.Module) -> None:
    """Small normal init (std 0.02) for linear and embedding weights, as in GPT-style models."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding, nn.EmbeddingBag)):
            nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.padding_idx is not None:
                with torch.no_grad():
                    m.weight[m.padding_idx].zero_()


def init_output_bias(net: PriorNet, visit_ids: torch.Tensor, n_visits: int) -> None:
    """Start the generative bias at each code's log-odds among training visits.

    The first steps then learn deviations from prevalence instead of spending themselves on it.
    visit_ids (M,): the output ids of the `n_visits` training visits, once per visit that codes them.
    """
    O = net.cfg.n_output_codes
    counts = torch.bincount(visit_ids.long(), minlength=O + 1)[:O].float()  # (O,)
    prevalence = (counts / max(n_visits, 1)).clamp(1e-5, 0.5)
    with torch.no_grad():
        net.head.generate.bias.copy_(torch.log(prevalence / (1 - prevalence)))

