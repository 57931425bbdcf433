"""What a peer-compare run ran on: package versions (Mooncake, NIXL, the UCX NIXL bundles),
kvwire's, the machine and the date, as JSON."""

import ctypes
import datetime
import glob
import importlib.metadata
import json
import os
import subprocess
import sys


def ucx_version():
    import nixl_cu12

    libs = os.path.join(os.path.dirname(os.path.dirname(nixl_cu12.__file__)), "nixl_cu12.libs")
    try:
        for name in ("libucs-", "libucm-", "libuct-", "libucp-"):
            lib = ctypes.CDLL(glob.glob(os.path.join(libs, name + "*.so*"))[0], ctypes.RTLD_GLOBAL)
        lib.ucp_get_version_string.restype = ctypes.c_char_p
        return lib.ucp_get_version_string().decode()
    except (OSError, IndexError, AttributeError) as e:
        return f"unknown ({e})"


def sh(*cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout.strip()
    except OSError as e:
        return f"unknown ({e})"


def main():
    kvwire = sys.argv[1] if len(sys.argv) > 1 else "target/release/kvwire"
    model = [l.split(":", 1)[1].strip() for l in sh("lscpu").splitlines() if l.startswith("Model name")]
    print(
        json.dumps(
            {
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "kvwire": sh(kvwire, "--version"),
                "kvwire_bin": kvwire,
                "repo_commit": sh("git", "rev-parse", "--short", "HEAD"),
                "mooncake": importlib.metadata.version("mooncake-transfer-engine-non-cuda"),
                "nixl": importlib.metadata.version("nixl-cu12"),
                "ucx": ucx_version(),
                "python": sys.version.split()[0],
                "nproc": sh("nproc"),
                "cpu": model[0] if model else "unknown",
                "loadavg": open("/proc/loadavg").read().split()[:3],
                # Where every engine's KV buffers started within 4 KiB (PEERS_BUFFER_OFFSET).
                "buffer_offset": int(os.environ.get("PEERS_BUFFER_OFFSET", "0")),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
