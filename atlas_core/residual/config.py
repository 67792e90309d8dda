"""Configuration of the shared residual (spec section 3) and its structural variants."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# variant -> the atlas variant it needs (None: no atlas)
RESIDUAL_VARIANTS: dict[str, str | None] = {
    "plain": None,  # B A h
    "centered": "local",  # B A (h - mu(h))
    "centered-distance": "local",  # rho_d(h) B A (h - mu(h))
    "input-filter": "local",  # B A P(h)(h - mu(h))
    "atlas": "local",  # rho(h) P(h) B A P(h)(h - mu(h))   (full ATLAS)
    "global-pca": "global",  # full form with a K=1 atlas
    "random-local": "random-local",  # full form with random orthonormal local bases
    "shuffled-patch": "shuffled-patch",  # full form with bases permuted between charts
}
FULL_FORM = ("atlas", "global-pca", "random-local", "shuffled-patch")


@dataclass
class ResidualConfig:
    variant: str = field(default="atlas", metadata={"help": f"Structural variant, one of {tuple(RESIDUAL_VARIANTS)}."})
    layer: int = field(
        default=-1,
        metadata={
            "help": "Decoder layer l whose output the residual modifies (-1: the backbone's middle layer, L // 2)."
        },
    )
    rank: int = field(default=16, metadata={"help": "r: rank of the shared factors A (r x d) and B (d x r)."})
    scale: float | str = field(
        default=64.0,
        metadata={
            "help": "s in rho = ||z|| / (||z|| + s): a number, or 'calibrated' "
            "for the median ||z|| on the atlas's calibration vectors."
        },
    )
    alpha: float = field(
        default=1.0, metadata={"help": "Filter strength in P(h) x = x - alpha sum_c w_c U_c U_c^T x, in [0, 1]."}
    )
    top_n: int = field(default=4, metadata={"help": "n: charts each token is routed to."})
    seed: int = field(default=0, metadata={"help": "Seed of A's initialisation (B starts at zero)."})

    def __post_init__(self) -> None:
        if self.variant not in RESIDUAL_VARIANTS:
            raise ValueError(f"variant: expected one of {tuple(RESIDUAL_VARIANTS)}, got {self.variant!r}")
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"rank: expected a positive integer, got {self.rank!r}")
        if isinstance(self.scale, str):
            if self.scale != "calibrated":
                raise ValueError(f"scale: expected a positive number or 'calibrated', got {self.scale!r}")
        elif not self.scale > 0:
            raise ValueError(f"scale: expected a positive number or 'calibrated', got {self.scale!r}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha: expected a value in [0, 1], got {self.alpha}")
        if not isinstance(self.top_n, int) or self.top_n < 1:
            raise ValueError(f"top_n: expected a positive integer, got {self.top_n!r}")

    @property
    def atlas_variant(self) -> str | None:
        return RESIDUAL_VARIANTS[self.variant]

    def to_dict(self) -> dict:
        return asdict(self)
