"""The max-retrieval set model and task of Veličković et al., Appendix A, with the normalizer as a parameter.

Items x_i = ρ_i ‖ onehot(κ_i) with ρ_i ~ U(0, 1), κ_i ~ U{0..C−1}; a query q ~ U(0, 1); the target is the class
of the item of largest ρ. ψ_x, ψ_q, φ are two-layer GELU MLPs of width 128; one attention head aggregates.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sharp.models import registry
from sharp.models.attention import attend
from sharp.models.normalizers import PAPER_POLY


@dataclass
class MaxRetrievalConfig:
    classes: int = 10
    width: int = 128
    norm: str = "softmax"
    alpha: float = 1.5
    asentmax_delta: float = 1.0
    asentmax_s_gamma: float = 2.0
    adaptive_poly: tuple[float, ...] = PAPER_POLY

    def __post_init__(self) -> None:
        self.adaptive_poly = tuple(float(c) for c in self.adaptive_poly)
        registry.get(self.norm)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["adaptive_poly"] = list(self.adaptive_poly)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> MaxRetrievalConfig:
        return cls(**d)


def max_retrieval_batch(
    batch: int, items: int, classes: int = 10, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """x (B, n, C+1), q (B, 1), target class (B,) — Appendix A.2."""
    rho = torch.rand(batch, items, generator=generator)
    kappa = torch.randint(0, classes, (batch, items), generator=generator)
    x = torch.cat((rho.unsqueeze(-1), F.one_hot(kappa, classes).float()), dim=-1)
    q = torch.rand(batch, 1, generator=generator)
    return x, q, kappa.gather(1, rho.argmax(1, keepdim=True)).squeeze(1)


def _mlp(d_in: int, width: int, out: int, final_act: bool) -> nn.Sequential:
    layers = [nn.Linear(d_in, width), nn.GELU(), nn.Linear(width, out)]
    return nn.Sequential(*layers, nn.GELU()) if final_act else nn.Sequential(*layers)


class MaxRetrieval(nn.Module):
    def __init__(self, cfg: MaxRetrievalConfig):
        super().__init__()
        self.cfg = cfg
        w = cfg.width
        self.psi_x = _mlp(cfg.classes + 1, w, w, final_act=True)
        self.psi_q = _mlp(1, w, w, final_act=False)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(w, w) for _ in range(4))
        self.phi = _mlp(w, w, cfg.classes, final_act=False)
        spec = registry.get(cfg.norm)
        for p in spec.params:  # learned when the config carries an initial value (α); others stay at their default
            if hasattr(cfg, p.config_field):
                setattr(self, p.state_name, nn.Parameter(torch.tensor(p.to_raw(getattr(cfg, p.config_field)))))
        if spec.query_scale:
            self.w_beta, self.w_gamma = nn.Linear(w, 1), nn.Linear(w, 1)

    def forward(self, x: Tensor, q: Tensor, norm: str | None = None, return_entropy: bool = False):
        """Class logits (B, C). `norm` overrides the trained normalizer at inference (e.g. "adaptive" on a
        softmax model — the paper's inference-time sharpening)."""
        norm = norm or self.cfg.norm
        h = self.psi_x(x)  # (B, n, W)
        hq = self.psi_q(q).unsqueeze(1)  # (B, 1, W)
        qh = self.q_proj(hq).unsqueeze(1)  # (B, 1, 1, W): one head
        kh, vh = self.k_proj(h).unsqueeze(1), self.v_proj(h).unsqueeze(1)
        spec = registry.get(norm)
        kw: dict = {
            p.name: p.from_raw(getattr(self, p.state_name))
            if hasattr(self, p.state_name)
            else getattr(self.cfg, p.config_field, p.default)
            for p in spec.params
        }
        if spec.query_scale:
            # λ = δ + β log(n + 1)^γ: the query is read after the n items (position n − 1 + 1 → log(pos + 2))
            n = torch.full((x.shape[0], 1), float(x.shape[1]))
            beta = F.softplus(self.w_beta(hq.squeeze(1)))
            gamma = self.cfg.asentmax_s_gamma * torch.tanh(self.w_gamma(hq.squeeze(1)))
            kw["query_scale"] = (self.cfg.asentmax_delta + beta * torch.log(n + 1.0).pow(gamma)).view(-1, 1, 1)
        out, ent = attend(qh, kh, vh, norm=norm, poly=self.cfg.adaptive_poly, return_entropy=True, **kw)
        logits = self.phi(self.o_proj(out.view(x.shape[0], -1)))
        return (logits, ent.view(-1)) if return_entropy else logits
