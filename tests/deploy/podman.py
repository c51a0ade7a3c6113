"""A private podman for the image tests: its own image store under .cache/containers (never the
host's default store), its own containers.conf and network configs, and what a build needs on a
machine that reaches no container registry and only PyPI and Debian (through a TLS-inspecting
proxy):

- the stand-in for `python:3.11-slim`, built from Debian bookworm's packages (python3 3.11, the
  minor version of the official image) and tagged with the official name in this store only;
- a build-time home for `podman build -v HOME:/root:ro`: a pip.conf naming the host's CA bundle
  and a find-links folder with this machine's CPU build of torch. /root exists in every base, so
  the mount leaves nothing behind in an image (a new mount point would: buildah 1.28 keeps it).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import ssl
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.deploy.chart import ROOT

CACHE = ROOT / ".cache" / "containers"
STAND_IN = "docker.io/library/python:3.11-slim"
SUITE = "bookworm"  # its python3 is 3.11
# What the official slim image has that a Debian minbase lacks: `python`, venv with pip, CAs.
STAND_IN_PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates")
STAND_IN_CHANGES = (
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV LANG=C.UTF-8",
    'CMD ["python3"]',
)
TORCH = "torch==2.13.0"
PIP_DOWNLOAD = (sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:")
# crun refuses this machine's hybrid cgroups; root here cannot raise podman's default limits.
CONTAINERS_CONF = """[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
[network]
network_backend = "netavark"
network_config_dir = "{networks}"
"""


@dataclass(frozen=True)
class Podman:
    home: Path

    def argv(self, *args: str) -> list[str]:
        root, run = self.home / "storage", self.home / "run"
        return ["podman", "--root", str(root), "--runroot", str(run), *args]

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "CONTAINERS_CONF": str(self.home / "containers.conf")}

    def __call__(
        self, *args: str, timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            self.argv(*args), capture_output=True, text=True, env=self.env, timeout=timeout
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"podman {' '.join(args)}: {done.returncode}\n{done.stderr}")
        return done


def private_podman(home: Path = CACHE) -> Podman:
    home.mkdir(parents=True, exist_ok=True)
    (home / "networks").mkdir(exist_ok=True)
    conf = CONTAINERS_CONF.format(networks=home / "networks")
    (home / "containers.conf").write_text(conf)
    return Podman(home)


# At each commit buildah writes the layer's diff to TMPDIR (default /var/tmp), at times twice
# over (podman#22342): 2.4 GB at the peak here for the embedded image's venv, on top of the
# store's 3.1 GB. A CI run failed there with podman#22342's error for a full TMPDIR ("storing
# layer ... to file: io: read/write on closed pipe"), so the scratch goes to RAM where /dev/shm
# has room to spare, else beside the store; a failed build's report gives the free space.
SCRATCH_IN_RAM_BYTES = 8 << 30


def build_scratch(home: Path) -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free >= SCRATCH_IN_RAM_BYTES:
        scratch = shm / f"dflash-build-{hashlib.sha256(bytes(home)).hexdigest()[:8]}"
    else:
        scratch = home / "tmp"
    scratch.mkdir(exist_ok=True)
    return scratch


def free_space(home: Path, scratch: Path) -> str:
    """The free space where a build writes: the store and the scratch."""
    places = {"store": home, "scratch": scratch}
    return ", ".join(
        f"{name} {path}: {shutil.disk_usage(path).free / 2**30:.1f} GiB free"
        for name, path in places.items()
    )


def why_no_engine(podman: Podman) -> str | None:
    """Why no container can run here (a skip reason), or None."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return "needs root on Linux: the test runs podman with a private store as root"
    tools = ("podman", "runc", "iptables", "mmdebstrap")  # netavark runs iptables
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} missing: run `make tools` (scripts/install-tools.sh)"
    done = podman("info", "--format", "{{.Host.OCIRuntime.Name}}", check=False)
    if done.returncode != 0:
        return f"podman cannot run here: {done.stderr.strip()[-400:]}"
    return None


def debian_mirror() -> str:
    """The Debian mirror this machine's apt sources name (a stand-in from the same packages)."""
    for source in sorted(Path("/etc/apt").glob("sources.list*")) + sorted(
        Path("/etc/apt/sources.list.d").glob("*")
    ):
        if not source.is_file():
            continue
        for line in source.read_text().splitlines():
            words = line.split()
            if words[:1] in (["URIs:"], ["deb"]):  # deb822 or one-line format
                uris = [w for w in words[1:] if "://" in w]
                if uris and uris[0].rstrip("/").endswith("/debian"):
                    return uris[0]
    return "http://deb.debian.org/debian"


def stand_in_key(mirror: str) -> str:
    recipe = repr((SUITE, STAND_IN_PACKAGES, STAND_IN_CHANGES, mirror))
    return hashlib.sha256(recipe.encode()).hexdigest()[:16]


def ensure_stand_in(podman: Podman) -> str:
    """Build (once per recipe) and tag the stand-in base; returns how it was found."""
    mirror = debian_mirror()
    key = stand_in_key(mirror)
    fmt = '{{index .Labels "dflash.stand-in"}}'
    found = podman("image", "inspect", STAND_IN, "--format", fmt, check=False)
    if found.returncode == 0 and found.stdout.strip() == key:
        return "cached"
    # mmdebstrap installs in one apt run (debootstrap takes minutes on a busy disk); its
    # scratch rootfs goes to RAM where there is a /dev/shm.
    env = {**os.environ, "TMPDIR": "/dev/shm" if Path("/dev/shm").is_dir() else "/tmp"}
    include = f"--include={','.join(STAND_IN_PACKAGES)}"
    argv = ["mmdebstrap", "--variant=minbase", "--dpkgopt=force-unsafe-io", include, SUITE]
    log = podman.home / "stand-in.log"
    with log.open("w") as err:  # "-": the rootfs as a tar stream on stdout
        mmdebstrap = subprocess.Popen(
            [*argv, "-", mirror], stdout=subprocess.PIPE, stderr=err, env=env
        )
    assert mmdebstrap.stdout is not None
    label = f"LABEL dflash.stand-in={key}"
    changes = [a for c in (*STAND_IN_CHANGES, label) for a in ("--change", c)]
    with mmdebstrap.stdout:  # closed here too: mmdebstrap stops if the import fails
        imported = subprocess.run(
            podman.argv("import", *changes, "-", STAND_IN),
            stdin=mmdebstrap.stdout,
            capture_output=True,
            text=True,
            env=podman.env,
            timeout=600,
        )
    if mmdebstrap.wait(timeout=600) != 0 or imported.returncode != 0:
        raise RuntimeError(f"stand-in base failed: {log.read_text()[-2000:]}{imported.stderr}")
    return "built"


def ca_bundle() -> Path:
    """The host's system CA bundle: the one that trusts the TLS-inspecting proxy."""
    for candidate in (os.environ.get("PIP_CERT"), ssl.get_default_verify_paths().cafile):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return Path("/etc/ssl/certs/ca-certificates.crt")


def local_torch_wheel(wheels: Path) -> Path | None:
    """This machine's CPU build of torch as pip finds it without an index (its find-links)."""
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("torch-2.13.0+cpu-*.whl"))
    if not found:
        subprocess.run(
            [*PIP_DOWNLOAD, "--no-index", "--no-deps", TORCH, "-d", str(wheels)],
            capture_output=True,
            timeout=300,
            check=False,
        )
        found = sorted(wheels.glob("torch-2.13.0+cpu-*.whl"))
    return found[0] if found else None


def build_home(podman: Podman) -> Path:
    """The folder mounted at /root during builds: pip.conf, CA bundle, torch's wheels."""
    home = podman.home / "build-home"
    wheels = home / "wheels"
    torch = local_torch_wheel(wheels)
    if torch is not None and not (wheels / ".complete").exists():
        # torch's dependencies beside it: the Dockerfile's --index-url (download.pytorch.org,
        # unreachable here) replaces PyPI for that pip run, so find-links must hold them all.
        subprocess.run(
            [*PIP_DOWNLOAD, str(torch), "-d", str(wheels)],
            capture_output=True,
            timeout=300,
            check=True,
        )
        (wheels / ".complete").touch()
    shutil.copyfile(ca_bundle(), home / "ca.pem")
    conf = home / ".config" / "pip" / "pip.conf"
    conf.parent.mkdir(parents=True, exist_ok=True)
    # retries: pip gives up on the unreachable index at once and takes find-links' wheels.
    conf.write_text(
        "[global]\ncert = /root/ca.pem\nfind-links = /root/wheels\nretries = 1\n"
        "disable-pip-version-check = true\n"
    )
    return home
