"""Print pyproject.toml's requirements, one a line: the base dependencies plus the extras named.

    python3 docker/project-deps.py pyproject.toml [EXTRA ...]

Used by the image build (to install dependencies in a layer that does not change with the source)
and by docker/wheelhouse.sh. Standard library only (Python 3.11+).
"""

import sys
import tomllib


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0], "rb") as fh:
        project = tomllib.load(fh)["project"]
    reqs = list(project.get("dependencies", []))
    extras = project.get("optional-dependencies", {})
    for name in argv[1:]:
        if name not in extras:
            print(f"pyproject has no extra {name!r} (has: {sorted(extras)})", file=sys.stderr)
            return 2
        reqs += extras[name]
    seen = set()
    for req in reqs:
        if req not in seen:
            seen.add(req)
            print(req)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
