"""Configuration of a retained activation atlas (spec section 1)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..errors import InputError

ATLAS_VARIANTS = ("local", "global", "random-local", "shuffled-patch")


@dataclass
class AtlasConfig:
    num_charts: int = field(
        default=32, metadata={"help": "K: number of k-means charts (forced to 1 by variant 'global')."}
    )
    rank: int = field(default=16, metadata={"help": "m: principal directions kept per chart."})
    variant: str = field(
        default="local",
        metadata={
            "help": f"One of {ATLAS_VARIANTS}: PCA per k-means chart, one global PCA, "
            "random orthonormal bases, or PCA bases permuted between charts."
        },
    )
    equal_support: int | None = field(
        default=None,
        metadata={
            "help": "(choice) If set, each chart's PCA uses its this-many nearest "
            "calibration vectors instead of its k-means members (spec: 128)."
        },
    )
    num_vectors: int = field(default=4096, metadata={"help": "N: calibration vectors sampled from retained examples."})
    per_example: int = field(default=2, metadata={"help": "Non-padding positions sampled per retained example."})
    seed: int = field(
        default=0, metadata={"help": "Seed for position sampling, k-means++ and the random/shuffled variants."}
    )
    restarts: int = field(default=3, metadata={"help": "k-means++ seedings tried; the lowest inertia wins."})
    max_iter: int = field(
        default=100, metadata={"help": "Maximum Lloyd iterations (stops earlier when assignments settle)."}
    )
    calibration_sample: int = field(
        default=512,
        metadata={"help": "Calibration vectors stored with the atlas, used to calibrate the residual's scale s."},
    )

    def __post_init__(self) -> None:
        if self.variant not in ATLAS_VARIANTS:
            raise InputError(f"variant: expected one of {ATLAS_VARIANTS}, got {self.variant!r}")
        if self.variant == "global":
            self.num_charts = 1
        for name in ("num_charts", "rank", "num_vectors", "per_example", "max_iter", "restarts"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise InputError(f"{name}: expected a positive integer, got {getattr(self, name)!r}")
        if self.equal_support is not None and self.equal_support <= self.rank:
            raise InputError(f"equal_support: expected more than rank={self.rank} vectors, got {self.equal_support}")

    def to_dict(self) -> dict:
        return asdict(self)
