#!/usr/bin/env python3
"""Fill docker-compose.yml's credentials volumes (installed as `splitserve-compose-credentials`).

    splitserve-compose-credentials [DIR]      # default /etc/splitserve/cluster

DIR holds one volume per name: DIR/ca (the CA's key: mounted in no other service) and
DIR/scheduler, DIR/worker, DIR/frontend, DIR/etcd, DIR/root, each of which one kind of service
mounts read-only as its --credentials. `splitserve credentials` swaps whole directories into
place, which a volume's mount point cannot be; so the cluster is made, or renewed, in a scratch
directory from what the volumes hold, and each changed file is copied back into its volume,
mode 0600, owned by the user this runs as (the images' uid 1000, the services' user). Running it
again (every `docker compose up`) keeps what is valid and changes nothing.
"""

from __future__ import annotations

import filecmp
import os
import shutil
import sys
import tempfile
from pathlib import Path

from common.credentials import ROLES, create_cluster, write_private

DEFAULT_DIR = "/etc/splitserve/cluster"
NAMES = ("ca", *ROLES)


def fill(target: Path) -> list[str]:
    """Makes or renews the cluster held in target's volumes; returns the files it wrote."""
    with tempfile.TemporaryDirectory(prefix="splitserve-credentials-") as scratch:
        work = Path(scratch) / "cluster"
        work.mkdir(mode=0o700)
        for name in NAMES:
            held = [f for f in (target / name).glob("*") if f.is_file()]
            if held:
                (work / name).mkdir(mode=0o700)
                for f in held:
                    shutil.copyfile(f, work / name / f.name)
        create_cluster(work)
        written = []
        for name in NAMES:
            volume = target / name
            volume.mkdir(mode=0o700, exist_ok=True)
            volume.chmod(0o700)
            for made in sorted((work / name).iterdir()):
                dest = volume / made.name
                if dest.is_file() and filecmp.cmp(made, dest, shallow=False):
                    continue
                write_private(dest, made.read_bytes())
                written.append(f"{name}/{made.name}")
    return written


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    target = Path(args[0] if args else DEFAULT_DIR)
    os.umask(0o077)
    try:
        written = fill(target)
    except PermissionError as exc:
        print(
            f"cannot write the credentials volumes under {target} as uid {os.getuid()}: {exc}. "
            "A volume made by an older image may belong to root: remove it "
            "(docker compose down -v) and start again.",
            file=sys.stderr,
        )
        return 1
    for name in NAMES:
        mode = oct((target / name).stat().st_mode & 0o777)
        print(f"{name:10} {target / name} ({mode})")
    print(f"wrote {', '.join(written)}" if written else "credentials in place, still valid")
    return 0


if __name__ == "__main__":
    sys.exit(main())
