"""The registry of known data files: where each comes from and what its bytes must hash to.

Every data file the project reads is listed in `KNOWN_FILES` with its published sha256
(see `shared/data/PROVENANCE.md`). Reading goes through `verified_path`, which refuses a
missing, truncated or corrupted file with a message that names the file, both hashes and
the command that fetches a good copy:

    python -m evaluation.data download [--dest DIR]

`download` fetches each file from its upstream URL, checks the sha256 in memory and only
then writes it (atomically), so a failed or tampered download never leaves a file behind.
`mbpp/splits.json` has no upstream: it is regenerated from the MBPP split rule and must
reproduce the published hash byte for byte.
"""

from __future__ import annotations

import gzip
import json
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from atlas_core.errors import InputError
from atlas_core.io import atomic_write_bytes, sha256_bytes, sha256_file
from atlas_core.paths import data_dir

DOWNLOAD_HINT = "python -m evaluation.data download --dest {dest}"


class DataIntegrityError(InputError):
    """A data file is missing, or its bytes are not the published ones: the user's data folder to fix
    (the message names the file and the download command), so one line from the CLI."""


@dataclass(frozen=True)
class KnownFile:
    relpath: str  # path under the data directory
    rows: int  # JSONL lines, JSON list items or (splits.json) sanitized ids
    size: int  # bytes
    sha256: str
    url: str | None = None  # upstream location; None for a file derived locally
    gunzip_of: str | None = None  # relpath of the .gz whose decompressed bytes this file is
    derived: bool = False  # regenerated from other files (splits.json)


_GSM8K = "https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data"
_MBPP = "https://raw.githubusercontent.com/google-research/google-research/master/mbpp"
_MBPP_PLUS = "https://github.com/evalplus/mbppplus_release/releases/download/v0.2.0"
_CSQA = "https://s3.amazonaws.com/commensenseqa"

# Values copied from shared/data/PROVENANCE.md. Order matters for `download`: a file is
# listed after the files it is derived from.
KNOWN_FILES: dict[str, KnownFile] = {
    f.relpath: f
    for f in [
        KnownFile(
            "gsm8k/test.jsonl",
            1319,
            749738,
            "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
            f"{_GSM8K}/test.jsonl",
        ),
        KnownFile(
            "gsm8k/train.jsonl",
            7473,
            4166206,
            "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
            f"{_GSM8K}/train.jsonl",
        ),
        KnownFile(
            "mbpp/sanitized-mbpp.json",
            427,
            255053,
            "ca95deaa9a01ef0a6f439f88bcf0dd3db3563d22f22aad6cae04ebb9a8d8c8e9",
            f"{_MBPP}/sanitized-mbpp.json",
        ),
        KnownFile(
            "mbpp/mbpp.jsonl",
            974,
            563743,
            "ccf64ceae9c5403bf50a044cb6d505bfd2a2963ee58338ba268fd65beab92a9f",
            f"{_MBPP}/mbpp.jsonl",
        ),
        KnownFile(
            "mbppplus/MbppPlus.jsonl.gz",
            378,
            336032,
            "af43697e8791c4c149bdfd6b489d8b5412507551ac20e28a439f650b8225db63",
            f"{_MBPP_PLUS}/MbppPlus.jsonl.gz",
        ),
        KnownFile(
            "mbppplus/MbppPlus-v0.2.0.jsonl",
            378,
            2592369,
            "b54e762755248ca411b523c917fa9f93c07b5ff2966bf60b3917b853926a3dad",
            gunzip_of="mbppplus/MbppPlus.jsonl.gz",
        ),
        KnownFile(
            "mbppplus/MbppPlus-NoExtreme.jsonl.gz",
            378,
            335525,
            "72d32acaea73d5606cb97041b30d45bbda9435a675369d3e31965513ee94e564",
            f"{_MBPP_PLUS}/MbppPlus-NoExtreme.jsonl.gz",
        ),
        KnownFile(
            "mbppplus/MbppPlus-OriginFmt.jsonl.gz",
            378,
            549938,
            "7a5aec547b134fa297ee6c45f829298aa3f58de02547b8d8a5c3d85d9cb10efc",
            f"{_MBPP_PLUS}/MbppPlus-OriginFmt.jsonl.gz",
        ),
        KnownFile(
            "mbpp/splits.json",
            427,
            7296,
            "2d1625b662582b206a2a2e73f7af32108d1bc9d3d2e5308f8704124727020dc7",
            derived=True,
        ),
        KnownFile(
            "csqa/dev_rand_split.jsonl",
            1221,
            471653,
            "3210497fdaae614ac085d9eb873dd7f4d49b6f965a93adadc803e1229fd8a02a",
            f"{_CSQA}/dev_rand_split.jsonl",
        ),
        KnownFile(
            "csqa/train_rand_split.jsonl",
            9741,
            3785890,
            "58ffa3c8472410e24b8c43f423d89c8a003d8284698a6ed7874355dedd09a2fb",
            f"{_CSQA}/train_rand_split.jsonl",
        ),
        KnownFile(
            "csqa/test_rand_split_no_answers.jsonl",
            1140,
            423148,
            "b426896d71a9cd064cf01cfaf6e920817c51701ef66028883ac1af2e73ad5f29",
            f"{_CSQA}/test_rand_split_no_answers.jsonl",
        ),
    ]
}


def known(relpath: str) -> KnownFile:
    try:
        return KNOWN_FILES[relpath]
    except KeyError:
        raise KeyError(f"{relpath!r} is not a known data file; known: {sorted(KNOWN_FILES)}") from None


def check_bytes(data: bytes, spec: KnownFile, where: str, dest: str | Path = "DIR") -> None:
    """Raise DataIntegrityError unless `data` are exactly the published bytes of `spec`."""
    actual = sha256_bytes(data)
    if actual != spec.sha256:
        raise DataIntegrityError(_mismatch(where, spec, actual, len(data), dest))


def verify_file(path: str | Path, spec: KnownFile) -> Path:
    """Check one file on disk against its registry entry; return its path."""
    path = Path(path)
    if not path.is_file():
        raise DataIntegrityError(
            f"{path}: data file {spec.relpath} not found. Fetch the published files with "
            f"`{DOWNLOAD_HINT.format(dest=_root_of(path, spec))}` or set ATLAS_DATA_DIR to a folder that has them."
        )
    actual = sha256_file(path)
    if actual != spec.sha256:
        raise DataIntegrityError(_mismatch(str(path), spec, actual, path.stat().st_size, _root_of(path, spec)))
    return path


def verified_path(relpath: str, root: str | Path | None = None) -> Path:
    """Path of a known data file under `root` (default: `data_dir()`), checked by sha256."""
    root = Path(root) if root is not None else data_dir()
    return verify_file(root / relpath, known(relpath))


def verify_all(root: str | Path | None = None) -> list[Path]:
    """Check every known file under `root`; raises on the first bad one."""
    return [verified_path(rel, root) for rel in KNOWN_FILES]


def _root_of(path: Path, spec: KnownFile) -> str:
    """The data directory that `path` sits in, for the re-download hint."""
    text = path.as_posix()
    if not text.endswith(spec.relpath):
        return "DIR"
    return text[: -len(spec.relpath)].rstrip("/") or "."


def _mismatch(where: str, spec: KnownFile, actual: str, size: int, dest: str | Path) -> str:
    truncated = " (shorter than published: truncated?)" if size < spec.size else ""
    return (
        f"{where}: sha256 mismatch for data file {spec.relpath}: expected {spec.sha256} "
        f"({spec.size} bytes), got {actual} ({size} bytes){truncated}. The file is corrupted or "
        f"not the published version; delete it and re-download with `{DOWNLOAD_HINT.format(dest=dest)}`."
    )


# ---------------------------------------------------------------- MBPP splits (derived file)

SPLIT_RANGES: dict[str, tuple[int, int]] = {  # google-research mbpp/README.md, inclusive
    "prompt": (1, 10),
    "test": (11, 510),
    "validation": (511, 600),
    "train": (601, 974),
}
_SPLIT_ORDER = ("train", "validation", "test", "prompt")  # key order of the published file
_RULE = (
    "task_id ranges from google-research/google-research mbpp/README.md: 1-10 prompt (few-shot), "
    "11-510 test, 511-600 validation, 601-974 train; 'For the edited subset [sanitized], the "
    "test/train/validation/prompting subsets were inherited from the above groupings.'"
)
_NOTE = (
    "Derived file (written by the data-gathering helper from the rule above); "
    "MBPP+ task_id 'Mbpp/N' corresponds to MBPP task_id N."
)


def split_of(task_id: int) -> str:
    for name, (lo, hi) in SPLIT_RANGES.items():
        if lo <= task_id <= hi:
            return name
    raise ValueError(f"MBPP task_id {task_id} is outside 1-974")


def build_splits_json(sanitized: bytes, mbpp_plus: bytes) -> bytes:
    """Regenerate `mbpp/splits.json` from sanitized-mbpp.json and MbppPlus-v0.2.0.jsonl bytes.

    The layout (key order, indent=1, ASCII, no trailing newline) is the published one, so
    the result hashes to the sha256 in KNOWN_FILES."""
    sanitized_ids = sorted(int(row["task_id"]) for row in json.loads(sanitized))
    plus_ids = sorted(
        int(json.loads(line)["task_id"].split("/")[1]) for line in mbpp_plus.decode().splitlines() if line.strip()
    )

    def by_split(ids: list[int]) -> dict[str, list[int]]:
        return {name: [i for i in ids if split_of(i) == name] for name in _SPLIT_ORDER}

    sanitized_splits, plus_splits = by_split(sanitized_ids), by_split(plus_ids)
    doc = {
        "rule": _RULE,
        "full_ranges_inclusive": {name: list(SPLIT_RANGES[name]) for name in ("prompt", "test", "validation", "train")},
        "sanitized_task_ids": sanitized_splits,
        "sanitized_counts": {k: len(v) for k, v in sanitized_splits.items()},
        "mbppplus_v0.2.0_task_ids": plus_splits,
        "mbppplus_v0.2.0_counts": {k: len(v) for k, v in plus_splits.items()},
        "note": _NOTE,
    }
    return json.dumps(doc, indent=1).encode()


# ---------------------------------------------------------------- download

Fetcher = Callable[[str], bytes]


def fetch_url(url: str, timeout: float = 60.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def download(dest: str | Path, fetch: Fetcher = fetch_url, log: Callable[[str], None] = print) -> list[Path]:
    """Fetch every known file into `dest`, checking each sha256 before it is written.

    Files already present with the right hash are kept. `fetch` maps a URL to its bytes
    (injectable so the checking path can be tested without a network)."""
    dest = Path(dest)
    written: list[Path] = []
    for spec in KNOWN_FILES.values():
        target = dest / spec.relpath
        if target.is_file() and sha256_file(target) == spec.sha256:
            log(f"ok       {spec.relpath}")
            continue
        if spec.url is not None:
            log(f"fetch    {spec.relpath} <- {spec.url}")
            data = fetch(spec.url)
        elif spec.gunzip_of is not None:
            data = gzip.decompress(verified_path(spec.gunzip_of, dest).read_bytes())
        else:  # splits.json: derived from files listed before it
            data = build_splits_json(
                verified_path("mbpp/sanitized-mbpp.json", dest).read_bytes(),
                verified_path("mbppplus/MbppPlus-v0.2.0.jsonl", dest).read_bytes(),
            )
        check_bytes(data, spec, where=spec.url or f"{target} (regenerated)", dest=dest)
        atomic_write_bytes(target, data)
        log(f"wrote    {spec.relpath} ({len(data)} bytes, sha256 ok)")
        written.append(target)
    return written
