"""No pickle or other code-carrying format anywhere in the project's code: the wire is
protobuf (gRPC) and JSON (HTTP); weights load from safetensors."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = [
    r"^\s*(import|from)\s+(c?pickle|cloudpickle|dill|marshal|shelve|joblib)\b",
    r"\bpickle\.loads?\b",
    r"\btorch\.load\(",  # may unpickle; weights come from safetensors
    r"\byaml\.load\(",  # full loader can build objects
    r"(?<![.\w])eval\(",
    r"(?<![.\w])exec\(",
]


def test_no_code_carrying_formats():
    offenders = []
    for folder in ("common", "scheduler_svc", "worker_svc", "splitserve", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            if "pb" in path.relative_to(ROOT).parts[:2]:
                continue  # generated protobuf code
            for lineno, line in enumerate(path.read_text().splitlines(), 1):
                for pattern in FORBIDDEN:
                    if re.search(pattern, line):
                        offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
